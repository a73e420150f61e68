"""Fused-MoE kernels: Triton vs the torch reference, at decode-like and prefill-like batch sizes.

    python bench/moe_kernels.py --out results/moe_kernels.json            # CUDA: Llama-4 + small shapes
    python bench/moe_kernels.py --small --out results/moe_kernels.json    # small shapes only (CPU too)
    python bench/moe_kernels.py --roofline --shapes llama4-scout,llama4-maverick --out FILE.json

--roofline: the Triton kernels against the device's measured ceilings (moe_roofline.py), with the
GPU targets judged per row; the rest of this docstring is the plain comparison mode.

For each expert shape, token count T and backend it prints the time of one `fused_moe` call and
    TFLOP/s  = 6 * H * I * (T * K) / time        (gate_up is 2*H*2I flops per pair, down 2*I*H)
    GB/s     = bytes of the expert weights the batch touches / time  (each used expert's gate_up
               and down read once: 3 * H * I * itemsize per distinct expert)
and, on a GPU whose peaks are known, the share of peak compute and of peak HBM bandwidth. Decode
batches are bandwidth-bound (watch GB/s), prefill batches compute-bound (watch TFLOP/s). Routing is
uniform random top-K, so almost every expert is touched once T*K >> E. The max|diff| column is a
parity check on the very inputs timed: each backend against torch (the torch row: triton against torch).

Without CUDA the Triton kernels run in Triton's interpreter (this script sets TRITON_INTERPRET=1), so
CPU timings only show that the script works; only the small shapes at a few token counts run there.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

if not torch.cuda.is_available():  # must precede the first import of the Triton kernel modules
    os.environ.setdefault("TRITON_INTERPRET", "1")

from locus.kernels import fused_moe  # noqa: E402

from moe_timing import DECODE_TOKENS, PREFILL_TOKENS, SHAPES, SMALL_SHAPES, triton_version  # noqa: E402
CPU_TOKENS = (1, 16, 64)  # the interpreter runs every program in Python: keep it short

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
    p.add_argument("--tokens", help="comma-separated token counts (default: decode + prefill on CUDA)")
    p.add_argument("--backends", default="triton,torch", help="comma-separated, from triton,torch,cpu (cpu: the C decode kernel, CPU only)")
    p.add_argument("--dtype", default=None, help="bfloat16 (CUDA default), float16, float32 (CPU default)")
    p.add_argument("--repeat", type=int, default=None, help="timed calls per row (default 20 on CUDA, 2 on CPU)")
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


def make_inputs(shape: dict, T: int, dtype: torch.dtype, device: torch.device, seed: int):
    """x [T, H], gate_up [E, H, 2I], down [E, I, H], uniform top-K ids and sigmoid-like weights [T, K]."""
    E, H, I, K = shape["E"], shape["H"], shape["I"], shape["K"]
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(T, H, generator=gen, device=device, dtype=dtype)
    gate_up = torch.randn(E, H, 2 * I, generator=gen, device=device, dtype=dtype) * H**-0.5
    down = torch.randn(E, I, H, generator=gen, device=device, dtype=dtype) * I**-0.5
    ids = torch.rand(T, E, generator=gen, device=device).topk(K, dim=1).indices
    weights = torch.rand(T, K, generator=gen, device=device) * 0.9 + 0.1
    return x, gate_up, down, ids, weights


def time_call(fn, device: torch.device, repeat: int, warmup: int = 2) -> float:
    """Mean seconds per call of fn() after warm-up (CUDA events on a GPU, wall clock on CPU)."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeat):
            fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / 1e3 / repeat
    t0 = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - t0) / repeat


