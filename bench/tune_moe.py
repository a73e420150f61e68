"""Tune the fused-MoE block sizes on this GPU and write the config table the kernels look up.

    python bench/tune_moe.py --shapes llama4-scout,llama4-maverick --dtype bfloat16
    python bench/tune_moe.py --E 64 --H 2048 --I 1408 --top-k 8 --tokens 1,16,256,4096
    python bench/tune_moe.py --small --out-dir /tmp/configs     # tiny search on CPU (interpreter)

For each expert shape and each token count T it times every candidate MoeConfig on one whole
`fused_moe_triton` call (align + both GEMMs + slot sum, uniform random routing) and keeps the
fastest; the table goes to locus/kernels/configs/E<E>_I<I>_H<H>_<dtype>_<GPU name>.json
(see locus/kernels/moe_configs.py), which `fused_moe(..., backend="triton")` then uses for batches
of the nearest T. Candidates that do not fit the GPU (shared memory, registers) are skipped.
A full sweep takes minutes per token count at Llama-4 sizes; --tokens narrows it.
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
# First: on CPU this sets TRITON_INTERPRET, which must happen before anything imports Triton.
from moe_kernels import SHAPES, make_inputs, time_call  # noqa: E402

try:
    from triton.runtime.errors import OutOfResources
except ImportError:  # older Triton: let the error through
    OutOfResources = ()

from locus.kernels.moe_configs import CONFIG_DIR, MoeConfig, device_name, write_table  # noqa: E402
from locus.kernels.moe_triton import fused_moe_triton  # noqa: E402

TOKENS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", help=f"comma-separated, from {', '.join(SHAPES)}")
    p.add_argument("--E", type=int, help="experts (with --H, --I, --top-k: a custom shape)")
    p.add_argument("--H", type=int)
    p.add_argument("--I", type=int)
    p.add_argument("--top-k", type=int, default=1)
    p.add_argument("--tokens", help=f"comma-separated token counts (default {','.join(map(str, TOKENS))})")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--out-dir", type=Path, default=CONFIG_DIR)
    p.add_argument("--small", action="store_true", help="the tiny shape and a 2-config search (CPU smoke run)")
    return p.parse_args(argv)


def candidates(num_tokens: int, top_k: int, num_experts: int, dtype: torch.dtype) -> list[MoeConfig]:
    """The search space, pruned: no BLOCK_M far above the rows an expert can get, and stages that fit."""
    rows_max = max(16, num_tokens * top_k)  # every pair on one expert
    smem_limit = _shared_memory_bytes()
    itemsize = torch.finfo(dtype).bits // 8
    out = []
    for bm, bn, bk, group, warps, stages in itertools.product(
        (16, 32, 64, 128), (32, 64, 128, 256), (32, 64, 128, 256), (1, 8, 16), (4, 8), (2, 3, 4, 5)
    ):
        if bm > 2 * rows_max:
            continue
        if stages * (bm * bk + 2 * bk * bn) * itemsize > smem_limit:  # gate_up: A tile + gate and up tiles
            continue
        if bm * bn * 2 > 128 * 32 * warps * 4:  # two fp32 accumulators; keep register use plausible
            continue
        out.append(MoeConfig(bm, bn, bk, group, warps, stages))
    return out


def tune_shape(shape: dict, tokens: list[int], dtype: torch.dtype, device: torch.device, repeat: int,
               space=candidates) -> tuple[dict[int, MoeConfig], dict[int, float]]:
    """Fastest config and its time (seconds) per token count."""
    best, best_time = {}, {}
    for T in tokens:
        x, gate_up, down, ids, weights = make_inputs(shape, T, dtype, device, seed=T)
        configs = space(T, shape["K"], shape["E"], dtype)
        started = time.perf_counter()
        for config in configs:
            try:
                seconds = time_call(lambda: fused_moe_triton(x, gate_up, down, ids, weights, config=config),
                                    device, repeat, warmup=1)
            except OutOfResources:  # needs more shared memory or registers than this GPU has
                continue
            if T not in best_time or seconds < best_time[T]:
                best[T], best_time[T] = config, seconds
        print(f"  T={T:>6}: {len(configs)} configs in {time.perf_counter() - started:.0f}s; "
              f"best {best_time[T] * 1e3:.3f} ms {best[T]}", flush=True)
    return best, best_time


def small_space(num_tokens: int, top_k: int, num_experts: int, dtype: torch.dtype) -> list[MoeConfig]:
    return [MoeConfig(16, 32, 32, 1), MoeConfig(16, 64, 64, 8)]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.small:
        print("tuning needs a CUDA device (use --small for a CPU smoke run)", file=sys.stderr)
        return 2
    device = torch.device("cuda" if cuda else "cpu")
    if args.small:
        shapes, tokens, space, dtype = {"tiny": SHAPES["tiny"]}, [1, 16], small_space, torch.float32
    else:
        if args.E:
            shapes = {"custom": {"E": args.E, "H": args.H, "I": args.I, "K": args.top_k}}
        else:
            shapes = {n: SHAPES[n] for n in (args.shapes or "llama4-scout,llama4-maverick").split(",")}
        tokens, space, dtype = list(TOKENS), candidates, getattr(torch, args.dtype)
    if args.tokens:
        tokens = [int(t) for t in args.tokens.split(",")]

    gpu = device_name(device)
    for name, shape in shapes.items():
        print(f"{name} {shape} {dtype} on {gpu}", flush=True)
        best, best_time = tune_shape(shape, tokens, dtype, device, args.repeat, space)
        provenance = {
            "tool": "bench/tune_moe.py", "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "torch": torch.__version__, "repeat": args.repeat, "top_k": shape["K"],
            "best_ms": {str(t): round(s * 1e3, 4) for t, s in best_time.items()},
        }
        path = write_table(args.out_dir, shape["E"], shape["I"], shape["H"], dtype, gpu, best, provenance)
        print(f"wrote {path}")
    return 0


def _shared_memory_bytes() -> int:
    props = torch.cuda.get_device_properties(torch.cuda.current_device()) if torch.cuda.is_available() else None
    return getattr(props, "shared_memory_per_block_optin", 0) or 227 * 1024


if __name__ == "__main__":
    sys.exit(main())
