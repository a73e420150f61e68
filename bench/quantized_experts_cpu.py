"""Expert time of one MoE layer on the CPU: bfloat16 weights against fp8 / mxfp8 / mxfp4 weights.

    python bench/quantized_experts_cpu.py --out results/quantized_experts_cpu.json

One `fused_moe(..., backend="cpu")` call per row (the C kernel: moe_cpu.c, moe_cpu_quantized.h), on
the `small` preset's expert shape (E=16, H=256, I=512, top-1) by default, activations in bfloat16,
uniform random routing, T = 1..64 tokens. Per row: the median time of --repeat calls (the variants of
one T are timed in turn, round after round, so a load change on a shared machine hits them alike;
each call takes the next of several copies of the layer, --layer-bytes in all, so its weights come
from beyond the core's caches as in a decode step over many layers),
the expert bytes the call reads (each touched expert's gate_up and down once, scales included), the
effective rate, the speed-up against bfloat16 weights at the same T, and max|diff| against the
format's torch reference (fused_moe_quantized_reference) on the very inputs timed.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from locus.kernels import fused_moe, moe_cpu
from locus.kernels.moe_quantized import EXPERT_FORMATS, fused_moe_quantized_reference, quantize_experts

SHAPES = {"small": (16, 256, 512, 1), "mini": (8, 256, 256, 1), "scout-slice": (4, 1024, 2048, 1)}  # E, H, I, K


def weights_of(E: int, H: int, I: int, seed: int, copies: int) -> dict[str, list]:
    """Per variant, `copies` layers of expert weights (distinct memory, the same values)."""
    gen = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(E, H, 2 * I, generator=gen) / H**0.5
    down = torch.randn(E, I, H, generator=gen) / I**0.5
    variants = {"bfloat16": (gate_up.bfloat16(), down.bfloat16())}
    for fmt in EXPERT_FORMATS:
        variants[fmt] = quantize_experts(gate_up, down, fmt)
    return {name: [tuple(w.clone() for w in pair) for _ in range(copies)] for name, pair in variants.items()}


def expert_bytes(gate_up, down) -> int:
    """Bytes of one expert's weights (scales included)."""
    total = 0
    for w in (gate_up, down):
        total += w.nbytes // w.shape[0] if hasattr(w, "scale") else w[0].numel() * w.element_size()
    return total


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="small", choices=list(SHAPES))
    ap.add_argument("--tokens", default="1,2,4,8,16,32,64")
    ap.add_argument("--repeat", type=int, default=200, help="timed calls per row")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--clock", default="wall", choices=["wall", "thread"],
                    help="wall: perf_counter; thread: this thread's CPU time (with --threads 1 on a machine others "
                         "load: time spent waiting for a core is not counted)")
    ap.add_argument("--layer-bytes", type=float, default=64.0,
                    help="MB of bfloat16 expert weights the calls cycle through (copies of the layer), so that "
                         "each call reads its weights from beyond the core's caches, as a decode step over many "
                         "layers does (default 64; 0: one layer, cache-hot)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if not moe_cpu.available():
        print("the cpu MoE kernel cannot be built here (no C compiler)", file=sys.stderr)
        return 1
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "thread" and torch.get_num_threads() != 1:
        print("--clock thread counts only the calling thread: use it with --threads 1", file=sys.stderr)
        return 2
    clock = time.perf_counter if args.clock == "wall" else time.thread_time
    E, H, I, K = SHAPES[args.shape]
    copies = max(1, round(args.layer_bytes * 1e6 / (E * 3 * H * I * 2)))
    layers = weights_of(E, H, I, args.seed, copies)
    per_expert = {name: expert_bytes(*w[0]) for name, w in layers.items()}
    rows = []
    for T in [int(t) for t in args.tokens.split(",")]:
        gen = torch.Generator().manual_seed(args.seed + T)
        x = torch.randn(T, H, generator=gen).bfloat16()
        ids = torch.stack([torch.randperm(E, generator=gen)[:K] for _ in range(T)])
        weights = (0.1 + 0.9 * torch.rand(T, K, generator=gen)).bfloat16()
        touched = int(ids.unique().numel())
        times: dict[str, list[float]] = {name: [] for name in layers}
        for _ in range(3):  # warm-up: the library
            for copies_of in layers.values():
                fused_moe(x, *copies_of[0], ids, weights, backend="cpu")
        for i in range(args.repeat):
            for name, copies_of in layers.items():
                gate_up, down = copies_of[i % len(copies_of)]
                t0 = clock()
                fused_moe(x, gate_up, down, ids, weights, backend="cpu")
                times[name].append(clock() - t0)
        base = statistics.median(times["bfloat16"])
        for name, copies_of in layers.items():
            gate_up, down = copies_of[0]
            out = fused_moe(x, gate_up, down, ids, weights, backend="cpu")
            if name == "bfloat16":
                from locus.kernels.moe_reference import fused_moe_reference

                ref = fused_moe_reference(x, gate_up, down, ids, weights)
            else:
                ref = fused_moe_quantized_reference(x, gate_up, down, ids, weights)
            t = statistics.median(times[name])
            nbytes = touched * per_expert[name]
            rows.append({"T": T, "weights": name, "ms": t * 1e3, "min_ms": min(times[name]) * 1e3,
                         "expert_bytes": nbytes, "gb_per_s": nbytes / t / 1e9, "speedup_vs_bf16": base / t,
                         "max_abs_diff": (out.float() - ref.float()).abs().max().item()})
    print(f"MoE layer expert time on CPU ({platform.processor() or platform.machine()}, {torch.get_num_threads()} "
          f"threads), shape {args.shape} E={E} H={H} I={I} K={K}, bfloat16 activations, median of {args.repeat}, "
          f"{args.clock} clock, cycling through {copies} copies of the layer")
    print("| T | weights | ms | expert MB read | GB/s | vs bf16 | max abs diff vs reference |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['T']} | {r['weights']} | {r['ms']:.3f} | {r['expert_bytes'] / 1e6:.2f} | {r['gb_per_s']:.1f} | "
              f"{r['speedup_vs_bf16']:.2f}x | {r['max_abs_diff']:.2e} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"shape": args.shape, "clock": args.clock, "copies": copies, "E": E, "H": H, "I": I, "K": K,
                                              "threads": torch.get_num_threads(), "repeat": args.repeat,
                                              "machine": platform.machine(), "rows": rows}, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
