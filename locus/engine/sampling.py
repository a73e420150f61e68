"""Sampling: a batch of next-token logits in, one token (and its logprobs) per sequence out.

Processing order is vLLM's: logit_bias (added) -> penalties (repetition, frequency, presence) ->
min_tokens (stop tokens masked) -> temperature -> top-k -> top-p -> min-p -> draw. Greedy rows
(temperature ~0) take the argmax of the biased, penalised logits and never touch a random number
generator.

Reproducibility: a seeded request must sample the same tokens alone or in any batch. So every random
row draws exactly ONE float64 uniform per step from its own generator, and the token is found by
inverse CDF over the row's (sorted, truncated) distribution; everything else is deterministic row-wise
tensor math, vectorised over the batch. Generators live on the CPU, whatever device the logits are on,
so one seed gives one random stream on any machine (a CUDA generator would give another stream).
One scalar per row per step also keeps host work tiny next to drawing V exponentials per row.

Logprobs are those of the raw model distribution (log_softmax of the unprocessed logits), as vLLM
returns by default: they describe the model, not the sampling knobs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from locus.engine.sampling_params import InvalidParameter, SamplingParams  # noqa: F401 - re-exported
from locus.engine.structured_output import ConstraintDeadEnd, apply_grammar_masks

# B sequences in the batch, V vocabulary, R rows sampled at random, P rows with penalties

@dataclass
class SequenceSamplingState:
    """One per sequence (request x n); the engine appends each sampled token to `output_ids`."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    generator: torch.Generator | None  # CPU; None = torch's global RNG (unseeded requests)
    grammar: Any = None  # an xgrammar matcher when the request asked for structured output
    json_guard: Any = None  # structured_output.JsonGuard for JSON constraints: tokens xgrammar would wrongly allow
    # prompt ids as a tensor, built once: penalties need them every step
    _prompt_tensor: torch.Tensor | None = field(default=None, repr=False, compare=False)
    # logit_bias as (token ids [K] long, biases [K] float32), built once
    _bias: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False, compare=False)

    @classmethod
    def create(cls, params: SamplingParams, prompt_ids: list[int], index: int = 0) -> SequenceSamplingState:
        """`index` is the sequence's place among the request's n; seed + index keeps the n apart."""
        generator = None
        if params.seed is not None:
            generator = torch.Generator().manual_seed((params.seed + index) % 2**64)
        return cls(params, list(prompt_ids), [], generator)

    def prompt_tensor(self) -> torch.Tensor:
        if self._prompt_tensor is None:
            self._prompt_tensor = torch.tensor(self.prompt_ids, dtype=torch.long)
        return self._prompt_tensor

    def bias_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._bias is None:
            bias = self.params.logit_bias or {}
            self._bias = (torch.tensor(list(bias), dtype=torch.long),
                          torch.tensor(list(bias.values()), dtype=torch.float32))
        return self._bias


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob) alternatives, best first
    rank: int | None = None  # 1 + how many tokens were likelier (prompt logprobs report it, as vLLM)


@dataclass
class SampleOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]  # None where the sequence asked for no logprobs