def measure_shape(name: str, shape: dict, tokens: list[int], backends: list[str], dtype: torch.dtype,
                  device: torch.device, repeat: int, peaks: tuple, seed: int) -> list[dict]:
    rows = []
    for T in tokens:
        x, gate_up, down, ids, weights = make_inputs(shape, T, dtype, device, seed)
        outputs = {}
        for backend in backends:
            def call(b=backend):
                return fused_moe(x, gate_up, down, ids, weights, weight_on_input=True, backend=b)

            outputs[backend] = call()
            seconds = time_call(call, device, repeat)
            rows.append(make_row(name, shape, T, backend, seconds, ids, dtype, peaks))
        if "torch" in outputs and len(outputs) > 1:  # parity of each other backend with the reference
            for row in rows[-len(backends):]:
                other = outputs["triton" if row["backend"] == "torch" and "triton" in outputs else row["backend"]]
                row["max_abs_diff"] = (other.float() - outputs["torch"].float()).abs().max().item()
        del x, gate_up, down, outputs
    return rows


def make_row(name: str, shape: dict, T: int, backend: str, seconds: float, ids: torch.Tensor,
             dtype: torch.dtype, peaks: tuple) -> dict:
    E, H, I, K = shape["E"], shape["H"], shape["I"], shape["K"]
    flops = 6.0 * H * I * T * K
    touched = int(torch.unique(ids).numel())
    weight_bytes = 3.0 * H * I * touched * torch.finfo(dtype).bits / 8
    peak_flops, peak_bw = peaks
    return {
        "shape": name, "E": E, "H": H, "I": I, "K": K, "T": T,
        "regime": "decode" if T <= 256 else "prefill", "backend": backend,
        "ms": seconds * 1e3, "tflops": flops / seconds / 1e12, "gbps": weight_bytes / seconds / 1e9,
        "experts_touched": touched,
        "compute_share": flops / seconds / peak_flops if peak_flops else None,
        "bandwidth_share": weight_bytes / seconds / peak_bw if peak_bw else None,
    }


def print_table(rows: list[dict]) -> None:
    head = (f"{'shape':<16}{'T':>6}  {'backend':<7}{'ms':>10}{'TFLOP/s':>9}{'GB/s':>9}"
            f"{'%peak FLOP':>11}{'%peak BW':>9}{'max|diff|':>10}")
    print(head)
    print("-" * len(head))
    for r in rows:
        print(f"{r['shape']:<16}{r['T']:>6}  {r['backend']:<7}{r['ms']:>10.3f}{r['tflops']:>9.2f}{r['gbps']:>9.1f}"
              f"{_percent(r['compute_share']):>11}{_percent(r['bandwidth_share']):>9}"
              f"{format(r['max_abs_diff'], '.2e') if 'max_abs_diff' in r else '-':>10}")


def _percent(share: float | None) -> str:
    return f"{100 * share:.1f}%" if share is not None else "-"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
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
    if not cuda and any(n not in SMALL_SHAPES for n in names):
        print("the Llama-4 shapes need a CUDA device", file=sys.stderr)
        return 2
    if args.tokens:
        tokens = [int(t) for t in args.tokens.split(",")]
    else:
        tokens = list(DECODE_TOKENS + PREFILL_TOKENS) if cuda else list(CPU_TOKENS)
    dtype = getattr(torch, args.dtype or ("bfloat16" if cuda else "float32"))
    repeat = args.repeat or (20 if cuda else 2)
    backends = args.backends.split(",")
    if args.cpu_max_rows is not None:
        from locus.kernels import moe_cpu

        moe_cpu.CPU_MAX_ROWS = dict.fromkeys(moe_cpu.CPU_MAX_ROWS, args.cpu_max_rows)
    name = torch.cuda.get_device_name(device) if cuda else f"cpu ({platform.processor() or platform.machine()}, Triton interpreter)"
    peaks = device_peaks(name, args) if cuda else (None, None)

    print(f"device: {name}   dtype: {dtype}   repeat: {repeat}")
    rows = []
    for shape_name in names:
        rows += measure_shape(shape_name, SHAPES[shape_name], tokens, backends, dtype, device, repeat, peaks, args.seed)
        if cuda:
            torch.cuda.empty_cache()
    print_table(rows)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        result = {
            "benchmark": "moe_kernels", "device": name, "dtype": str(dtype).removeprefix("torch."),
            "peak_flops": peaks[0], "peak_bytes_per_s": peaks[1], "repeat": repeat,
            "command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
            "versions": {"torch": torch.__version__, "triton": triton_version()},
            "rows": rows,
        }
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
