"""What one forward pass computes: a flat batch of tokens from one or more sequences.

Tokens of a sequence are contiguous in the batch. A sequence's span says where its KV lives
(`slot`, an id the KV cache understands) and which absolute positions its new tokens take
(`start` .. `start + length - 1`; positions before `start` are already in the cache). A prefill is a
span with start 0 (or, for chunked prefill, the first position not yet cached); a decode step is a
span of length 1.

Attention runs all sequences at once on padded tensors, so the batch also precomputes the padding
maps (built once per forward, shared by every layer).

Shape legend: T flat tokens, B sequences, Q = longest span in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from locus.engine.host_transfer import to_device


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
    memo: dict = field(default_factory=dict, repr=False)  # per-forward index tensors (caches fill it too)

    @classmethod
    def from_spans(cls, token_ids: list[list[int]], spans: list[SequenceSpan], device: torch.device | str = "cpu") -> "ForwardBatch":
        if len(token_ids) != len(spans) or any(len(t) != s.length for t, s in zip(token_ids, spans)):
            raise ValueError("every span needs exactly `length` token ids")
        flat = np.fromiter((t for seq in token_ids for t in seq), dtype=np.int64)
        positions = np.fromiter((p for s in spans for p in range(s.start, s.end)), dtype=np.int64)
        device = torch.device(device)
        # one host array, one copy that does not wait for the device (pinned memory on CUDA)
        both = to_device(np.stack([flat, positions]), device)
        return cls(input_ids=both[0], positions=both[1], spans=list(spans))

    @classmethod
    def single(cls, token_ids: list[int], start: int = 0, slot: int = 0, device: torch.device | str = "cpu") -> "ForwardBatch":
        return cls.from_spans([token_ids], [SequenceSpan(slot, start, len(token_ids))], device)

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    def row_ranges(self) -> list[tuple[SequenceSpan, int, int]]:
        """(span, first row, last row + 1) of each sequence in the flat batch."""
        out, row = [], 0
        for span in self.spans:
            out.append((span, row, row + span.length))
            row += span.length
        return out

    def query_rows(self) -> torch.Tensor:
        """[B, Q] int64: flat row of each sequence's i-th new token; -1 where the sequence is shorter."""
        if "query_rows" not in self.memo:
            self.memo["query_rows"] = to_device(self._query_rows_host(), self.device)
        return self.memo["query_rows"]

    def _query_rows_host(self) -> np.ndarray:
        lengths = np.fromiter((s.length for s in self.spans), dtype=np.int64, count=len(self.spans))
        column = np.arange(int(lengths.max()) if len(lengths) else 0, dtype=np.int64)[None, :]
        rows = (np.cumsum(lengths) - lengths)[:, None] + column
        rows[column >= lengths[:, None]] = -1
        return rows

    def unpad(self, padded: torch.Tensor) -> torch.Tensor:
        """[B, Q, ...] per-query values -> [T, ...] in flat row order (sequences are contiguous). The
        valid entries' indices come from the host: no boolean mask, which a GPU would have to count."""
        if "unpad_index" not in self.memo:
            self.memo["unpad_index"] = to_device(np.flatnonzero(self._query_rows_host().ravel() >= 0), self.device)
        return padded.flatten(0, 1).index_select(0, self.memo["unpad_index"])

    def query_positions(self) -> torch.Tensor:
        """[B, Q] absolute positions of the padded queries (-1 = padding)."""
        if "query_positions" not in self.memo:
            rows = self.query_rows()
            self.memo["query_positions"] = torch.where(rows >= 0, self.positions[rows.clamp(min=0)], -1)
        return self.memo["query_positions"]