class Sampler:
    def __init__(self, eos_token_ids: tuple[int, ...] = ()):
        self.eos_token_ids = tuple(eos_token_ids)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, states: list[SequenceSamplingState],
               argmax: torch.Tensor | None = None) -> SampleOutput:
        """logits [B, V] (row i belongs to states[i]) -> one token per row. argmax [B]: the logits'
        argmax if the caller already has it (the compiled decode graph computes it); greedy rows take
        it when no logit_bias, penalty, stop-token mask or grammar changed the logits. A batch that
        only takes it (greedy, no logprobs) never reads the logits."""
        if logits.dim() != 2 or logits.shape[0] != len(states):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(states)} sequences")
        if argmax is not None and tuple(argmax.shape) != (len(states),):
            raise ValueError(f"argmax {tuple(argmax.shape)} does not match {len(states)} sequences")
        if argmax is not None and all(
                s.params.greedy and s.params.logprobs is None and not s.params.has_penalties and s.grammar is None
                and not s.params.logit_bias for s in states) and not self.stop_tokens_masked(states):
            return SampleOutput(argmax.tolist(), [None] * len(states))
        logits = raw = logits.float()
        want_logprobs = any(s.params.logprobs is not None for s in states)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        logits = apply_logit_bias(logits, states)
        logits = apply_penalties(logits, states)
        logits = self.mask_stop_tokens(logits, states)
        matchers = [s.grammar for s in states]
        constrained = any(m is not None for m in matchers)
        if constrained:
            logits = apply_grammar_masks(logits, matchers)
            for i, s in enumerate(states):
                if s.json_guard is not None:
                    logits[i, s.json_guard.forbidden(s.output_ids).to(logits.device)] = -math.inf
            dead = torch.isneginf(logits).all(dim=-1)
            if bool(dead.any()):  # a constraint (with the stop-token mask) left a row no token at all
                rows = dead.nonzero().flatten().tolist()
                raise ConstraintDeadEnd(f"row(s) {rows}: the output constraint allows no token here")
        tokens = argmax.clone() if argmax is not None and logits is raw else logits.argmax(dim=-1)
        rows = [i for i, s in enumerate(states) if not s.params.greedy]
        if rows:
            index = torch.tensor(rows, device=logits.device)
            tokens[index] = sample_random(logits[index], [states[i] for i in rows])
        token_ids = tokens.tolist()
        if constrained:  # advance each grammar by its row's token
            for i, m in enumerate(matchers):
                if m is not None and not m.accept_token(token_ids[i]):
                    raise RuntimeError(f"row {i}: the grammar rejected token {token_ids[i]} it allowed")
        return SampleOutput(token_ids, gather_logprobs(raw_logprobs, token_ids, states))

    def banned_tokens(self, state: SequenceSamplingState) -> set[int]:
        """The stop tokens this sequence may not sample yet (none once min_tokens are out)."""
        if len(state.output_ids) >= state.params.min_tokens:
            return set()
        return set(state.params.stop_token_ids) | (set() if state.params.ignore_eos else set(self.eos_token_ids))

    def stop_tokens_masked(self, states: list[SequenceSamplingState]) -> bool:
        return any(self.banned_tokens(s) for s in states)

    def mask_stop_tokens(self, logits: torch.Tensor, states: list[SequenceSamplingState]) -> torch.Tensor:
        """Forbid stop tokens (EOS unless ignore_eos, and stop_token_ids) until min_tokens are out."""
        rows, ids = [], []
        vocab = logits.shape[1]
        for i, s in enumerate(states):
            for t in sorted(self.banned_tokens(s)):
                if 0 <= t < vocab:
                    rows.append(i)
                    ids.append(t)
        if not rows:
            return logits
        where = (torch.tensor(rows, device=logits.device), torch.tensor(ids, device=logits.device))
        return logits.index_put(where, torch.tensor(-math.inf, device=logits.device))

    def finish_reason(self, state: SequenceSamplingState) -> str | None:
        """After the engine appended a token: "stop" (a stop token), "length" (max_tokens), or None.
        Stop strings are the detokenizer's job; the context limit is the engine's."""
        p, out = state.params, state.output_ids
        if state.grammar is not None and state.grammar.is_terminated():
            return "stop"  # the grammar is complete (its stop token was sampled)
        if out and len(out) >= p.min_tokens:
            if out[-1] in p.stop_token_ids or (not p.ignore_eos and out[-1] in self.eos_token_ids):
                return "stop"
        if p.max_tokens is not None and len(out) >= p.max_tokens:
            return "length"
        return None


def apply_logit_bias(logits: torch.Tensor, states: list[SequenceSamplingState]) -> torch.Tensor:
    """Add each row's logit_bias to its logits (a new tensor: `logits` may be the caller's, or the
    raw logits the argmax shortcut compares against). Only rows with a bias pay."""
    rows, ids, values = [], [], []
    for i, s in enumerate(states):
        if s.params.logit_bias:
            token_ids, biases = s.bias_tensors()
            rows.append(torch.full_like(token_ids, i))
            ids.append(token_ids)
            values.append(biases)
    if not rows:
        return logits
    device = logits.device
    where = (torch.cat(rows).to(device), torch.cat(ids).to(device))
    return logits.index_put(where, torch.cat(values).to(device=device, dtype=logits.dtype), accumulate=True)


