"""Inputs and timing shared by the fused-MoE benchmark (moe_kernels.py) and tuner (tune_moe.py).

Decode-sized calls last tens of microseconds, less than the host needs to launch their kernels
from Python, so timing them call after call measures the host. Here a list of calls is captured
once into a CUDA graph and the graph is replayed (what the CUDA-graph decode step does); the time
per call is the median replay over the number of calls. Each call in the list has its own routing
(and, where one weight set would fit in L2, its own copy of the weights), so consecutive calls do
not find the previous call's weights in L2. Calls that cannot be captured are timed eagerly with
CUDA events. On CPU (the Triton interpreter) the wall clock stands in.

Importing this module imports torch (and locus's Triton-free formats) only, never Triton (the bench
scripts set TRITON_INTERPRET on CPU before anything imports Triton).
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from locus.kernels.formats import QuantizedTensor
from locus.kernels.moe_quantized import EXPERT_FORMATS, quantize_experts

# Expert shapes: E experts, H hidden, I expert width, K experts per token.
SHAPES = {
    "llama4-scout": {"E": 16, "H": 5120, "I": 8192, "K": 1},
    "llama4-maverick": {"E": 128, "H": 5120, "I": 8192, "K": 1},
    "tiny": {"E": 8, "H": 64, "I": 64, "K": 2},  # the `tiny` preset's experts
    "small": {"E": 16, "H": 256, "I": 512, "K": 1},  # the `small` preset's experts
    "mini": {"E": 8, "H": 256, "I": 256, "K": 1},  # the trained `mini`'s experts
    "scout-slice": {"E": 4, "H": 1024, "I": 2048, "K": 1},  # a few experts of Scout's width / 5
}
SMALL_SHAPES = ("tiny", "small")
CPU_SHAPES = ("tiny", "small", "mini", "scout-slice")  # what the CPU runs (the interpreter: tiny, small)
DECODE_TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
PREFILL_TOKENS = (2048, 4096, 8192, 16384)


def triton_version() -> str | None:
    """Triton's version for a result's provenance (importing it here is fine: callers set up the
    interpreter before they call this)."""
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


@dataclass
class ExpertWeights:
    """One or more copies of a layer's expert weights: gate_up [E, H, 2I], down [E, I, H], float
    tensors or (a narrow `format`) QuantizedTensors."""

    gate_up: list[torch.Tensor | QuantizedTensor]
    down: list[torch.Tensor | QuantizedTensor]
    format: str | None = None  # fp8, mxfp8, mxfp4; None: float weights

    @property
    def copies(self) -> int:
        return len(self.gate_up)

    @property
    def expert_bytes(self) -> float:
        """Bytes one expert's gate_up and down take (elements and scales): what a call reads per
        expert it touches."""
        return sum(_nbytes(w) for w in (self.gate_up[0], self.down[0])) / self.gate_up[0].shape[0]


def _nbytes(w: torch.Tensor | QuantizedTensor) -> int:
    return w.nbytes if isinstance(w, QuantizedTensor) else w.numel() * w.element_size()


def weight_bytes(shape: dict, dtype: torch.dtype, fmt: str | None = None) -> int:
    """Bytes of all E experts' gate_up and down weights (narrow formats: elements and scales)."""
    E, H, I = shape["E"], shape["H"], shape["I"]
    if fmt is None:
        return 3 * E * H * I * torch.finfo(dtype).bits // 8
    from locus.kernels.formats import FORMATS

    return E * (2 * I * FORMATS[fmt].nbytes(H) + H * FORMATS[fmt].nbytes(I))


def quantize_layer(expert: Callable[[int], tuple[torch.Tensor, torch.Tensor]], E: int,
                   fmt: str) -> tuple[QuantizedTensor, QuantizedTensor]:
    """A layer's gate_up and down in `fmt`, quantized one expert at a time (expert(e) gives expert e's
    float [1, H, 2I] and [1, I, H]) into storage allocated once: a float32 copy of a whole Llama-4
    layer, what quantizing it at once takes, would not fit beside it on one GPU."""
    if fmt not in EXPERT_FORMATS:
        raise ValueError(f"unknown expert weight format {fmt!r}; choose one of {', '.join(EXPERT_FORMATS)}")
    out = None
    for e in range(E):
        pair = quantize_experts(*expert(e), fmt)
        if out is None:
            out = [QuantizedTensor(q.data.new_empty((E, *q.data.shape[1:])), q.scale.new_empty((E, *q.scale.shape[1:])),
                                   fmt, (E, *q.shape[1:]), 1) for q in pair]
        for whole, part in zip(out, pair):
            whole.data[e].copy_(part.data[0])
            whole.scale[e].copy_(part.scale[0])
    return out[0], out[1]


