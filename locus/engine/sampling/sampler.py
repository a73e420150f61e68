"""Sampling: a batch of next-token logits in, one token (and its logprobs) per sequence out.

Processing order is vLLM's: logit_bias (added) -> penalties (repetition, frequency, presence) ->
min_tokens (stop tokens masked) -> output constraint (grammar) -> temperature -> top-k -> top-p ->
min-p -> draw. Greedy rows (temperature ~0) take the argmax of the biased, penalised logits and never
touch a random number generator.

Reproducibility: a seeded request must sample the same tokens alone or in any batch. So every random
row draws exactly ONE float64 uniform per step from its own generator, and the token is found by
inverse CDF over the row's (sorted, truncated) distribution; everything else is deterministic row-wise
tensor math, vectorised over the batch. Generators live on the CPU, whatever device the logits are on,
so one seed gives one random stream on any machine (a CUDA generator would give another stream).
One scalar per row per step also keeps host work tiny next to drawing V exponentials per row.

Sync-free (`Sampler.launch`): the sampler queues its work on the logits' device and reads nothing
back. What the rows' parameters decide (which rows are greedy, random, penalised or constrained; the
knobs; each random row's uniform, drawn on the host; the token ids that penalties count and that stop
tokens and grammars forbid) is built on the host with numpy and copied over without blocking
(host_transfer.to_device); the tokens, and the logprobs asked for, stay on the device until the
engine's one readback of the step. Each further per-row rule is one more device op on the [B, V]
logits fed by such a host array (a sparse per-row bias would be one index_put). `Sampler.sample` is
the synchronous form (launch, read back, advance the grammars) for callers that want tokens at once.

Logprobs are those of the raw model distribution (logprobs.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from locus.engine.host_transfer import Readback, to_device
from locus.engine.sampling.logprobs import (  # noqa: F401 - re-exported
    LogprobTensors,
    TokenLogprob,
    compute_prompt_logprobs,
    describe,
    logprob_tensors,
    score_tokens,
)
from locus.engine.sampling.params import InvalidParameter, SamplingParams  # noqa: F401 - re-exported
from locus.engine.sampling.grammar import ConstraintDeadEnd, apply_bitmasks, fill_bitmasks

# B sequences in the batch, V vocabulary, R rows sampled at random, P rows with penalties, G constrained rows


@dataclass
class SequenceSamplingState:
    """One per sequence (request x n); the engine appends each sampled token to `output_ids`."""

    params: SamplingParams
    prompt_ids: list[int]
    output_ids: list[int]
    generator: torch.Generator | None  # CPU; None = torch's global RNG (unseeded requests)
    grammar: Any = None  # an xgrammar matcher when the request asked for structured output
    json_guard: Any = None  # structured_output.JsonGuard for JSON constraints: tokens xgrammar would wrongly allow
    # tokens sampled on the device and not yet in output_ids (the overlapped schedule, core/launched_step.py)
    in_flight: int = 0
    # prompt ids as an array, built once: penalties need them every step
    _prompt_array: np.ndarray | None = field(default=None, repr=False, compare=False)
    # logit_bias as (token ids [K] int64, biases [K] float32) host arrays, built once
    _bias: tuple[np.ndarray, np.ndarray] | None = field(default=None, repr=False, compare=False)

    @classmethod
    def create(cls, params: SamplingParams, prompt_ids: list[int], index: int = 0) -> SequenceSamplingState:
        """`index` is the sequence's place among the request's n; seed + index keeps the n apart."""
        generator = None
        if params.seed is not None:
            generator = torch.Generator().manual_seed((params.seed + index) % 2**64)
        return cls(params, list(prompt_ids), [], generator)

    @property
    def generated(self) -> int:
        """Tokens sampled so far, those still on the device included."""
        return len(self.output_ids) + self.in_flight

    def prompt_array(self) -> np.ndarray:
        if self._prompt_array is None:
            self._prompt_array = np.asarray(self.prompt_ids, dtype=np.int64)
        return self._prompt_array

    def bias_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        if self._bias is None:
            bias = self.params.logit_bias or {}
            self._bias = (np.fromiter(bias, dtype=np.int64, count=len(bias)),
                          np.fromiter(bias.values(), dtype=np.float32, count=len(bias)))
        return self._bias


@dataclass
class SampleOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]  # None where the sequence asked for no logprobs


@dataclass
class SampleLaunch:
    """A batch's sampling, queued on the logits' device; nothing has been read back."""

    token_ids: torch.Tensor  # [B] int64
    logprobs: LogprobTensors | None  # when any row asked for logprobs
    logprob_counts: list[int | None]  # per row: alternatives asked for (None: no logprobs)
    dead: list[int]  # rows whose output constraint allows no token here (their token means nothing)


class Sampler:
    def __init__(self, eos_token_ids: tuple[int, ...] = (), eos_token_id: int | None = None):
        self.eos_token_ids = tuple(eos_token_ids)
        self.eos_token_id = eos_token_id  # the tokenizer's own end-of-text, one of eos_token_ids (or None)

    @torch.inference_mode()
    def launch(self, logits: torch.Tensor, states: list[SequenceSamplingState],
               argmax: torch.Tensor | None = None) -> SampleLaunch:
        """logits [B, V] (row i belongs to states[i]) -> one token per row, on the device. argmax [B]: the
        logits' argmax if the caller already has it (the forward computes it); greedy rows take it
        when no logit_bias, penalty, stop-token mask or grammar changed the logits. A batch that only
        takes it (greedy, no logprobs) never touches the logits. Reads nothing back from the device."""
        if logits.dim() != 2 or logits.shape[0] != len(states):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(states)} sequences")
        if argmax is not None and tuple(argmax.shape) != (len(states),):
            raise ValueError(f"argmax {tuple(argmax.shape)} does not match {len(states)} sequences")
        counts = [s.params.logprobs for s in states]
        if argmax is not None and self.takes_argmax(states):
            return SampleLaunch(argmax, None, counts, [])
        logits = raw = logits.float().contiguous()  # (the forward's logits may be a transposed view)
        want_logprobs = any(n is not None for n in counts)
        raw_logprobs = torch.log_softmax(logits, dim=-1) if want_logprobs else None
        logits = apply_logit_bias(logits, states)
        logits = apply_penalties(logits, states)
        logits = self.mask_stop_tokens(logits, states)
        logits, dead = self.apply_constraints(logits, states)
        tokens = argmax.clone() if argmax is not None and logits is raw else logits.argmax(dim=-1)
        rows = [i for i, s in enumerate(states) if not s.params.greedy]
        if rows:
            index = to_device(np.asarray(rows, dtype=np.int64), logits.device)
            tokens.index_copy_(0, index, sample_random(logits.index_select(0, index), [states[i] for i in rows]))
        logprobs = None
        if want_logprobs:
            logprobs = logprob_tensors(raw_logprobs, tokens, max(n or 0 for n in counts))
        return SampleLaunch(tokens, logprobs, counts, dead)

    def sample(self, logits: torch.Tensor, states: list[SequenceSamplingState],
               argmax: torch.Tensor | None = None) -> SampleOutput:
        """`launch`, then read the tokens (and logprobs) back and advance each grammar by its row's token.
        Raises ConstraintDeadEnd when a row's constraint allows no token."""
        launched = self.launch(logits, states, argmax)
        if launched.dead:
            raise ConstraintDeadEnd(f"row(s) {launched.dead}: the output constraint allows no token here")
        readback = Readback(launched.token_ids.device)
        readback.add(launched.token_ids)
        if launched.logprobs is not None:
            launched.logprobs.add_to(readback)
        readback.issue()
        arrays = readback.wait()
        token_ids = arrays[0].tolist()
        for i, s in enumerate(states):
            if s.grammar is not None and not s.grammar.accept_token(token_ids[i]):
                raise RuntimeError(f"row {i}: the grammar rejected token {token_ids[i]} it allowed")
        logprobs = describe(token_ids, arrays[1:], launched.logprob_counts) if launched.logprobs is not None \
            else [None] * len(states)
        return SampleOutput(token_ids, logprobs)

    def takes_argmax(self, states: list[SequenceSamplingState]) -> bool:
        """Whether every row's token is the raw logits' argmax (greedy, nothing changes the logits, no logprobs)."""
        return all(s.params.greedy and s.params.logprobs is None and not s.params.has_penalties and s.grammar is None
                   and not s.params.logit_bias for s in states) and not self.stop_tokens_masked(states)

    def banned_tokens(self, state: SequenceSamplingState) -> set[int]:
        """The stop tokens this sequence may not sample yet (none once min_tokens are out)."""
        if state.generated >= state.params.min_tokens:
            return set()
        return set(state.params.stop_token_ids) | (set() if state.params.ignore_eos else set(self.eos_token_ids))

    def stop_tokens_masked(self, states: list[SequenceSamplingState]) -> bool:
        """Whether any row has stop tokens banned (= a banned_tokens set not empty, without building it)."""
        eos = bool(self.eos_token_ids)
        return any(s.generated < s.params.min_tokens and (bool(s.params.stop_token_ids) or (eos and not s.params.ignore_eos))
                   for s in states)

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
        flat = to_device(np.asarray(rows, dtype=np.int64) * vocab + np.asarray(ids, dtype=np.int64), logits.device)
        masked = logits.clone(memory_format=torch.contiguous_format)
        masked.view(-1).index_fill_(0, flat, -math.inf)
        return masked

    def apply_constraints(self, logits: torch.Tensor, states: list[SequenceSamplingState]) -> tuple[torch.Tensor, list[int]]:
        """Each constrained row's grammar mask (its stop tokens before min_tokens and its JsonGuard ids
        folded in), filled on the host and applied on the device. Returns the masked logits and the
        rows left no token at all (found on the host, from the masks)."""
        rows = [i for i, s in enumerate(states) if s.grammar is not None]
        if not rows:
            return logits, []
        forbidden = []
        for i in rows:
            s = states[i]
            ids = [np.fromiter(self.banned_tokens(s), dtype=np.int64)]
            if s.json_guard is not None:
                ids.append(s.json_guard.forbidden(s.output_ids))
            forbidden.append(np.concatenate(ids))
        words = fill_bitmasks([states[i].grammar for i in rows], logits.shape[1], forbidden)
        alive = (words != 0).any(axis=1)
        dead = [i for i, a in zip(rows, alive) if not a]
        words[~alive] = -1  # a dead row samples unconstrained (its token is dropped): no row of -inf on the device
        device = logits.device
        masked = apply_bitmasks(logits, to_device(np.asarray(rows, dtype=np.int64), device), to_device(words, device))
        return masked, dead

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

    def stop_reason(self, state: SequenceSamplingState) -> int | None:
        """What a sequence its last token stopped reports as stop_reason, as vLLM's check_stop: None
        for the tokenizer's own end-of-text (unless ignore_eos), else the token id (a stop_token_ids
        entry, or one of the model's other end ids, which vLLM adds to stop_token_ids)."""
        token = state.output_ids[-1]
        return None if token == self.eos_token_id and not state.params.ignore_eos else token


