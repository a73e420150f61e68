"""Fused-MoE kernels: backends and expert weight formats side by side, at decode- and prefill-sized batches.

    python bench/moe_kernels.py --out results/moe_kernels.json            # CUDA: Llama-4 + small shapes
    python bench/moe_kernels.py --small --out results/moe_kernels.json    # small shapes only (CPU too)
    python bench/moe_kernels.py --format model,fp8,mxfp8,mxfp4 --shapes llama4-scout --backends triton
    python bench/moe_kernels.py --shapes small --backends cpu --format model,fp8,mxfp8,mxfp4 --dtype bfloat16 \
        --tokens 1,2,4,8,16,32,64 --threads 1 --clock thread --repeat 200 --layer-bytes 64    # the CPU C kernel
    python bench/moe_kernels.py --roofline --shapes llama4-scout,llama4-maverick --out FILE.json

--roofline: the Triton kernels against the device's measured ceilings (moe_roofline.py), with the
GPU targets judged per row; the rest of this docstring is the plain comparison mode.

Rows are (shape, T, weights, backend): one `fused_moe` call each, routing uniform random top-K
(almost every expert is touched once T*K >> E), the weight on the input. `--format` lists the
weights: "model" (float, in --dtype) and the narrow formats fp8, mxfp8, mxfp4 (moe_quantized.py),
quantized from the model-dtype weights an expert at a time. Per row:
    ms       = time of one call (median of --repeat on CPU; CUDA events over --repeat on a GPU)
    TFLOP/s  = 6 * H * I * (T * K) / time        (gate_up is 2*H*2I flops per pair, down 2*I*H)
    GB/s     = expert bytes / time: the weights of the experts the batch touches, each read once,
               in the format they are held in (narrow: elements and scales)
    vs model = the model-dtype row's time (same backend, same T) / this row's
    max|diff| against the weights' reference on the inputs timed: fused_moe_reference for model
               weights (the whole batch); for narrow weights the first PARITY_TOKENS tokens against
               fused_moe_quantized_reference (fused_moe_w8a8_reference where Triton's "fp8" form ran)
and, on a GPU whose peaks are known, the share of peak compute and of peak HBM bandwidth. Decode
batches are bandwidth-bound (watch GB/s), prefill batches compute-bound (watch TFLOP/s).

On CPU the variants of one T are timed in turn, call by call (a load change on a shared machine
hits them alike), and --layer-bytes makes the calls cycle through copies of the layer so that the
weights come from beyond the caches, as in a decode step over many layers (--clock thread with
--threads 1 counts this thread's CPU time only). On a GPU, all narrow formats of a shape are not
held at once: one weight format at a time (Maverick's bf16 experts are 32 GB).

Without CUDA the Triton kernels run in Triton's interpreter (this script sets TRITON_INTERPRET=1), so
CPU timings of the triton backend only show that the script works; the `cpu` backend is the C kernel.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():  # must precede the first import of the Triton kernel modules
    os.environ.setdefault("TRITON_INTERPRET", "1")

from locus.kernels import fused_moe, resolve_backend  # noqa: E402
from locus.kernels.moe_dot_forms import choose_dot  # noqa: E402
from locus.kernels.moe_quantized import (  # noqa: E402
    EXPERT_FORMATS,
    fused_moe_quantized_reference,
    fused_moe_w8a8_reference,
)
from locus.kernels.moe_reference import fused_moe_reference  # noqa: E402

from moe_timing import (  # noqa: E402
    CPU_SHAPES,
    DECODE_TOKENS,
    PREFILL_TOKENS,
    SHAPES,
    SMALL_SHAPES,
    ExpertWeights,
    quantize_layer,
    triton_version,
    weight_bytes,
)

CPU_TOKENS = (1, 16, 64)  # the interpreter runs every program in Python: keep it short
PARITY_TOKENS = 8  # narrow weights: tokens checked against the reference (it dequantizes their experts)
TORCH_NARROW_BYTES = 8e9  # float32 bytes of dequantized experts above which the torch backend's narrow rows are skipped

# Dense 16-bit tensor-core peak (FLOP/s) and HBM bandwidth (B/s), matched on the device name.
DEVICE_PEAKS = {
    "H200": (790e12, 4.8e12),
    "H100": (989e12, 3.35e12),
    "A100": (312e12, 2.0e12),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--small", action="store_true", help="small shapes only (runs on CPU too)")
    p.add_argument("--roofline", action="store_true",
                   help="Triton only, against the measured copy bandwidth and matmul peak, with the GPU targets")
    p.add_argument("--shapes", help=f"comma-separated subset of {', '.join(SHAPES)}")
    p.add_argument("--format", default="model", help="comma-separated expert weight formats: model (float, in "
                   f"--dtype), {', '.join(EXPERT_FORMATS)} (default model; include model for the 'vs model' column)")
    p.add_argument("--tokens", help="comma-separated token counts (default: decode + prefill on CUDA)")
    p.add_argument("--backends", default="triton,torch", help="comma-separated, from triton,torch,cpu (cpu: the C decode kernel, CPU only)")
    p.add_argument("--dtype", default=None, help="bfloat16 (CUDA default), float16, float32 (CPU default)")
    p.add_argument("--repeat", type=int, default=None, help="timed calls per row (default 20 on CUDA, 2 on CPU)")
    p.add_argument("--threads", type=int, help="torch threads on CPU (default: torch's)")
    p.add_argument("--clock", default="wall", choices=["wall", "thread"],
                   help="CPU: wall (perf_counter) or thread (this thread's CPU time; with --threads 1 on a machine "
                        "others load, time spent waiting for a core is not counted)")
    p.add_argument("--layer-bytes", type=float, default=0.0,
                   help="CPU: MB of model-dtype expert weights the calls cycle through (copies of the layer), so "
                        "that each call reads its weights from beyond the caches (default 0: one copy, cache-warm)")
    p.add_argument("--peak-tflops", type=float, help="override the device's peak TFLOP/s")
    p.add_argument("--peak-gbps", type=float, help="override the device's peak GB/s")
    p.add_argument("--cpu-max-rows", type=int, help="run the cpu backend's C kernel up to this many rows per expert "
                   "(default: locus.kernels.moe_cpu.CPU_MAX_ROWS, above which it calls the torch reference)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    return p.parse_args(argv)


def device_peaks(name: str, args: argparse.Namespace) -> tuple[float | None, float | None]:
    flops, bw = next((v for k, v in DEVICE_PEAKS.items() if k in name), (None, None))
    flops = args.peak_tflops * 1e12 if args.peak_tflops else flops
    bw = args.peak_gbps * 1e9 if args.peak_gbps else bw
    return flops, bw


def make_batch(shape: dict, T: int, dtype: torch.dtype, device: torch.device, seed: int):
    """x [T, H], uniform top-K ids and weights in (0.1, 1) [T, K]."""
    E, H, K = shape["E"], shape["H"], shape["K"]
    gen = torch.Generator(device=device).manual_seed(seed + T)
    x = torch.randn(T, H, generator=gen, device=device, dtype=dtype)
    ids = torch.rand(T, E, generator=gen, device=device).topk(K, dim=1).indices
    weights = (torch.rand(T, K, generator=gen, device=device) * 0.9 + 0.1).to(dtype)
    return x, ids, weights


def model_weights(shape: dict, dtype: torch.dtype, device: torch.device, seed: int, copies: int) -> ExpertWeights:
    """`copies` layers of float expert weights in dtype (distinct memory, the same values)."""
    E, H, I = shape["E"], shape["H"], shape["I"]
    gen = torch.Generator(device=device).manual_seed(seed)
    gate_up = torch.empty(E, H, 2 * I, dtype=dtype, device=device).normal_(0.0, H ** -0.5, generator=gen)
    down = torch.empty(E, I, H, dtype=dtype, device=device).normal_(0.0, I ** -0.5, generator=gen)
    return ExpertWeights([gate_up] + [gate_up.clone() for _ in range(copies - 1)],
                         [down] + [down.clone() for _ in range(copies - 1)])


def narrow_weights(model: ExpertWeights, fmt: str) -> ExpertWeights:
    """The model weights' copies in `fmt`, quantized an expert at a time."""
    E = model.gate_up[0].shape[0]
    pairs = [quantize_layer(lambda e, gu=gu, dn=dn: (gu[e:e + 1], dn[e:e + 1]), E, fmt)
             for gu, dn in zip(model.gate_up, model.down)]
    return ExpertWeights([p[0] for p in pairs], [p[1] for p in pairs], fmt)