def l2_bytes(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or 50 << 20)


def make_weights(shape: dict, dtype: torch.dtype, device: torch.device, seed: int = 0,
                 copies: int | None = None, fmt: str | None = None) -> ExpertWeights:
    """Random expert weights, scaled so activations stay O(1), in `dtype` or quantized to `fmt` (drawn
    in `dtype` an expert at a time); by default as many copies as it takes for two L2s' worth of bytes (1 for
    the Llama-4 shapes), at most 16."""
    if copies is None:
        copies = max(1, min(16, math.ceil(2 * l2_bytes(device) / weight_bytes(shape, dtype, fmt))))
    E, H, I = shape["E"], shape["H"], shape["I"]
    gen = torch.Generator(device=device).manual_seed(seed)
    gate_up, down = [], []
    def random(experts: int) -> tuple[torch.Tensor, torch.Tensor]:
        # normal_ in place: a scaled copy of a 20 GB tensor would need twice the memory.
        return (torch.empty(experts, H, 2 * I, dtype=dtype, device=device).normal_(0.0, H ** -0.5, generator=gen),
                torch.empty(experts, I, H, dtype=dtype, device=device).normal_(0.0, I ** -0.5, generator=gen))

    for _ in range(copies):
        gu, dn = random(E) if fmt is None else quantize_layer(lambda e: random(1), E, fmt)
        gate_up.append(gu)
        down.append(dn)
    return ExpertWeights(gate_up, down, fmt)


@dataclass
class Batch:
    """One call's inputs: x [T, H], uniform random top-K ids and weights in (0.1, 1) [T, K]."""

    x: torch.Tensor
    ids: torch.Tensor
    weights: torch.Tensor

    def experts_touched(self) -> int:
        return int(torch.unique(self.ids).numel())


def make_batches(shape: dict, T: int, dtype: torch.dtype, device: torch.device, count: int, seed: int = 0) -> list[Batch]:
    E, H, K = shape["E"], shape["H"], shape["K"]
    gen = torch.Generator(device=device).manual_seed(seed)
    out = []
    for _ in range(count):
        x = torch.randn(T, H, generator=gen, device=device, dtype=dtype)
        ids = torch.rand(T, E, generator=gen, device=device).topk(K, dim=1).indices
        weights = torch.rand(T, K, generator=gen, device=device) * 0.9 + 0.1
        out.append(Batch(x, ids, weights))
    return out


def rotation(weights: ExpertWeights, batches: list[Batch]) -> list[tuple[torch.Tensor, torch.Tensor, Batch]]:
    """(gate_up, down, batch) per call: every batch, every weight copy, cycled together."""
    n = max(weights.copies, len(batches))
    return [(weights.gate_up[i % weights.copies], weights.down[i % weights.copies], batches[i % len(batches)])
            for i in range(n)]


@dataclass
class Timing:
    seconds: float  # per call, median over repeats
    graph: bool  # replayed from a CUDA graph (False: launched eagerly)


def time_calls(calls: list[Callable[[], object]], device: torch.device, repeat: int, graph: bool = True) -> Timing:
    """Seconds per call of the calls run in turn: CUDA-graph replays where graph=True and capture
    works, else eager launches timed with CUDA events; wall clock on CPU. Each call runs once
    untimed first (that compiles its kernels)."""
    for call in calls:
        call()
    if device.type != "cuda":
        times = []
        for _ in range(max(1, repeat)):
            start = time.perf_counter()
            for call in calls:
                call()
            times.append(time.perf_counter() - start)
        return Timing(statistics.median(times) / len(calls), False)
    torch.cuda.synchronize(device)
    cuda_graph = _capture(calls) if graph else None
    captured = cuda_graph is not None
    run = cuda_graph.replay if captured else (lambda: [call() for call in calls])
    run()  # warm: the first replay uploads the graph
    times = []
    for _ in range(max(1, repeat)):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del run, cuda_graph
    return Timing(statistics.median(times) / len(calls), captured)


def _capture(calls: list[Callable[[], object]]) -> torch.cuda.CUDAGraph | None:
    """The calls captured into one graph, or None where capture fails (then they are timed eagerly)."""
    cuda_graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(cuda_graph):
            for call in calls:
                call()
    except RuntimeError as exc:
        print(f"  (CUDA graph capture failed, timing eagerly: {str(exc).splitlines()[0]})", flush=True)
        torch.cuda.synchronize()
        return None
    return cuda_graph
