"""Logprobs: computed on the device with the step, described on the host once the step's readback lands.

A sampled token's logprob and its row's top alternatives come from the raw model distribution
(log_softmax of the unprocessed logits), as vLLM returns by default: they describe the model, not
the sampling knobs. Prompt logprobs add each prompt token's rank. The device half (`logprob_tensors`)
reads nothing back; the host half (`describe`) turns the arrays into TokenLogprobs.

Shape legend: N rows, V vocabulary, k alternatives asked for (the most any row of the batch asked).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from locus.engine.host_transfer import Readback, to_device


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob) alternatives, best first
    rank: int | None = None  # 1 + how many tokens were likelier (prompt logprobs report it, as vLLM)


@dataclass
class LogprobTensors:
    """One batch's logprobs, on the device."""

    own: torch.Tensor  # [N] float32, each row's token's logprob
    top_ids: torch.Tensor  # [N, k] int64, best first
    top_values: torch.Tensor  # [N, k] float32
    ranks: torch.Tensor | None = None  # [N] int64 (prompt logprobs)

    def add_to(self, readback: Readback) -> list[int]:
        parts = [self.own, self.top_ids, self.top_values] + ([self.ranks] if self.ranks is not None else [])
        return [readback.add(p) for p in parts]


def logprob_tensors(raw: torch.Tensor, token_ids: torch.Tensor, k: int, ranks: bool = False) -> LogprobTensors:
    """raw [N, V] logprobs, token_ids [N] int64 (both on the device) -> each row's token's logprob, the
    row's k best and, with `ranks`, the token's rank. Device ops only."""
    own = raw.gather(1, token_ids[:, None])  # [N, 1]
    if k > 0:
        top_values, top_ids = raw.topk(min(k, raw.shape[1]), dim=-1)
    else:
        top_values, top_ids = raw.new_empty(raw.shape[0], 0), token_ids.new_empty(raw.shape[0], 0)
    rank = (raw > own).sum(dim=1) + 1 if ranks else None
    return LogprobTensors(own.squeeze(1), top_ids, top_values, rank)


def describe(token_ids: list[int], arrays: list[np.ndarray], counts: list[int | None]) -> list[TokenLogprob | None]:
    """The host half: token ids, the readback arrays of one LogprobTensors (own, top ids, top values[,
    ranks]) and how many alternatives each row asked for (None: no logprobs) -> one entry per row."""
    own, ids, values = arrays[0].tolist(), arrays[1].tolist(), arrays[2].tolist()
    ranks = arrays[3].tolist() if len(arrays) > 3 else [None] * len(token_ids)
    return [None if n is None else TokenLogprob(t, lp, list(zip(i[:n], v[:n])), r)
            for t, lp, i, v, r, n in zip(token_ids, own, ids, values, ranks, counts)]


def score_tokens(logits: torch.Tensor, token_ids: list[int], k: int) -> list[TokenLogprob]:
    """logits [N, V], one given token per row -> its logprob, its rank and the row's k best (reads
    the values back at once: for callers that want them now)."""
    raw = torch.log_softmax(logits.float(), dim=-1)
    targets = to_device(np.asarray(token_ids, dtype=np.int64), raw.device)
    readback = Readback(raw.device)
    logprob_tensors(raw, targets, k, ranks=True).add_to(readback)
    readback.issue()
    return describe(list(token_ids), readback.wait(), [k] * len(token_ids))


def compute_prompt_logprobs(logits: torch.Tensor, prompt_ids: list[int], k: int) -> list[TokenLogprob | None]:
    """logits [P, V] of the prompt's own positions (row t predicts prompt_ids[t + 1]) -> one entry per
    prompt token; the first has no context, so None (as in OpenAI's and vLLM's output)."""
    if len(prompt_ids) < 2:
        return [None] * len(prompt_ids)
    return [None, *score_tokens(logits[: len(prompt_ids) - 1], prompt_ids[1:], k)]
