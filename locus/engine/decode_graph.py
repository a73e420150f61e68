"""Compiled decode steps: the decode forward padded to a few batch-size buckets, each compiled once.

Why: a decode step of a small batch is hundreds of small ops (docs/engine.md measured ~115 tensor
allocations per step, most of the step's time above its floor). Eager PyTorch pays Python and
dispatch for each. Inductor fuses the pointwise work between the matmuls (on CPU its wrapper is C++,
not Python); on CUDA `mode="reduce-overhead"` also captures each bucket as a CUDA graph.
vLLM does the same with its decode batch-size buckets.

Static shapes, so that one graph serves every decode step of its bucket:
- the batch is padded to the bucket: padding rows read token 0 at position -1 (attention gives such a
  query one key, so its softmax stays finite; under expert parallelism they are not exchanged), write
  their keys and values into the pool's scratch block (kv_cache.PagedKVCache.scratch_block), and
  their logits and routing are dropped;
- the block tables are padded with the scratch block to the widest table of the step; that width is
  the one dynamic dimension (marked dynamic), so a growing context does not recompile;
- the routed experts stay one opaque custom op (`locus::fused_moe`, kernels/moe_op.py): how many rows
  each expert gets is data-dependent. Under expert parallelism the exchange is an opaque op too
  (expert_parallel.py), so the graph never holds a collective.
Prefill (whole or chunked), mixed prefill/decode batches and batches larger than the largest bucket
run eagerly.

Shape legend: B bucket (padded batch), n real sequences, W block-table width, bs block size,
L MoE layers (model order), K experts per token, V vocabulary.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from locus.engine.model.kv_cache import PagedKVCache
from locus.engine.model.model import Llama4ForCausalLM
from locus.kernels import argmax_cpu

log = logging.getLogger(__name__)

MIN_TABLE_WIDTH = 2  # dynamo specialises a dynamic dimension of size 0 or 1; never pass one


def default_buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, ... up to max_num_seqs (which is always a bucket)."""
    buckets, b = [], 1
    while b < max_num_seqs:
        buckets.append(b)
        b *= 2
    return buckets + [max_num_seqs]


def parse_buckets(text: str) -> list[int]:
    """'1,2,4,8' -> [1, 2, 4, 8] (sorted, unique, positive)."""
    try:
        values = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        raise ValueError(f"--compile-buckets must be comma-separated integers, got {text!r}") from None
    if not values or values[0] < 1:
        raise ValueError(f"--compile-buckets needs positive batch sizes, got {text!r}")
    return values


class DecodeBatch:
    """A padded decode batch as attention sees it: one new token per sequence, tensors only (the graph
    is traced over it, so nothing here may depend on Python values that change between steps)."""

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
    """The KVCache interface over a paged pool for a DecodeBatch: rows come from tensors, not spans."""

    def __init__(self, pool: PagedKVCache, write_rows: torch.Tensor, block_tables: torch.Tensor):
        self.pool, self.write_rows, self.block_tables = pool, write_rows, block_tables  # [B], [B, W]

    def write(self, layer: int, batch: DecodeBatch, k: torch.Tensor, v: torch.Tensor) -> None:
        self.pool.keys[layer].index_copy_(0, self.write_rows, k)
        self.pool.values[layer].index_copy_(0, self.write_rows, v)

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


@dataclass
class DecodeOutput:
    logits: torch.Tensor  # [n, V] in the model's dtype (the sampler converts what it reads)
    argmax: torch.Tensor  # [n] int64, each row's argmax of logits (the greedy token), computed in the graph
    expert_ids: torch.Tensor  # [n, L, K] int64
    expert_weights: torch.Tensor  # [n, L, K] float32