def time_variants(calls: dict, device: torch.device, repeat: int, clock) -> dict:
    """Seconds per call of each variant: {key: (median or mean, min)}. calls[key] lists one call per
    layer copy, taken in turn. CPU: variants interleaved call by call, median; CUDA: each variant's
    calls back to back between two events, mean."""
    for variant in calls.values():
        for call in variant[:3]:  # warm-up: compiles kernels, builds the C library
            call()
    if device.type == "cuda":
        out = {}
        for key, variant in calls.items():
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for i in range(repeat):
                variant[i % len(variant)]()
            end.record()
            torch.cuda.synchronize(device)
            mean = start.elapsed_time(end) / 1e3 / repeat
            out[key] = (mean, mean)
        return out
    times = {key: [] for key in calls}
    for i in range(repeat):
        for key, variant in calls.items():
            t0 = clock()
            variant[i % len(variant)]()
            times[key].append(clock() - t0)
    return {key: (statistics.median(t), min(t)) for key, t in times.items()}


def measure_shape(name: str, shape: dict, tokens: list[int], backends: list[str], formats: list[str],
                  dtype: torch.dtype, device: torch.device, args: argparse.Namespace, peaks: tuple) -> list[dict]:
    """Rows of one shape. On CPU every format's weights are held at once and the variants of a T are
    timed interleaved; on a GPU one format at a time."""
    cuda = device.type == "cuda"
    copies = 1 if cuda else max(1, round(args.layer_bytes * 1e6 / weight_bytes(shape, dtype)))
    model = model_weights(shape, dtype, device, args.seed, copies)
    groups = [[f] for f in formats] if cuda else [formats]
    clock = time.perf_counter if args.clock == "wall" else time.thread_time
    repeat = args.repeat or (20 if cuda else 2)
    rows = []
    for group in groups:
        held = {f: model if f == "model" else narrow_weights(model, f) for f in group}
        for T in tokens:
            x, ids, w = make_batch(shape, T, dtype, device, args.seed)
            touched = int(torch.unique(ids).numel())
            variants = {(f, b): held[f] for f in group for b in backends if runnable(held[f], b, touched, shape)}
            calls = {key: [lambda gu=gu, dn=dn, b=key[1]: fused_moe(x, gu, dn, ids, w, True, backend=b)
                           for gu, dn in zip(weights.gate_up, weights.down)] for key, weights in variants.items()}
            timed = time_variants(calls, device, repeat, clock)
            for (f, b), weights in variants.items():
                seconds, fastest = timed[(f, b)]
                row = make_row(name, shape, T, b, weights, seconds, touched, dtype, peaks)
                row["min_ms"] = fastest * 1e3
                row["max_abs_diff"] = parity(weights, b, x, ids, w, shape, T, dtype, device)
                rows.append(row)
            del x, ids, w, calls
        del held
        if cuda:
            torch.cuda.empty_cache()
    for row in rows:  # the model-dtype row of the same T and backend, measured in this run
        base = next((r for r in rows if r["weights"] == _dtype_name(dtype) and r["T"] == row["T"]
                     and r["backend"] == row["backend"]), None)
        row["vs_model"] = base["ms"] / row["ms"] if base else None
    return rows


