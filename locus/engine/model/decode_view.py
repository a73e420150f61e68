"""How the model sees one step of the decode graphs (locus/engine/runner/decode_graph.py): a padded batch of
one new token per sequence, and the paged KV pool through tensors only.

Everything here is a tensor the graph is traced or captured over, so nothing may depend on Python
values that change between steps. Padding rows (the bucket is larger than the batch) sit at
position -1, write their keys and values into the pool's scratch block, and have context length 0.

Attention reads the pool one of two ways:
- paged (CUDA): `locus::paged_decode_attention` (kernels/paged_attention.py) reads each sequence's
  visible positions only, so the block tables can have the fixed width a captured graph needs (the
  most blocks a sequence can hold) without the step paying for it;
- gathered (CPU): every position the tables cover is gathered and a mask hides those a query does not
  see; the tables are only as wide as the step's widest (a dynamic dimension of the compiled graph).

Shape legend: B bucket (padded batch), W block-table width, bs block size.
"""

from __future__ import annotations

import torch

from locus.engine.model.kv_cache import PagedKVCache


class DecodeBatch:
    """A padded decode batch as attention sees it: one new token per sequence."""

    padded = True  # rows at position -1 are padding (expert parallelism does not exchange them)

    def __init__(self, input_ids: torch.Tensor, positions: torch.Tensor):
        self.input_ids, self.positions = input_ids, positions  # [B], [B]
        self.memo: dict = {}

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    def query_rows(self) -> torch.Tensor:
        return torch.arange(self.input_ids.shape[0], device=self.device)[:, None]  # [B, 1]

    def query_positions(self) -> torch.Tensor:
        return self.positions[:, None]  # [B, 1]

    def unpad(self, padded: torch.Tensor) -> torch.Tensor:
        return padded[:, 0]  # [B, 1, ...] -> [B, ...]


class PagedDecodeView:
    """The KVCache interface over a paged pool for a DecodeBatch."""

    def __init__(self, pool: PagedKVCache, write_rows: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, paged_attention=None, splits: int = 1):
        self.pool, self.write_rows = pool, write_rows  # [B] int64 pool rows
        self.block_tables, self.context_lens = block_tables, context_lens  # [B, W], [B] (position + 1; 0 = padding)
        # `locus::paged_decode_attention` (handed in, so that tracing never imports Triton), or None: gather
        self.paged_attention, self.splits = paged_attention, splits

    def write(self, layer: int, batch: DecodeBatch, k: torch.Tensor, v: torch.Tensor) -> None:
        self.pool.keys[layer].index_copy_(0, self.write_rows, k)
        self.pool.values[layer].index_copy_(0, self.write_rows, v)

    def attend(self, layer: int, batch: DecodeBatch, q: torch.Tensor, chunk_size: int | None,
               scale: float) -> torch.Tensor | None:
        """[B, Hq, D] from the paged kernel, or None: gather with `read` and attend in the model."""
        if self.paged_attention is None:
            return None
        return self.paged_attention(q, self.pool.keys[layer], self.pool.values[layer], self.block_tables,
                                         self.context_lens, self.pool.block_size, chunk_size or 0, scale, self.splits)

    def read(self, layer: int, batch: DecodeBatch, chunk_size: int | None):
        """Every position the tables cover; attention's mask hides those past each query (and, with
        chunked attention, those before its chunk)."""
        if "read_rows" not in batch.memo:
            bs = self.pool.block_size
            offsets = torch.arange(bs, device=batch.device)
            rows = (self.block_tables[:, :, None] * bs + offsets).flatten(1)  # [B, W * bs]
            k_pos = torch.arange(rows.shape[1], device=batch.device).expand_as(rows)
            batch.memo["read_rows"] = (rows, k_pos)
        rows, k_pos = batch.memo["read_rows"]
        return self.pool.keys[layer][rows], self.pool.values[layer][rows], k_pos
