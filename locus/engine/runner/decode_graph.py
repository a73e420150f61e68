"""Decode graphs: the whole decode forward over static input buffers, one graph per batch-size bucket.

Why: a decode step of a small batch is hundreds of small kernels (docs/engine.md); launched one by one
from Python, the step costs the host's time, not the device's. vLLM, SGLang and nano-vllm capture
the decode forward once per batch-size bucket and replay it; so does this runner.

One runner, three ways to run a bucket's graph, all over the same static buffers (decode_inputs.py),
so the buffer logic that CUDA graphs depend on is tested on CPU too:
- captured (CUDA, the default there): the forward is recorded once per bucket into a
  torch.cuda.CUDAGraph (largest bucket first; all graphs share one memory pool) and each step
  copies its inputs into the buffers and replays it;
- compiled (`--compile`): torch.compile'd (inductor) per bucket; on CUDA the compiled forward is what
  gets captured, on CPU it is called (inductor's C++ wrapper);
- plain: the same forward, called eagerly (the CPU tests of the buffer logic; bench/gpu_parity.py's
  CPU self-check).
(Under expert parallelism on CUDA the compiled forward runs uncaptured, and without `--compile`
there are no decode graphs.)

What the forward holds: embedding, every layer (norms, RoPE, q/k/v/o, the in-place KV write, decode
attention, router, shared expert, routed experts as `locus::fused_moe`, dense MLPs), the final norm,
the lm_head and each row's argmax (the greedy token). Its outputs stay on the device.

Static shapes:
- the batch is padded to its bucket: padding rows read token 0 at position -1, write their keys and
  values into the pool's scratch block (kv_cache.PagedKVCache.scratch_block) and have context
  length 0; their logits and routing are dropped;
- block tables: CUDA reads them at their full width (the most blocks a sequence can hold) with the
  paged decode-attention kernel, which reads only each sequence's context, so no step pays for the
  width; CPU gathers the step's widest table (scratch-padded) and that width is the compiled graph's
  one dynamic dimension (so a growing context does not recompile);
- the routed experts are one opaque custom op (rows per expert are data-dependent; the Triton path
  sizes its grid by the most blocks any routing can need, so it never asks the host). Under expert
  parallelism the exchange is the opaque op `locus::ep_routed_experts` and graphs are not captured
  (docs/engine.md says why).
Prefill (whole or chunked), mixed steps and batches larger than the largest bucket run eagerly.

Shape legend: B bucket (padded batch), n real sequences, W block-table width, L MoE layers (model
order), K experts per token, V vocabulary.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from locus.engine.runner.decode_inputs import DecodeArgs, DecodeInputs
from locus.engine.model.decode_view import DecodeBatch, PagedDecodeView
from locus.engine.model.kv_cache import PagedKVCache
from locus.engine.model.model import Llama4ForCausalLM
from locus.kernels import argmax_cpu

log = logging.getLogger(__name__)


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


@dataclass
class DecodeOutput:
    logits: torch.Tensor  # [n, V] in the model's dtype (the sampler converts what it reads)
    argmax: torch.Tensor  # [n] int64, each row's argmax of logits (the greedy token), computed in the graph
    expert_ids: torch.Tensor  # [n, L, K] int64
    expert_weights: torch.Tensor  # [n, L, K] float32


class DecodeGraphs:
    """The decode forward per batch-size bucket over the engine's paged KV pool (see module docstring).

    capture: record CUDA graphs (CUDA only); compile: torch.compile the forward; paged: read the KV
    pool with the paged decode-attention kernel (default: on CUDA; Triton's interpreter on CPU, for
    tests); max_blocks: the most blocks a sequence can hold (the tables' width)."""

    def __init__(self, model: Llama4ForCausalLM, pool: PagedKVCache, buckets: list[int], max_blocks: int,
                 compile: bool = True, capture: bool = False, paged: bool | None = None):
        if not buckets:
            raise ValueError("the decode graphs need at least one bucket")
        device = model.device
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA model, not {device.type}")
        self.model, self.pool, self.buckets = model, pool, sorted(set(buckets))
        self.moe_layers = list(model.config.moe_layers)
        self.capture, self.compiled = capture, compile
        self.paged = device.type == "cuda" if paged is None else paged
        self._attention = None
        if self.paged:
            from locus.kernels import paged_attention

            self._attention = paged_attention.paged_decode_attention_op
            self._splits = {B: paged_attention.choose_splits(B, model.config.num_key_value_heads, device)
                            for B in self.buckets}
        self.inputs = DecodeInputs(self.max_batch, max_blocks, pool.block_size, pool.scratch_block, device)
        self._fn = self._forward
        if compile:
            # Every bucket (of every DecodeGraphs in the process) is a recompile of the same code object,
            # and dynamo's default limit is 8. Past the limit dynamo would silently run eagerly: fail instead.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64, 2 * len(self.buckets))
            torch._dynamo.config.fail_on_recompile_limit_hit = True
            # CPU: a C++ wrapper calls the kernels (less host time a step than inductor's Python one,
            # docs/engine.md); not frozen (docs/engine.md). CUDA: the default mode, and this
            # runner captures the compiled forward itself (inductor's own CUDA graphs, "reduce-overhead",
            # refuse a forward that writes the KV pool, an input it mutates).
            options = {} if device.type == "cuda" else {"options": {"cpp_wrapper": True}}
            self._fn = torch.compile(self._forward, fullgraph=True, dynamic=False, **options)
        self._c_argmax = device.type == "cpu" and argmax_cpu.load_library() is not None
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, tuple[torch.Tensor, ...]] = {}  # what each captured graph writes
        self.skipped: dict[int, str] = {}  # bucket -> why its graph could not be captured (it runs uncaptured)
        self.compile_seconds: dict[int, float] = {}  # per bucket: compile and/or capture at start-up
        self.steps = 0  # decode steps run (warm-up excluded)

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    @property
    def captured(self) -> list[int]:
        return sorted(self._graphs)

    def bucket(self, n: int) -> int | None:
        """The smallest bucket holding n sequences (None: more than the largest)."""
        return next((b for b in self.buckets if b >= n), None)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, write_rows: torch.Tensor,
                 context_lens: torch.Tensor, block_tables: torch.Tensor) -> tuple[torch.Tensor, ...]:
        B = input_ids.shape[0]
        batch = DecodeBatch(input_ids, positions)
        view = PagedDecodeView(self.pool, write_rows.long(), block_tables, context_lens, self._attention,
                               self._splits[B] if self.paged else 1)
        out = self.model(batch, view, record_routing=bool(self.moe_layers))
        # W @ h^T rather than h @ W^T: with a few rows against a [V, H] weight this form streams the
        # weight once at full width on CPU (bench/profile_decode.py times both).
        logits_vb = self.model.lm_head.weight @ out.hidden.T  # [V, B]
        logits = logits_vb.T
        # The greedy token in the graph: on CPU a C sweep over the [V, B] logits (argmax_cpu.c, a third
        # of inductor's reduction's time: docs/engine.md); elsewhere a reduction. The logits
        # leave the graph as they are: a greedy batch never reads them.
        argmax = argmax_cpu.vocab_argmax(logits_vb) if self._c_argmax else logits.argmax(-1)
        if not self.moe_layers:
            empty = torch.empty(B, 0, 0, device=input_ids.device)
            return logits, argmax, empty.long(), empty
        topks = [out.routing[layer] for layer in self.moe_layers]
        return logits, argmax, torch.stack([t.ids for t in topks], 1), torch.stack([t.weights for t in topks], 1)

    def run(self, token_ids: list[int], positions: list[int], block_tables: list[list[int]],
            sources: list[int] | None = None, fed: torch.Tensor | None = None) -> DecodeOutput:
        """Decode one token for each of n sequences: token_ids[i] at positions[i], KV in block_tables[i].
        sources / fed: sequence i's token is fed[sources[i]] (still on the device) where sources[i] >= 0."""
        n = len(token_ids)
        B = self.bucket(n)
        if B is None:
            raise ValueError(f"{n} sequences exceed the largest decode bucket ({self.max_batch})")
        # One step at a time: the buffers are shared (--ep-overlap's two lanes at once refuse decode
        # graphs, ep/ranks/worker.py).
        self.inputs.stage(token_ids, positions, block_tables, B, sources)
        out = self._launch(self.inputs, B, fed, n)
        self.steps += 1
        logits, argmax, expert_ids, expert_weights = out
        return DecodeOutput(logits[:n], argmax[:n], expert_ids[:n], expert_weights[:n])

    @torch.inference_mode()
    def _launch(self, inputs: DecodeInputs, B: int, fed: torch.Tensor | None = None, n: int = 0) -> tuple[torch.Tensor, ...]:
        inputs.commit(B)
        if fed is not None:
            inputs.feed(n, fed)
        graph = self._graphs.get(B)
        if graph is not None:
            graph.replay()
            return self._outputs[B]
        return self._call(self._args(inputs, B))

    def _args(self, inputs: DecodeInputs, B: int) -> DecodeArgs:
        if self.paged:
            return inputs.args(B)  # whole width: the kernel reads only each context
        args = inputs.args(B, inputs.width)
        if self.compiled:
            torch._dynamo.mark_dynamic(args.block_tables, 1)
        return args

    def _call(self, args: DecodeArgs) -> tuple[torch.Tensor, ...]:
        return self._fn(*args.as_tuple())

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Compile and/or capture every bucket now (padding rows only), largest first: captured graphs
        share one memory pool, and the largest sizes it. Inductor's on-disk cache makes the next
        start of the same model fast. A bucket whose capture fails is logged and runs uncaptured."""
        pool = None
        for B in reversed(self.buckets):
            start = time.perf_counter()
            self.inputs.stage_padding(B)
            self._launch(self.inputs, B)  # compiles (and runs the Triton kernels' first launch) before capture
            if self.capture:
                pool = self._capture(B, pool)
            self.compile_seconds[B] = time.perf_counter() - start
        what = " and ".join(w for w, on in (("compiled", self.compiled), ("captured", self.capture)) if on) or "prepared"
        log.info("%s decode buckets %s in %.1f s (%s)", what, self.buckets, sum(self.compile_seconds.values()),
                 ", ".join(f"{b}: {s:.1f} s" for b, s in sorted(self.compile_seconds.items())))
        if self.skipped:
            log.error("decode buckets run uncaptured: %s", "; ".join(f"{b}: {why}" for b, why in self.skipped.items()))

    def _capture(self, B: int, pool):
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        args = self._args(self.inputs, B)
        try:
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                outputs = self._call(args)
        except Exception as exc:  # noqa: BLE001 - a bucket that cannot be captured still runs, uncaptured
            self.skipped[B] = f"{type(exc).__name__}: {exc}"
            log.exception("decode bucket %d: capture failed; it runs uncaptured", B)
            return pool
        self._graphs[B], self._outputs[B] = graph, outputs
        torch.cuda.synchronize()
        return graph.pool() if pool is None else pool
