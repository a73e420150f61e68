"""What one forward pass computes: a flat batch of tokens from one or more sequences.

Tokens of a sequence are contiguous in the batch. A sequence's span says where its KV lives
(`slot`, an id the KV cache understands) and which absolute positions its new tokens take
(`start` .. `start + length - 1`; positions before `start` are already in the cache). A prefill is a
span with start 0 (or, for chunked prefill, the first position not yet cached); a decode step is a
span of length 1.

The contiguous cache (kv_cache.py) maps a slot to a row of a preallocated tensor; a paged cache maps
it to a block table. The model never sees the difference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SequenceSpan:
    slot: int  # the sequence's KV-cache handle
    start: int  # absolute position of the span's first token
    length: int  # tokens of this sequence in the batch

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, absolute positions
    spans: list[SequenceSpan]  # in batch order; lengths sum to T

    @classmethod
    def from_spans(cls, token_ids: list[list[int]], spans: list[SequenceSpan], device: torch.device | str = "cpu") -> "ForwardBatch":
        if len(token_ids) != len(spans) or any(len(t) != s.length for t, s in zip(token_ids, spans)):
            raise ValueError("every span needs exactly `length` token ids")
        flat = [t for seq in token_ids for t in seq]
        positions = [p for s in spans for p in range(s.start, s.end)]
        return cls(
            input_ids=torch.tensor(flat, dtype=torch.long, device=device),
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            spans=list(spans),
        )

    @classmethod
    def single(cls, token_ids: list[int], start: int = 0, slot: int = 0, device: torch.device | str = "cpu") -> "ForwardBatch":
        return cls.from_spans([token_ids], [SequenceSpan(slot, start, len(token_ids))], device)

    def row_ranges(self) -> list[tuple[SequenceSpan, int, int]]:
        """(span, first row, last row + 1) of each sequence in the flat batch."""
        out, row = [], 0
        for span in self.spans:
            out.append((span, row, row + span.length))
            row += span.length
        return out
