"""KV cache interface and the contiguous cache used for single-sequence and small-batch decoding.

Attention talks to a cache only through `write` and `read`, per layer and per sequence span, so the
paged cache (block tables, prefix sharing) implements the same two methods.

Shape legend: S cached positions, Hkv key/value heads, D head dim.
"""

from __future__ import annotations

from typing import Protocol

import torch

from locus.engine.config import ModelConfig
from locus.engine.forward_batch import SequenceSpan


class KVCache(Protocol):
    def write(self, layer: int, span: SequenceSpan, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [span.length, Hkv, D] at positions span.start .. span.end - 1."""

    def read(self, layer: int, span: SequenceSpan, first: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values [span.end - first, Hkv, D] for positions first .. span.end - 1."""


class ContiguousKVCache:
    """One preallocated [slots, max_len, Hkv, D] tensor pair per layer; a slot is one sequence."""

    def __init__(self, config: ModelConfig, slots: int, max_len: int, dtype: torch.dtype, device: torch.device | str = "cpu"):
        shape = (slots, max_len, config.num_key_value_heads, config.head_dim)
        self.max_len = max_len
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]

    def write(self, layer: int, span: SequenceSpan, k: torch.Tensor, v: torch.Tensor) -> None:
        if span.end > self.max_len:
            raise ValueError(f"sequence reaches position {span.end}, beyond the cache's {self.max_len}")
        self.keys[layer][span.slot, span.start:span.end] = k
        self.values[layer][span.slot, span.start:span.end] = v

    def read(self, layer: int, span: SequenceSpan, first: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys[layer][span.slot, first:span.end], self.values[layer][span.slot, first:span.end]