def runnable(weights: ExpertWeights, backend: str, touched: int, shape: dict) -> bool:
    """Whether this (weights, backend) row runs: the torch reference on narrow weights dequantizes every
    touched expert to float32, which the Llama-4 shapes cannot afford at large T."""
    if weights.format is None or backend != "torch":
        return True
    need = touched * 3 * shape["H"] * shape["I"] * 4
    if need > TORCH_NARROW_BYTES:
        print(f"  skip torch on {weights.format}: it would dequantize {need / 1e9:.0f} GB", flush=True)
        return False
    return True


def parity(weights: ExpertWeights, backend: str, x, ids, w, shape: dict, T: int, dtype: torch.dtype,
           device: torch.device) -> float:
    """max|diff| of this row's output against its weights' reference (see the docstring)."""
    gate_up, down = weights.gate_up[0], weights.down[0]
    if weights.format is None:
        actual = fused_moe(x, gate_up, down, ids, w, True, backend=backend)
        expected = fused_moe_reference(x, gate_up, down, ids, w, True)
    else:
        n = min(T, PARITY_TOKENS)
        actual = fused_moe(x, gate_up, down, ids, w, True, backend=backend)[:n]
        rows_per_expert = T * shape["K"] / shape["E"]
        w8a8 = resolve_backend(backend, device) == "triton" and choose_dot(weights.format, dtype, device,
                                                                           rows_per_expert) == "fp8"
        reference = fused_moe_w8a8_reference if w8a8 else fused_moe_quantized_reference
        expected = reference(x[:n], gate_up, down, ids[:n], w[:n], True)
    return (actual.float() - expected.float()).abs().max().item()