def apply_logit_bias(logits: torch.Tensor, states: list[SequenceSamplingState]) -> torch.Tensor:
    """Add each row's logit_bias to its logits (a new tensor: `logits` may be the caller's, or the
    raw logits the argmax shortcut compares against). Only rows with a bias pay; the ids and biases
    travel as one host array each, the sum happens on the device."""
    flat, values, vocab = [], [], logits.shape[1]
    for i, s in enumerate(states):
        if s.params.logit_bias:
            token_ids, biases = s.bias_arrays()
            flat.append(i * vocab + token_ids)
            values.append(biases)
    if not flat:
        return logits
    device = logits.device
    biased = logits.clone(memory_format=torch.contiguous_format)
    biased.view(-1).index_add_(0, to_device(np.concatenate(flat), device),
                               to_device(np.concatenate(values), device).to(logits.dtype))
    return biased


def apply_penalties(logits: torch.Tensor, states: list[SequenceSamplingState]) -> torch.Tensor:
    """Repetition (prompt + output: positive logits divided, negative multiplied), then frequency
    (x count) and presence (once) over output tokens, subtracted. Only rows with penalties pay.
    The counts are built on the device from host ids; nothing is read back."""
    rows = [i for i, s in enumerate(states) if s.params.has_penalties]
    if not rows:
        return logits
    chosen = [states[i] for i in rows]
    device, vocab = logits.device, logits.shape[1]
    counts = count_tokens([np.asarray(s.output_ids, dtype=np.int64) for s in chosen], vocab, device)  # [P, V]
    in_prompt = count_tokens([s.prompt_array() for s in chosen], vocab, device) > 0
    knobs = np.array([[s.params.repetition_penalty, s.params.frequency_penalty, s.params.presence_penalty]
                      for s in chosen], dtype=np.float64)
    knobs = to_device(knobs, device).to(logits.dtype)  # [P, 3]
    rep, freq, pres = knobs[:, 0:1], knobs[:, 1:2], knobs[:, 2:3]
    index = to_device(np.asarray(rows, dtype=np.int64), device)
    sub = logits.index_select(0, index)
    seen = in_prompt | (counts > 0)
    sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
    sub = sub - freq * counts - pres * (counts > 0).to(sub.dtype)
    # a tiny repetition_penalty (5e-324 is 0 in float32) overflows a logit to inf: keep it the largest finite
    # value, so the row's distribution stays defined (inf would make it NaN, and the draw fail)
    sub = torch.nan_to_num(sub, nan=-math.inf, posinf=torch.finfo(sub.dtype).max)
    return logits.index_copy(0, index, sub)


