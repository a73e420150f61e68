"""KV caches: the interface attention uses, a contiguous cache and the paged cache.

Attention talks to a cache through two calls per layer: `write` the batch's new keys/values, then
`read` every sequence's visible keys/values as one padded tensor. Both caches store each layer as one
flat [capacity, Hkv, D] tensor and differ only in how (sequence, position) maps to a flat row:
- ContiguousKVCache: row = slot * max_len + position (one preallocated stripe per sequence);
- PagedKVCache: row = block_table[slot][position // block_size] * block_size + position % block_size,
  so sequences own fixed-size blocks from a shared pool (allocated by core/block_manager.py) and
  identical prompt prefixes can share blocks.
The per-batch index tensors are computed once per forward and memoised on the batch.

Shape legend: T batch tokens, B sequences, S longest visible key range, Hkv kv heads, D head dim.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch

from locus.engine.host_transfer import to_device
from locus.engine.model.config import ModelConfig
from locus.engine.model.forward_batch import ForwardBatch


class KVCache(Protocol):
    def write(self, layer: int, batch: ForwardBatch, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store the batch's new k, v [T, Hkv, D] at their sequences' positions."""

    def read(self, layer: int, batch: ForwardBatch, chunk_size: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """k, v [B, S, Hkv, D] and key positions [B, S] (-1 = padding) of what each sequence's new
        tokens may see: positions from the start of the earliest query's attention chunk (0 when
        chunk_size is None) up to the sequence's last new token."""

    def attend(self, layer: int, batch: ForwardBatch, q: torch.Tensor, chunk_size: int | None,
               scale: float) -> torch.Tensor | None:
        """The attention output [T, Hq, D] of q [T, Hq, D] computed by the cache itself (a paged
        kernel that reads the pool in place), or None: attention reads k, v with `read`."""


def first_visible(start: int, chunk_size: int | None) -> int:
    """Earliest key position that any query at position >= start can see."""
    return 0 if chunk_size is None else (start // chunk_size) * chunk_size


class FlatKVCache:
    """Shared mechanics; subclasses map (sequence b of the batch, positions [B, S]) to flat rows."""

    def __init__(self, config: ModelConfig, capacity: int, dtype: torch.dtype, device: torch.device | str):
        # Per token and layer: [Hkv, D] keys and values, or what the family caches instead (a DeepSeek
        # layer's latent and rotated key: ModelConfig.kv_cache_dims).
        key_dims, value_dims = config.kv_cache_dims()
        self.keys = [torch.zeros((capacity, *key_dims), dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]
        self.values = [torch.zeros((capacity, *value_dims), dtype=dtype, device=device) for _ in range(config.num_hidden_layers)]

    def rows(self, batch: ForwardBatch, seq_index: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flat rows of `positions` (any shape) of the batch's sequences `seq_index` (same shape)."""
        raise NotImplementedError

    def _write_rows(self, batch: ForwardBatch) -> torch.Tensor:
        key = ("write_rows", id(self))
        if key not in batch.memo:
            lengths = torch.tensor([s.length for s in batch.spans], device=batch.device)
            seq_index = torch.repeat_interleave(torch.arange(len(batch.spans), device=batch.device), lengths)
            batch.memo[key] = self.rows(batch, seq_index, batch.positions)
        return batch.memo[key]

    def _read_rows(self, batch: ForwardBatch, chunk_size: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        key = ("read_rows", id(self), chunk_size)
        if key not in batch.memo:
            dev = batch.device
            firsts = torch.tensor([first_visible(s.start, chunk_size) for s in batch.spans], device=dev)
            ends = torch.tensor([s.end for s in batch.spans], device=dev)
            S = int((ends - firsts).max())
            pos = firsts[:, None] + torch.arange(S, device=dev)[None, :]  # [B, S]
            valid = pos < ends[:, None]
            pos = torch.where(valid, pos, firsts[:, None])  # padding reads a real row; the mask hides it
            seq_index = torch.arange(len(batch.spans), device=dev)[:, None].expand_as(pos)
            rows = self.rows(batch, seq_index, pos)
            batch.memo[key] = (rows, torch.where(valid, pos, -1))
        return batch.memo[key]

    def write(self, layer: int, batch: ForwardBatch, k: torch.Tensor, v: torch.Tensor) -> None:
        rows = self._write_rows(batch)
        self.keys[layer].index_copy_(0, rows, k)
        self.values[layer].index_copy_(0, rows, v)

    def attend(self, layer: int, batch: ForwardBatch, q: torch.Tensor, chunk_size: int | None, scale: float) -> None:
        return None

    def read(self, layer: int, batch: ForwardBatch, chunk_size: int | None):
        rows, pos = self._read_rows(batch, chunk_size)
        return self.keys[layer][rows], self.values[layer][rows], pos


class ContiguousKVCache(FlatKVCache):
    """`slots` sequences of up to `max_len` positions each."""

    def __init__(self, config: ModelConfig, slots: int, max_len: int, dtype: torch.dtype, device: torch.device | str = "cpu"):
        super().__init__(config, slots * max_len, dtype, device)
        self.slots, self.max_len = slots, max_len

    def rows(self, batch: ForwardBatch, seq_index: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        slots = torch.tensor([s.slot for s in batch.spans], device=batch.device)
        if int(slots.max()) >= self.slots or int(slots.min()) < 0:
            raise ValueError(f"cache slot out of range 0..{self.slots - 1}")
        if max(s.end for s in batch.spans) > self.max_len:
            raise ValueError(f"a sequence reaches position {max(s.end for s in batch.spans)}, beyond the cache's {self.max_len}")
        return slots[seq_index] * self.max_len + positions


class PagedKVCache(FlatKVCache):
    """A pool of `num_blocks` blocks of `block_size` positions; `bind` gives each slot its block table.

    One more block, `scratch_block`, is never handed out: the compiled decode step (runner/decode_graph.py)
    pads its batch to a fixed size, and the padding rows write their keys/values there.
    """

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device | str = "cpu"):
        super().__init__(config, (num_blocks + 1) * block_size, dtype, device)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.scratch_block = num_blocks

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.tensor([], dtype=dtype).element_size()
        (kr, kd), (vr, vd) = config.kv_cache_dims()
        return config.num_hidden_layers * block_size * (kr * kd + vr * vd) * elem

    def bind(self, batch: ForwardBatch, block_tables: dict[int, list[int]]) -> None:
        """Give `batch` the block tables of its sequences (slot -> block ids in position order), as a
        [B, max blocks] padded tensor kept in the batch itself: two batches may run at once (expert
        parallelism's overlapped micro-batches), so the cache holds no per-forward state."""
        tables = [block_tables[s.slot] for s in batch.spans]
        for s, table in zip(batch.spans, tables):
            if len(table) * self.block_size < s.end:
                raise ValueError(f"sequence slot {s.slot} reaches position {s.end} but holds {len(table)} blocks")
        width = max((len(t) for t in tables), default=1)
        padded = np.array([t + [0] * (width - len(t)) for t in tables], dtype=np.int64).reshape(len(tables), width)
        batch.memo[("block_tables", id(self))] = to_device(padded, batch.device)  # (no wait for the device)

    def rows(self, batch: ForwardBatch, seq_index: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        tables = batch.memo.get(("block_tables", id(self)))
        if tables is None:
            raise RuntimeError("PagedKVCache.bind(batch, ...) must give the batch its block tables before the forward")
        return tables[seq_index, positions // self.block_size] * self.block_size + positions % self.block_size

    def copy_block(self, src: int, dst: int) -> None:
        """Copy one block's KV in every layer (copy-on-write when sequences fork)."""
        bs = self.block_size
        for cache in (*self.keys, *self.values):
            cache[dst * bs:(dst + 1) * bs] = cache[src * bs:(src + 1) * bs]