def apply_penalties(logits: torch.Tensor, states: list[SequenceSamplingState]) -> torch.Tensor:
    """Repetition (prompt + output: positive logits divided, negative multiplied), then frequency
    (x count) and presence (once) over output tokens, subtracted. Only rows with penalties pay."""
    rows = [i for i, s in enumerate(states) if s.params.has_penalties]
    if not rows:
        return logits
    chosen = [states[i] for i in rows]
    device, vocab = logits.device, logits.shape[1]
    counts = count_tokens([torch.tensor(s.output_ids, dtype=torch.long) for s in chosen], vocab, device)  # [P, V]
    in_prompt = count_tokens([s.prompt_tensor() for s in chosen], vocab, device) > 0
    column = lambda values: torch.tensor(values, dtype=logits.dtype, device=device)[:, None]  # noqa: E731
    rep = column([s.params.repetition_penalty for s in chosen])
    freq = column([s.params.frequency_penalty for s in chosen])
    pres = column([s.params.presence_penalty for s in chosen])
    index = torch.tensor(rows, device=device)
    sub = logits[index]
    seen = in_prompt | (counts > 0)
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    sub = sub - freq * counts - pres * (counts > 0).to(sub.dtype)
    # a tiny repetition_penalty (5e-324 is 0 in float32) overflows a logit to inf: keep it the largest finite
    # value, so the row's distribution stays defined (inf would make it NaN, and the draw fail)
    sub = torch.nan_to_num(sub, nan=-math.inf, posinf=torch.finfo(sub.dtype).max)
    return logits.index_copy(0, index, sub)


def count_tokens(id_lists: list[torch.Tensor], vocab: int, device: torch.device) -> torch.Tensor:
    """[P, V] float32 occurrence counts of each row's token ids (CPU long tensors)."""
    counts = torch.zeros(len(id_lists), vocab, dtype=torch.float32, device=device)
    lengths = torch.tensor([len(ids) for ids in id_lists])
    if int(lengths.sum()) == 0:
        return counts
    row = torch.repeat_interleave(torch.arange(len(id_lists)), lengths)
    ids = torch.cat(id_lists)
    # an id outside the model's vocabulary would be a device-side assert on CUDA; it has no logit anyway
    inside = (ids >= 0) & (ids < vocab)
    row, ids = row[inside].to(device), ids[inside].to(device)
    return counts.index_put_((row, ids), torch.ones_like(ids, dtype=torch.float32), accumulate=True)


def sample_random(logits: torch.Tensor, states: list[SequenceSamplingState]) -> torch.Tensor:
    """logits [R, V] penalised -> [R] token ids, one uniform draw per row from its own generator."""
    device = logits.device
    column = lambda values, dtype=torch.float32: torch.tensor(values, dtype=dtype, device=device)[:, None]  # noqa: E731
    logits = logits / column([s.params.temperature for s in states])
    # Stable sort: ties keep vocabulary order, so top_k=1 picks what argmax picks.
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)  # [R, V]
    vocab = logits.shape[1]
    # knobs nobody in the batch uses stay None: no work, and no device sync on checking them
    top_k = top_p = min_p = None
    if any(s.params.top_k > 0 for s in states):
        top_k = column([s.params.top_k if s.params.top_k > 0 else vocab for s in states], torch.long)
    if any(s.params.top_p < 1 for s in states):
        top_p = column([s.params.top_p for s in states])
    if any(s.params.min_p > 0 for s in states):
        min_p = column([s.params.min_p for s in states])
    keep = truncate(sorted_logits, top_k, top_p, min_p)
    probs = torch.softmax(sorted_logits.masked_fill(~keep, -math.inf), dim=-1)
    uniforms = torch.stack([torch.rand((), generator=s.generator, dtype=torch.float64) for s in states]).to(device)
    position = draw_inverse_cdf(probs, uniforms)
    return order.gather(1, position[:, None]).squeeze(1)