def count_tokens(id_arrays: list[np.ndarray], vocab: int, device: torch.device) -> torch.Tensor:
    """[P, V] float32 occurrence counts of each row's token ids (host int64 arrays), on `device`."""
    counts = torch.zeros(len(id_arrays), vocab, dtype=torch.float32, device=device)
    lengths = [len(ids) for ids in id_arrays]
    if sum(lengths) == 0:
        return counts
    row = np.repeat(np.arange(len(id_arrays), dtype=np.int64), lengths)
    ids = np.concatenate(id_arrays)
    # an id outside the model's vocabulary would be a device-side assert on CUDA; it has no logit anyway
    inside = (ids >= 0) & (ids < vocab)
    flat = row[inside] * vocab + ids[inside]
    if not len(flat):
        return counts
    counts.view(-1).index_add_(0, to_device(flat, device), torch.ones(len(flat), dtype=torch.float32, device=device))
    return counts


def sample_random(logits: torch.Tensor, states: list[SequenceSamplingState]) -> torch.Tensor:
    """logits [R, V] penalised -> [R] token ids, one uniform draw per row from its own generator."""
    device, vocab = logits.device, logits.shape[1]
    # the rows' knobs and uniforms, one host array and one copy: temperature, top_k, top_p, min_p, uniform
    knobs = torch.empty(len(states), 5, dtype=torch.float64)
    knobs[:, :4] = torch.from_numpy(np.array(
        [[s.params.temperature, s.params.top_k if s.params.top_k > 0 else vocab, s.params.top_p, s.params.min_p]
         for s in states], dtype=np.float64))
    for i, s in enumerate(states):  # = torch.rand((), generator=s.generator, dtype=torch.float64)
        knobs[i, 4:5].uniform_(0, 1, generator=s.generator)
    knobs = to_device(knobs, device)
    logits = logits / knobs[:, 0:1].float()
    # Stable sort: ties keep vocabulary order, so top_k=1 picks what argmax picks.
    sorted_logits, order = torch.sort(logits, dim=-1, descending=True, stable=True)  # [R, V]
    # knobs nobody in the batch uses stay None: no work
    top_k = knobs[:, 1:2].long() if any(s.params.top_k > 0 for s in states) else None
    top_p = knobs[:, 2:3].float() if any(s.params.top_p < 1 for s in states) else None
    min_p = knobs[:, 3:4].float() if any(s.params.min_p > 0 for s in states) else None
    keep = truncate(sorted_logits, top_k, top_p, min_p)
    probs = torch.softmax(sorted_logits.masked_fill(~keep, -math.inf), dim=-1)
    position = draw_inverse_cdf(probs, knobs[:, 4])
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
    return torch.minimum(position, last).clamp_(min=0)  # (a row without mass, NaN logits: never index -1)