def make_row(name: str, shape: dict, T: int, backend: str, weights: ExpertWeights, seconds: float, touched: int,
             dtype: torch.dtype, peaks: tuple) -> dict:
    E, H, I, K = shape["E"], shape["H"], shape["I"], shape["K"]
    flops = 6.0 * H * I * T * K
    expert_bytes = touched * weights.expert_bytes
    peak_flops, peak_bw = peaks
    return {
        "shape": name, "E": E, "H": H, "I": I, "K": K, "T": T,
        "regime": "decode" if T <= 256 else "prefill", "backend": backend,
        "weights": weights.format or _dtype_name(dtype),
        "ms": seconds * 1e3, "tflops": flops / seconds / 1e12, "gbps": expert_bytes / seconds / 1e9,
        "experts_touched": touched, "expert_bytes": expert_bytes,
        "compute_share": flops / seconds / peak_flops if peak_flops else None,
        "bandwidth_share": expert_bytes / seconds / peak_bw if peak_bw else None,
    }


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def print_table(rows: list[dict]) -> None:
    print("| shape | T | weights | backend | ms | TFLOP/s | GB/s | %peak FLOP | %peak BW | vs model | max abs diff |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        vs = f"{r['vs_model']:.2f}x" if r.get("vs_model") else "-"
        print(f"| {r['shape']} | {r['T']} | {r['weights']} | {r['backend']} | {r['ms']:.3f} | {r['tflops']:.2f} | "
              f"{r['gbps']:.1f} | {_percent(r['compute_share'])} | {_percent(r['bandwidth_share'])} | {vs} | "
              f"{r['max_abs_diff']:.2e} |")


def _percent(share: float | None) -> str:
    return f"{100 * share:.1f}%" if share is not None else "-"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    formats = args.format.split(",")
    unknown = [f for f in formats if f != "model" and f not in EXPERT_FORMATS]
    if unknown:
        print(f"unknown weight formats {unknown}; choose from model, {', '.join(EXPERT_FORMATS)}", file=sys.stderr)
        return 2
    if args.roofline:
        from moe_roofline import run_roofline

        return run_roofline(args, argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    names = args.shapes.split(",") if args.shapes else list(SMALL_SHAPES if args.small or not cuda else SHAPES)
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        print(f"unknown shapes {unknown}; choose from {list(SHAPES)}", file=sys.stderr)
        return 2
    if not cuda and any(n not in CPU_SHAPES for n in names):
        print("the Llama-4 shapes need a CUDA device", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "thread" and (cuda or torch.get_num_threads() != 1):
        print("--clock thread counts only the calling thread's CPU time: use it on CPU with --threads 1", file=sys.stderr)
        return 2
    if args.tokens:
        tokens = [int(t) for t in args.tokens.split(",")]
    else:
        tokens = list(DECODE_TOKENS + PREFILL_TOKENS) if cuda else list(CPU_TOKENS)
    dtype = getattr(torch, args.dtype or ("bfloat16" if cuda else "float32"))
    backends = args.backends.split(",")
    if args.cpu_max_rows is not None:
        from locus.kernels import moe_cpu

        moe_cpu.CPU_MAX_ROWS = dict.fromkeys(moe_cpu.CPU_MAX_ROWS, args.cpu_max_rows)
        moe_cpu.CPU_MAX_ROWS_QUANTIZED = args.cpu_max_rows
    name = (torch.cuda.get_device_name(device) if cuda else
            f"cpu ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, Triton interpreter)")
    peaks = device_peaks(name, args) if cuda else (None, None)
    repeat = args.repeat or (20 if cuda else 2)

    print(f"device: {name}   dtype: {dtype}   repeat: {repeat}   clock: {args.clock}")
    rows = []
    for shape_name in names:
        rows += measure_shape(shape_name, SHAPES[shape_name], tokens, backends, formats, dtype, device, args, peaks)
    print_table(rows)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        result = {
            "benchmark": "moe_kernels", "device": name, "dtype": _dtype_name(dtype), "formats": formats,
            "peak_flops": peaks[0], "peak_bytes_per_s": peaks[1], "repeat": repeat, "clock": args.clock,
            "threads": torch.get_num_threads(), "layer_bytes_mb": args.layer_bytes,
            "command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
            "versions": {"torch": torch.__version__, "triton": triton_version()},
            "rows": rows,
        }
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
