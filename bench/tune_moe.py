"""Tune the fused-MoE meta-parameters on this GPU and write the config tables the kernels look up.

    python bench/tune_moe.py                                   # Llama-4 Scout + Maverick + the presets, ~4 min
    python bench/tune_moe.py --shapes llama4-scout --budget-seconds 120
    python bench/tune_moe.py --E 64 --H 2048 --I 1408 --top-k 8 --tokens 1,16,256,4096
    python bench/tune_moe.py --small --out-dir /tmp/configs   # a tiny search on CPU (interpreter)
    python bench/tune_moe.py --format fp8 --shapes llama4-scout,llama4-maverick   # experts held in fp8

A pruned search, not the full grid (4 x 4 x 4 x 8 x 5 x 2 x 4 = 20,480 configs per point, each a
compile of seconds). For each expert shape and token count T (a "point"):
1. seeds: a few configs known to suit the point's regime (sparse decode: split-K over a 16-row tile;
   decode: 16-row tiles, wide weight tiles; prefill: 64/128-row tiles, 8 warps) plus the best
   configs already found for the neighbouring T and for the same T of shapes tuned before;
2. coordinate descent: from the best so far, every config one step away in one meta-parameter
   (split_k, block_n, block_k, block_m, num_stages, num_warps, group_m), kept if it is at least
   1% faster, until no step helps or the point's share of the budget is spent.
Candidates that cannot fit (shared memory, registers, more rows than an expert gets, a split with
too few steps) are pruned before they compile; those that still fail (OutOfResources, a compile
error) are skipped. Each round's candidates compile concurrently (threads, on a one-expert copy of
the shape, which specialises the kernels exactly like the real call) before they are timed.

Timing: decode points replay a CUDA graph of several calls, each with its own routing (and its own
weight copy where one would fit in L2; moe_timing.py), median of --repeat replays; prefill points
launch eagerly (milliseconds per call). The whole run keeps to --budget-seconds (default 240):
each point gets a share of what is left (presets' points a quarter share), and a point reached with
no budget left takes its neighbour's config, marked unmeasured in the file's provenance.

Writes locus/kernels/configs/E<E>_I<I>_H<H>_<dtype>_<GPU name>.json (moe_configs.py), which
`fused_moe(..., backend="triton")` uses for batches of the nearest T. With --format fp8|mxfp8|mxfp4
the experts are held in that narrow format (quantized from --dtype weights, one expert at a time),
the calls run the dot form `choose_dot` picks for each T (as serving does; recorded per point in
the provenance), shared memory is counted at the narrow tile's bytes, and the table is the format's
(E<E>_I<I>_H<H>_<format>_<GPU name>.json).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import math
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
# First: on CPU this sets TRITON_INTERPRET, which must happen before anything imports Triton.
import moe_kernels  # noqa: E402,F401
from moe_timing import (  # noqa: E402
    DECODE_TOKENS,
    PREFILL_TOKENS,
    SHAPES,
    SMALL_SHAPES,
    Batch,
    make_batches,
    make_weights,
    rotation,
    time_calls,
    triton_version,
    weight_bytes,
)

try:
    from triton.runtime.errors import OutOfResources
except ImportError:  # older Triton: let the error through
    OutOfResources = ()

from locus.kernels.formats import FORMATS  # noqa: E402
from locus.kernels.moe_configs import (  # noqa: E402
    CONFIG_DIR,
    GPU_SMS,
    MoeConfig,
    decode_split_k,
    device_name,
    write_table,
)
from locus.kernels.moe_dot_forms import choose_dot  # noqa: E402
from locus.kernels.moe_quantized import EXPERT_FORMATS  # noqa: E402
from locus.kernels.moe_triton import fused_moe_triton  # noqa: E402

PRESET_TOKENS = (1, 4, 16, 64, 256, 2048)
DEFAULT_SHAPES = ("llama4-scout", "llama4-maverick", "small", "tiny")
PRESET_WEIGHT = 0.25  # a preset point's share of the budget relative to a Llama-4 point
MIN_GAIN = 0.01  # a step must be this much faster to be taken (replay medians vary by less)

VALUES = {  # the values each meta-parameter may take, in order (a step moves to a neighbour)
    "split_k": (1, 2, 3, 4, 6, 8, 12, 16),  # 3, 6, 12: program counts that fill whole waves of 132 SMs
    "block_n": (32, 64, 128, 256),
    "block_k": (32, 64, 128, 256),
    "block_m": (16, 32, 64, 128),
    "num_stages": (2, 3, 4, 5),
    "num_warps": (4, 8),
    "group_m": (1, 4, 8, 16, 32),
}
SMALL_VALUES = {  # --small: a CPU smoke run of the same search
    "split_k": (1, 2), "block_n": (32, 64), "block_k": (32, 64), "block_m": (16,),
    "num_stages": (3,), "num_warps": (4,), "group_m": (1, 8),
}


@dataclass(frozen=True)
class Point:
    """One shape at one token count."""

    name: str
    shape: dict
    T: int

    @property
    def rows_per_expert(self) -> float:
        return self.T * self.shape["K"] / self.shape["E"]

    @property
    def experts_touched(self) -> float:
        """Expected distinct experts under uniform top-K routing."""
        E, K = self.shape["E"], self.shape["K"]
        return E * (1 - (1 - K / E) ** self.T)

    @property
    def regime(self) -> str:
        if self.rows_per_expert > 16:
            return "prefill"
        return "sparse" if self.narrow_tiles(64) < 2 * SMS else "decode"

    def narrow_tiles(self, block_n: int) -> float:
        """Programs of the GEMM with fewer output tiles, without split-K."""
        return max(1.0, self.experts_touched) * math.ceil(min(self.shape["H"], self.shape["I"]) / block_n)


# The GPU's streaming multiprocessors (the untuned default's 132 without one).
SMS = torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else GPU_SMS


class Space:
    """Which configs a point may try, its seeds, and one-step neighbours."""

    def __init__(self, dtype: torch.dtype, smem_bytes: int, values: dict = VALUES, fmt: str | None = None):
        self.dtype, self.format = dtype, fmt
        self.itemsize = torch.finfo(dtype).bits // 8
        # bytes a weight element takes in a pipeline stage: narrow tiles are staged as stored
        self.weight_itemsize = self.itemsize if fmt is None else FORMATS[fmt].element.bits / 8
        self.smem = smem_bytes
        self.values = values

    def expert_bytes(self, shape: dict) -> float:
        """Bytes one expert's weights take, as held (narrow: elements and scales)."""
        return weight_bytes(shape, self.dtype, self.format) / shape["E"]

    def allowed(self, c: MoeConfig, p: Point) -> bool:
        H, I = p.shape["H"], p.shape["I"]
        narrow = min(H, I)
        if any(getattr(c, name) not in vals for name, vals in self.values.items()):
            return False
        stage = c.block_m * c.block_k * self.itemsize + 2 * c.block_k * c.block_n * self.weight_itemsize
        if c.num_stages * stage > self.smem:
            return False  # gate_up: the A tile and the gate and up tiles per stage
        if c.block_m * c.block_n > 2048 * c.num_warps:  # two fp32 accumulators: <= 128 registers a thread
            return False
        if c.num_warps == 8 and c.block_m * c.block_n < 64 * 64:
            return False  # eight warps on a small tile only add synchronisation
        if c.block_m > max(16, _pow2_ceil(2 * p.rows_per_expert)):
            return False  # more padding rows than an expert can have real ones
        if c.block_n > _pow2_ceil(narrow) or c.block_k > _pow2_ceil(narrow):
            return False
        if c.split_k > 1:
            if p.regime == "prefill" or p.narrow_tiles(c.block_n) >= 4 * SMS:
                return False  # the grid already fills the GPU: a split only adds a reduce pass
            if narrow // (c.split_k * c.block_k) < 2:
                return False  # a slice of fewer than two BLOCK_K steps cannot pipeline
        if p.regime != "prefill" and c.group_m not in (1, 8):
            return False  # decode blocks rarely share an expert: group order hardly matters there
        return True

    def fit(self, c: MoeConfig, p: Point) -> MoeConfig | None:
        """c moved into the point's space (a seed made for large shapes, on a small one): each
        meta-parameter to a value it may take, then the rules of `allowed` fixed one by one."""
        narrow = _pow2_ceil(min(p.shape["H"], p.shape["I"]))
        caps = {"block_m": max(16, _pow2_ceil(2 * p.rows_per_expert)), "block_n": narrow, "block_k": narrow}
        c = replace(c, **{name: self._at_most(name, min(getattr(c, name), caps.get(name, getattr(c, name))))
                          for name in self.values})
        if p.regime != "prefill" and c.group_m not in (1, 8):
            c = replace(c, group_m=self._at_most("group_m", 1))
        while c.split_k > 1 and not self.allowed(c, p):
            c = replace(c, split_k=self._at_most("split_k", c.split_k // 2))
        while c.block_m * c.block_n > 2048 * c.num_warps and c.block_n > self.values["block_n"][0]:
            c = replace(c, block_n=self._at_most("block_n", c.block_n // 2))
        if c.num_warps == 8 and c.block_m * c.block_n < 64 * 64:
            c = replace(c, num_warps=self._at_most("num_warps", 4))
        while not self.allowed(c, p) and c.num_stages > self.values["num_stages"][0]:
            c = replace(c, num_stages=self._at_most("num_stages", c.num_stages - 1))
        while not self.allowed(c, p) and c.block_k > self.values["block_k"][0]:
            c = replace(c, block_k=self._at_most("block_k", c.block_k // 2))
        return c if self.allowed(c, p) else None

    def _at_most(self, name: str, value: int) -> int:
        """The largest value `name` may take that is <= value (else its smallest)."""
        vals = self.values[name]
        return max((v for v in vals if v <= value), default=vals[0])

    def seeds(self, p: Point) -> list[MoeConfig]:
        if p.regime == "sparse":
            split = decode_split_k(max(1, round(p.experts_touched)), p.shape["I"], p.shape["H"], 64, 128, SMS)
            base = [MoeConfig(16, 64, 128, 1, 4, 3, split_k=split), MoeConfig(16, 128, 128, 1, 4, 3, split_k=split),
                    MoeConfig(16, 64, 256, 1, 4, 2, split_k=max(1, split // 2)), MoeConfig(16, 64, 128, 1, 4, 4)]
        elif p.regime == "decode":
            base = [MoeConfig(16, 64, 128, 1, 4, 3), MoeConfig(16, 128, 64, 1, 4, 4), MoeConfig(32, 64, 64, 8, 4, 4),
                    MoeConfig(16, 64, 128, 1, 4, 3, split_k=2)]
        else:
            base = [MoeConfig(64, 128, 64, 8, 4, 4), MoeConfig(128, 128, 64, 8, 8, 3), MoeConfig(128, 256, 64, 8, 8, 3),
                    MoeConfig(64, 256, 64, 16, 8, 4), MoeConfig(64, 128, 128, 8, 8, 3)]
        out = []
        for c in base:
            fitted = self.fit(c, p)
            if fitted is not None and fitted not in out:
                out.append(fitted)
        return out

    def neighbours(self, c: MoeConfig, p: Point) -> list[MoeConfig]:
        out = []
        for name, vals in self.values.items():
            value = getattr(c, name)
            i = vals.index(value) if value in vals else 0
            for j in (i - 1, i + 1):
                if 0 <= j < len(vals):
                    candidate = replace(c, **{name: vals[j]})
                    if self.allowed(candidate, p):
                        out.append(candidate)
        return out


def _pow2_ceil(x: float) -> int:
    return 1 << max(0, math.ceil(math.log2(max(x, 1))))


@dataclass
class PointResult:
    config: MoeConfig
    seconds: float | None  # None: not measured (budget spent), config taken from a neighbour
    tried: int = 0
    failed: int = 0
    graph: bool = False
    gbps: float | None = None


class Bench:
    """Times configs for one shape on this device (weights allocated once per shape)."""

    def __init__(self, name: str, shape: dict, dtype: torch.dtype, device: torch.device, repeat: int,
                 compile_workers: int, fmt: str | None = None):
        self.name, self.shape, self.dtype, self.device, self.repeat = name, shape, dtype, device, repeat
        self.compile_workers = compile_workers if device.type == "cuda" else 0
        self.weights = make_weights(shape, dtype, device, fmt=fmt)
        # A one-expert copy of the shape: same H, I, K and strides, so the same compiled kernels.
        one = {**shape, "E": 1}
        self.mini_weights = make_weights(one, dtype, device, copies=1, fmt=fmt)
        K = shape["K"]  # every slot of the one token on the one expert
        self.mini_batch = Batch(torch.randn(1, shape["H"], dtype=dtype, device=device),
                                torch.zeros(1, K, dtype=torch.int64, device=device), torch.ones(1, K, device=device))
        self.failed: set[MoeConfig] = set()

    def precompile(self, configs: list[MoeConfig]) -> None:
        """Compile the configs' kernels concurrently (a tiny call each); remember which fail."""
        if not configs or self.compile_workers <= 0:
            return
        gate_up, down, b = self.mini_weights.gate_up[0], self.mini_weights.down[0], self.mini_batch

        def compile_one(config: MoeConfig):
            try:
                fused_moe_triton(b.x, gate_up, down, b.ids, b.weights, True, None, config)
            except Exception as exc:  # noqa: BLE001 - any failure just drops the candidate
                return exc
            return None

        with concurrent.futures.ThreadPoolExecutor(min(self.compile_workers, len(configs))) as pool:
            errors = list(pool.map(compile_one, configs))
        _check_device_alive(self.device)
        for config, exc in zip(configs, errors):
            if exc is not None:
                self.failed.add(config)
                if not isinstance(exc, OutOfResources):
                    print(f"    skip {config}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                          flush=True)

    def measure(self, point: Point, config: MoeConfig, batches) -> tuple[float, bool] | None:
        """(seconds per call, timed from a CUDA graph) or None if the config does not run here."""
        if config in self.failed:
            return None
        calls = [lambda gu=gu, dn=dn, b=b: fused_moe_triton(b.x, gu, dn, b.ids, b.weights, True, None, config)
                 for gu, dn, b in rotation(self.weights, batches)]
        try:
            timing = time_calls(calls, self.device, self.repeat, graph=point.T <= 512)
        except Exception as exc:  # noqa: BLE001
            _check_device_alive(self.device)
            self.failed.add(config)
            if not isinstance(exc, OutOfResources):
                print(f"    skip {config}: {type(exc).__name__}", flush=True)
            return None
        return timing.seconds, timing.graph


def _check_device_alive(device: torch.device) -> None:
    """After a failure: a sticky CUDA error (bad address, ...) ends the run with its message."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def tune_point(bench: Bench, space: Space, point: Point, extra_seeds: list[MoeConfig], deadline: float) -> PointResult:
    """Seeds, then coordinate descent until no one-step move helps or the deadline passes."""
    batches = make_batches(point.shape, point.T, bench.dtype, bench.device, 4 if point.T <= 512 else 2, seed=point.T)
    timings: dict[MoeConfig, tuple[float, bool] | None] = {}

    def late() -> bool:  # past the deadline with something measured
        return time.monotonic() > deadline and any(v is not None for v in timings.values())

    def evaluate(configs: list[MoeConfig]) -> None:
        fresh = list(dict.fromkeys(c for c in configs if c not in timings))
        step = max(1, bench.compile_workers or len(fresh))  # compiled together, then timed one by one
        for start in range(0, len(fresh), step):
            if late():
                return
            part = fresh[start:start + step]
            bench.precompile(part)
            for c in part:
                if late():
                    return
                timings[c] = bench.measure(point, c, batches)

    seeds = [c for c in (space.fit(s, point) for s in extra_seeds) if c is not None] + space.seeds(point)
    evaluate(seeds)
    best = _best(timings)
    while best is not None and time.monotonic() < deadline:
        evaluate(space.neighbours(best, point))
        challenger = _best(timings)
        if timings[challenger][0] > timings[best][0] * (1 - MIN_GAIN):
            break
        best = challenger
    if best is None:  # nothing ran (see the skipped configs above): keep a seed, marked unmeasured
        return PointResult(seeds[0] if seeds else MoeConfig(), None, len(timings), len(timings))
    seconds, graph = timings[best]
    touched = sum(b.experts_touched() for b in batches) / len(batches)
    moved = touched * space.expert_bytes(point.shape)
    failed = sum(v is None for v in timings.values())
    return PointResult(best, seconds, len(timings), failed, graph, moved / seconds / 1e9)


def _best(timings: dict) -> MoeConfig | None:
    ok = [(v[0], i, c) for i, (c, v) in enumerate(timings.items()) if v is not None]
    return min(ok)[2] if ok else None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", help=f"comma-separated, from {', '.join(SHAPES)} (default {','.join(DEFAULT_SHAPES)})")
    p.add_argument("--E", type=int, help="experts (with --H, --I, --top-k: a custom shape)")
    p.add_argument("--H", type=int)
    p.add_argument("--I", type=int)
    p.add_argument("--top-k", type=int, default=1)
    p.add_argument("--tokens", help="comma-separated token counts (default: decode 1..256 and prefill 2048..16384; "
                   f"presets {','.join(map(str, PRESET_TOKENS))})")
    p.add_argument("--dtype", default="bfloat16", help="activations (and the float weights the narrow ones come from)")
    p.add_argument("--format", choices=EXPERT_FORMATS, help="hold the experts in this narrow format (default: float "
                   "weights in --dtype)")
    p.add_argument("--repeat", type=int, default=5, help="timed replays (decode) or launches (prefill) per config")
    p.add_argument("--budget-seconds", type=float, help="wall-clock budget of the whole run (default 240; --small 20)")
    p.add_argument("--compile-workers", type=int, default=8, help="threads compiling candidates ahead of timing (0: none)")
    p.add_argument("--out-dir", type=Path, default=CONFIG_DIR)
    p.add_argument("--small", action="store_true", help="the tiny shape and a 2-value search (CPU smoke run)")
    return p.parse_args(argv)


def plan(args: argparse.Namespace) -> tuple[list[Point], dict[str, float], torch.dtype, dict]:
    """Points to tune (shape by shape), the budget weight of each shape's points, dtype, value lists."""
    if args.small:
        shapes, dtype, values = {"tiny": SHAPES["tiny"]}, torch.float32, SMALL_VALUES
        default_tokens = {"tiny": [1, 16]}
    else:
        if args.E:
            shapes = {"custom": {"E": args.E, "H": args.H, "I": args.I, "K": args.top_k}}
        else:
            names = (args.shapes or ",".join(DEFAULT_SHAPES)).split(",")
            unknown = [n for n in names if n not in SHAPES]
            if unknown:
                raise SystemExit(f"unknown shapes {unknown}; choose from {list(SHAPES)}")
            shapes = {n: SHAPES[n] for n in names}
        dtype, values = getattr(torch, args.dtype), VALUES
        default_tokens = {n: list(PRESET_TOKENS if n in SMALL_SHAPES else DECODE_TOKENS + PREFILL_TOKENS) for n in shapes}
    tokens = {n: ([int(t) for t in args.tokens.split(",")] if args.tokens else default_tokens[n]) for n in shapes}
    points = [Point(n, shapes[n], T) for n in shapes for T in tokens[n]]
    weights = {n: (PRESET_WEIGHT if n in SMALL_SHAPES and not args.small else 1.0) for n in shapes}
    return points, weights, dtype, values


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    cuda = torch.cuda.is_available()
    if not cuda and not args.small:
        print("tuning needs a CUDA device (use --small for a CPU smoke run)", file=sys.stderr)
        return 2
    device = torch.device("cuda" if cuda else "cpu")
    budget = args.budget_seconds or (20.0 if args.small else 240.0)
    points, shape_weight, dtype, values = plan(args)
    space = Space(dtype, _shared_memory_bytes(), values, args.format)
    gpu = device_name(device)
    weights_name = args.format or str(dtype).removeprefix("torch.")
    print(f"tuning {len(points)} points on {gpu}, {dtype}, {weights_name} weights, budget {budget:.0f}s", flush=True)

    results: dict[str, dict[int, PointResult]] = {}
    for name in dict.fromkeys(p.name for p in points):
        shape_points = [p for p in points if p.name == name]
        shape = shape_points[0].shape
        print(f"{name} {shape}", flush=True)
        bench = Bench(name, shape, dtype, device, args.repeat, args.compile_workers, args.format)
        if bench.compile_workers:  # every point's seeds at once: the compiles overlap
            t0 = time.monotonic()
            seeds = list(dict.fromkeys(c for p in shape_points for c in space.seeds(p)))
            bench.precompile(seeds)
            print(f"  compiled {len(seeds)} seed configs in {time.monotonic() - t0:.1f}s", flush=True)
        done = results.setdefault(name, {})
        for point in shape_points:
            now = time.monotonic()
            left = budget - (now - started)
            weight_left = sum(shape_weight[p.name] for p in points if p.T not in results.get(p.name, {}))
            if left <= 0:
                done[point.T] = _unmeasured(point, results)
                print(f"  T={point.T:>6}: budget spent; using {done[point.T].config}", flush=True)
                continue
            deadline = now + left * shape_weight[name] / weight_left
            seeds = _neighbour_seeds(point, results)
            t0 = time.monotonic()
            r = tune_point(bench, space, point, seeds, deadline)
            done[point.T] = r
            best = "none ran" if r.seconds is None else f"best {r.seconds * 1e3:.4f} ms, {r.gbps:.0f} GB/s of weights"
            print(f"  T={point.T:>6}: {r.tried} configs ({r.failed} skipped) in {time.monotonic() - t0:.1f}s; "
                  f"{best}, {r.config}", flush=True)
        del bench
        if cuda:
            torch.cuda.empty_cache()
        provenance = {
            "tool": "bench/tune_moe.py", "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "torch": torch.__version__, "triton": triton_version(), "repeat": args.repeat, "top_k": shape["K"],
            "budget_seconds": budget, "search": "seeds + coordinate descent, pruned",
            "best_ms": {str(t): round(r.seconds * 1e3, 4) for t, r in done.items() if r.seconds is not None},
            "timing": {str(t): ("cuda graph" if r.graph else "eager") for t, r in done.items() if r.seconds is not None},
            "configs_tried": {str(t): r.tried for t, r in done.items()},
            "unmeasured": [t for t, r in done.items() if r.seconds is None],
            "weights": weights_name,
        }
        if args.format:
            provenance["dot"] = {str(t): choose_dot(args.format, dtype, device, t * shape["K"] / shape["E"])
                                 for t in done}
        path = write_table(args.out_dir, shape["E"], shape["I"], shape["H"], dtype, gpu,
                           {t: r.config for t, r in done.items()}, provenance, weights=args.format)
        print(f"wrote {path}", flush=True)
    print(f"done in {time.monotonic() - started:.0f}s")
    return 0


def _neighbour_seeds(point: Point, results: dict[str, dict[int, PointResult]]) -> list[MoeConfig]:
    """Best configs of this shape's nearest tuned T and of the same T in shapes tuned before."""
    seeds = []
    mine = results.get(point.name, {})
    if mine:
        nearest = min(mine, key=lambda t: abs(math.log(t) - math.log(point.T)))
        seeds.append(mine[nearest].config)
    for name, done in results.items():
        if name != point.name and point.T in done:
            seeds.append(done[point.T].config)
    return seeds


def _unmeasured(point: Point, results: dict[str, dict[int, PointResult]]) -> PointResult:
    seeds = _neighbour_seeds(point, results)
    config = seeds[0] if seeds else MoeConfig()
    return PointResult(config, None)


def _shared_memory_bytes() -> int:
    props = torch.cuda.get_device_properties(torch.cuda.current_device()) if torch.cuda.is_available() else None
    return getattr(props, "shared_memory_per_block_optin", 0) or 227 * 1024


if __name__ == "__main__":
    sys.exit(main())