def truncate(sorted_logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
             min_p: torch.Tensor | None) -> torch.Tensor:
    """[R, V] descending logits -> [R, V] bool keep mask, always a prefix holding at least the top token.
    top_k / top_p / min_p are [R, 1] or None (off for every row); per row, top_k = V means off."""
    keep = torch.ones_like(sorted_logits, dtype=torch.bool)
    if top_k is not None:
        keep &= torch.arange(sorted_logits.shape[1], device=sorted_logits.device)[None, :] < top_k
    if top_p is not None:
        probs = torch.softmax(sorted_logits.masked_fill(~keep, -math.inf), dim=-1)
        # keep the smallest prefix whose mass reaches top_p; rows with top_p = 1 are left alone so
        # that rounding in the cumulative sum never drops a tail token
        mass_before = probs.cumsum(dim=-1) - probs
        keep &= (mass_before < top_p) | (top_p >= 1)
        keep[:, 0] = True  # a top_p under float32's least positive value is 0 here, which would keep nothing
    if min_p is not None:
        probs = torch.softmax(sorted_logits.masked_fill(~keep, -math.inf), dim=-1)
        keep &= probs >= min_p * probs[:, :1]
    return keep


def draw_inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """probs [R, V] (zeros only in a tail), uniforms [R] float64 in [0, 1) -> [R] positions, each with
    probability probs[r, j] / sum(probs[r])."""
    cdf = probs.double().cumsum(dim=-1)
    target = (uniforms * cdf[:, -1])[:, None]
    position = torch.searchsorted(cdf, target, right=True).squeeze(1)
    # u * total can round up to total; never step past the last token with mass
    last = (probs > 0).sum(dim=-1) - 1
    return torch.minimum(position, last)


def gather_logprobs(raw: torch.Tensor | None, token_ids: list[int],
                    states: list[SequenceSamplingState]) -> list[TokenLogprob | None]:
    """raw [B, V] log_softmax of the model's logits -> per row the sampled token's logprob and top-n."""
    if raw is None:
        return [None] * len(states)
    k = max(s.params.logprobs or 0 for s in states)
    rows = describe_tokens(raw, token_ids, k)
    return [None if s.params.logprobs is None else _first(row, s.params.logprobs) for s, row in zip(states, rows)]


def compute_prompt_logprobs(logits: torch.Tensor, prompt_ids: list[int], k: int) -> list[TokenLogprob | None]:
    """logits [P, V] of the prompt's own positions (row t predicts prompt_ids[t + 1]) -> one entry per
    prompt token; the first has no context, so None (as in OpenAI's and vLLM's output)."""
    if len(prompt_ids) < 2:
        return [None] * len(prompt_ids)
    return [None, *score_tokens(logits[: len(prompt_ids) - 1], prompt_ids[1:], k)]


def score_tokens(logits: torch.Tensor, token_ids: list[int], k: int) -> list[TokenLogprob]:
    """logits [N, V], one given token per row -> its logprob, its rank and the row's k best."""
    raw = torch.log_softmax(logits.float(), dim=-1)
    described = describe_tokens(raw, token_ids, k)
    own = raw.gather(1, torch.tensor(token_ids, device=raw.device)[:, None])
    for entry, rank in zip(described, ((raw > own).sum(dim=1) + 1).tolist()):
        entry.rank = rank
    return described


def describe_tokens(raw: torch.Tensor, token_ids: list[int], k: int) -> list[TokenLogprob]:
    """raw [N, V] logprobs, one token per row -> its logprob and the row's k best, best first."""
    own = raw.gather(1, torch.tensor(token_ids, device=raw.device)[:, None]).squeeze(1).tolist()
    if k == 0:
        return [TokenLogprob(t, lp, []) for t, lp in zip(token_ids, own)]
    values, ids = raw.topk(min(k, raw.shape[1]), dim=-1)
    return [TokenLogprob(t, lp, list(zip(i, v))) for t, lp, i, v in zip(token_ids, own, ids.tolist(), values.tolist())]


def _first(row: TokenLogprob, n: int) -> TokenLogprob:
    return TokenLogprob(row.token_id, row.logprob, row.top[:n])