class DecodeGraphs:
    """One compiled decode forward per batch-size bucket, over the engine's paged KV pool."""

    def __init__(self, model: Llama4ForCausalLM, pool: PagedKVCache, buckets: list[int]):
        if not buckets:
            raise ValueError("the compiled decode path needs at least one bucket")
        self.model, self.pool, self.buckets = model, pool, sorted(buckets)
        self.moe_layers = list(model.config.moe_layers)
        # Every bucket (of every DecodeGraphs in the process) is a recompile of the same code object,
        # and dynamo's default limit is 8. Past the limit dynamo would silently run eagerly: fail instead.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64, 2 * len(self.buckets))
        torch._dynamo.config.fail_on_recompile_limit_hit = True
        on_cuda = model.device.type == "cuda"
        # CPU: a C++ wrapper calls the kernels (0.13-0.23 ms a step less than inductor's Python one,
        # `small`, 32 sequences). Not freezing: in torch 2.13 `options={"freezing": True}` is silently
        # not applied (only the global config is read), and applied for real it measured no faster
        # while it would pack a copy of every dense weight per bucket (docs/engine.md).
        # CUDA: reduce-overhead captures each bucket's graph as a CUDA graph.
        self._compiled = torch.compile(self._forward, fullgraph=True, dynamic=False,
                                       **({"mode": "reduce-overhead"} if on_cuda else {"options": {"cpp_wrapper": True}}))
        self._c_argmax = not on_cuda and argmax_cpu.load_library() is not None
        self.compile_seconds: dict[int, float] = {}
        self.steps = 0  # decode steps run compiled (warm-up excluded)

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def bucket(self, n: int) -> int | None:
        """The smallest bucket holding n sequences (None: more than the largest)."""
        return next((b for b in self.buckets if b >= n), None)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, write_rows: torch.Tensor,
                 block_tables: torch.Tensor) -> tuple[torch.Tensor, ...]:
        batch = DecodeBatch(input_ids, positions)
        out = self.model(batch, PagedDecodeView(self.pool, write_rows, block_tables), record_routing=bool(self.moe_layers))
        # W @ h^T rather than h @ W^T: with a few rows against a [V, H] weight this form streams the
        # weight once at full width (bench/profile_decode.py times both; bfloat16 gains most).
        logits_vb = self.model.lm_head.weight @ out.hidden.T  # [V, B]
        logits = logits_vb.T
        # The greedy token in the graph, over the [V, B] logits: on CPU a C sweep (argmax_cpu.c, 0.1 ms
        # at V = 32000, B = 32, where inductor's reduction takes 0.3 ms and aten's 0.5-1.7 ms); on CUDA
        # inductor's reduction. The logits leave the graph as they are (a view, no float32 copy): a
        # greedy batch never reads them.
        argmax = argmax_cpu.vocab_argmax(logits_vb) if self._c_argmax else logits.argmax(-1)
        if not self.moe_layers:
            empty = torch.empty(input_ids.shape[0], 0, 0, device=input_ids.device)
            return logits, argmax, empty.long(), empty
        topks = [out.routing[layer] for layer in self.moe_layers]
        return logits, argmax, torch.stack([t.ids for t in topks], 1), torch.stack([t.weights for t in topks], 1)

    def run(self, token_ids: list[int], positions: list[int], block_tables: list[list[int]]) -> DecodeOutput:
        """Decode one token for each of n sequences: token_ids[i] at positions[i], KV in block_tables[i]."""
        out = self._launch(token_ids, positions, block_tables)
        self.steps += 1
        return out

    @torch.inference_mode()
    def _launch(self, token_ids: list[int], positions: list[int], block_tables: list[list[int]]) -> DecodeOutput:
        """Pad the batch to its bucket and run that bucket's graph (compiling it on first use)."""
        n = len(token_ids)
        B = self.bucket(n)
        if B is None:
            raise ValueError(f"{n} sequences exceed the largest compiled bucket ({self.max_batch})")
        bs, scratch, dev = self.pool.block_size, self.pool.scratch_block, self.model.device
        width = max(MIN_TABLE_WIDTH, max(len(t) for t in block_tables))
        tables = [t + [scratch] * (width - len(t)) for t in block_tables] + [[scratch] * width] * (B - n)
        rows = [t[p // bs] * bs + p % bs if p >= 0 else scratch * bs for t, p in zip(block_tables, positions)]
        rows += [scratch * bs] * (B - n)
        ids = torch.tensor(token_ids + [0] * (B - n), dtype=torch.long, device=dev)
        pos = torch.tensor(positions + [-1] * (B - n), dtype=torch.long, device=dev)
        table_tensor = torch.tensor(tables, dtype=torch.long, device=dev)
        torch._dynamo.mark_dynamic(table_tensor, 1)
        logits, argmax, expert_ids, expert_weights = self._compiled(
            ids, pos, torch.tensor(rows, dtype=torch.long, device=dev), table_tensor)
        return DecodeOutput(logits[:n], argmax[:n], expert_ids[:n], expert_weights[:n])

    def warm_up(self) -> None:
        """Compile every bucket now (a dummy step each, padding rows only); inductor's on-disk cache
        makes the next start of the same model fast."""
        scratch = self.pool.scratch_block
        for B in self.buckets:
            start = time.perf_counter()
            self._launch([0] * B, [-1] * B, [[scratch]] * B)  # padding rows only
            self.compile_seconds[B] = time.perf_counter() - start
        log.info("compiled decode buckets %s in %.1f s (%s)", self.buckets, sum(self.compile_seconds.values()),
                 ", ".join(f"{b}: {s:.1f} s" for b, s in self.compile_seconds.items()))
