"""The fused-MoE roofline table: each batch size against the device's measured ceilings and targets.

    python bench/moe_kernels.py --roofline --shapes llama4-scout,llama4-maverick --out FILE.json
    python bench/moe_kernels.py --roofline --shapes small,tiny --tokens 1,4 --dtype float32   # CPU self-check
    python bench/moe_kernels.py --roofline --format model,fp8,mxfp8,mxfp4 --shapes llama4-scout --out FILE.json

Per expert shape and token count T, one `fused_moe(..., backend="triton")` call with the tuned
config for T (uniform random top-K routing, weight on the input):
- ms: per call; decode rows (T <= 512) replay a CUDA graph of several calls, each with its own
  routing, which is how the CUDA-graph decode step runs them; prefill rows launch eagerly.
  `eager_ms` (decode rows) is the same calls launched one by one from Python, host included.
- weights (--format, a column): the experts in the model dtype ("model") or held narrow (fp8, mxfp8,
  mxfp4: moe_quantized.py), with the dot form the call ran (moe_dot_forms.choose_dot).
- bytes a call must move: the weights of the experts its tokens touch, each read once (3 * H * I *
  itemsize per expert; narrow: its elements and scales, as stored), plus the activations (x read,
  out written: 2 * T * H * itemsize);
  GB/s = bytes / time, and its share of the measured copy bandwidth (bench/device_ceilings.py:
  a large device-to-device copy, bytes read + written).
- FLOPs: 6 * H * I * T * K (gate_up 2 * H * 2I, down 2 * I * H per token and slot); TFLOP/s and
  the share of the measured dense matmul peak in the same dtype (an 8192^3 product).
- max|diff|: against `fused_moe_reference` on the first timed batch; parity when within the
  dtype's tolerance (atol = rtol: float32 1e-4, float16 1e-2, bfloat16 5e-2). Narrow weights: its
  first PARITY_TOKENS tokens against the format's reference (fused_moe_quantized_reference, or
  fused_moe_w8a8_reference where the "fp8" form ran), which dequantizes only the experts they use.
- target and pass, on the Llama-4 shapes: >= 50% of the copy bandwidth at T = 1..4 and >= 85% at
  T = 8..256; >= 60% of the matmul peak on Scout's shape at T >= 4096 and >= 40% on Maverick's at
  T = 16384. A row passes when it meets its target and its parity check.
The expert weights are allocated once per shape and format (Maverick's bf16 experts are 32 GB;
narrow ones are drawn and quantized an expert at a time) and freed before the next. JSON rows
(--out rewritten after every row, `"complete": false` until the last), then a markdown table printed last.

Without CUDA it runs only the small shapes (the Triton interpreter; CPU figures say nothing about a
GPU, and the CPU "bandwidth" is a read, not a copy) and exits 2 for any other shape.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch
from device_ceilings import Ceilings, measure
from moe_timing import (
    DECODE_TOKENS,
    PREFILL_TOKENS,
    SHAPES,
    SMALL_SHAPES,
    make_batches,
    make_weights,
    rotation,
    time_calls,
    triton_version,
)

from locus.kernels import fused_moe
from locus.kernels.moe_dot_forms import choose_dot
from locus.kernels.moe_quantized import fused_moe_quantized_reference, fused_moe_w8a8_reference
from locus.kernels.moe_reference import fused_moe_reference

DEFAULT_SHAPES = ("llama4-scout", "llama4-maverick")
CPU_TOKENS = (1, 4)
GRAPH_MAX_TOKENS = 512
PARITY_TOKENS = 8  # narrow weights: tokens checked against the reference (it dequantizes their experts)
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}


def target(shape_name: str, T: int) -> tuple[str, float] | None:
    """(what, at least) that the row must reach, or None: only the Llama-4 shapes have targets."""
    if shape_name not in ("llama4-scout", "llama4-maverick"):
        return None
    if T <= 4:
        return "bandwidth", 0.50
    if T <= 256:
        return "bandwidth", 0.85
    if shape_name == "llama4-scout" and T >= 4096:
        return "compute", 0.60
    if shape_name == "llama4-maverick" and T >= 16384:
        return "compute", 0.40
    return None


def run_roofline(args: argparse.Namespace, argv: list[str] | None) -> int:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    names = args.shapes.split(",") if args.shapes else list(DEFAULT_SHAPES if cuda else ())
    unknown = [n for n in names if n not in SHAPES]
    if unknown:
        print(f"unknown shapes {unknown}; choose from {list(SHAPES)}", file=sys.stderr)
        return 2
    if not cuda and (not names or any(n not in SMALL_SHAPES for n in names)):
        print("the roofline table needs a CUDA device (no CUDA here); on CPU only the small shapes run, "
              f"under the Triton interpreter: --shapes {','.join(SMALL_SHAPES)}", file=sys.stderr)
        return 2
    tokens = ([int(t) for t in args.tokens.split(",")] if args.tokens
              else list(DECODE_TOKENS + PREFILL_TOKENS) if cuda else list(CPU_TOKENS))
    dtype = getattr(torch, args.dtype or ("bfloat16" if cuda else "float32"))
    repeat = args.repeat or (10 if cuda else 1)
    ceilings = _ceilings(args, device, dtype)
    label = torch.cuda.get_device_name(device) if cuda else f"cpu ({platform.machine()}, Triton interpreter)"
    print(f"device: {label}   dtype: {str(dtype).removeprefix('torch.')}   "
          f"{'copy' if cuda else 'read'} bandwidth {ceilings.bandwidth / 1e9:,.0f} GB/s   "
          f"matmul {ceilings.matmul_flops / 1e12:,.1f} TFLOP/s", flush=True)

    rows = []

    def write_result(complete: bool) -> dict:
        """The JSON; written after every row (`complete` false until the last, each write whole: a
        temporary file renamed), so a run cut short by a time budget keeps the rows it measured."""
        judged = [r for r in rows if r["pass"] is not None]
        data = {
            "benchmark": "moe_roofline", "device": label, "dtype": str(dtype).removeprefix("torch."),
            "ceilings": ceilings.to_json(), "repeat": repeat,
            "command": " ".join([Path(sys.argv[0]).name] + (argv if argv is not None else sys.argv[1:])),
            "versions": {"torch": torch.__version__, "triton": triton_version()},
            "complete": complete, "targets_met": sum(r["pass"] for r in judged), "targets_judged": len(judged),
            "rows": rows,
        }
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            partial = args.out.with_name(args.out.name + ".partial")
            partial.write_text(json.dumps(data, indent=1) + "\n")
            partial.replace(args.out)
        return data

    for name in names:
        shape = SHAPES[name]
        for fmt in weight_formats(args):
            weights = make_weights(shape, dtype, device, seed=args.seed, fmt=fmt)
            for T in tokens:
                rows.append(measure_row(name, shape, T, weights, dtype, device, repeat, ceilings, args.seed))
                print(_markdown_row(rows[-1]), flush=True)
                write_result(complete=False)
            del weights
            if cuda:
                torch.cuda.empty_cache()

    final = write_result(complete=True)
    if args.out:
        print(f"wrote {args.out}")
    print()
    print(markdown_table(rows))
    print(f"\ntargets met: {final['targets_met']} of {final['targets_judged']}")
    return 0


def weight_formats(args: argparse.Namespace) -> list[str | None]:
    """--format as the weight formats to run: None for the model dtype ("model"), else fp8 / mxfp8 / mxfp4."""
    return [None if f == "model" else f for f in args.format.split(",")]


def measure_row(name: str, shape: dict, T: int, weights, dtype: torch.dtype, device: torch.device, repeat: int,
                ceilings: Ceilings, seed: int) -> dict:
    E, H, I, K = shape["E"], shape["H"], shape["I"], shape["K"]
    fmt = weights.format
    batches = make_batches(shape, T, dtype, device, 4 if T <= GRAPH_MAX_TOKENS else 2, seed=seed + T)
    calls = [lambda gu=gu, dn=dn, b=b: fused_moe(b.x, gu, dn, b.ids, b.weights, True, backend="triton")
             for gu, dn, b in rotation(weights, batches)]
    timing = time_calls(calls, device, repeat, graph=T <= GRAPH_MAX_TOKENS)
    eager = time_calls(calls, device, repeat, graph=False) if T <= GRAPH_MAX_TOKENS and device.type == "cuda" else None

    first = batches[0]
    actual = fused_moe(first.x, weights.gate_up[0], weights.down[0], first.ids, first.weights, True, backend="triton")
    dot = choose_dot(fmt or "float", dtype, device, T * K / E)
    if fmt is None:
        expected = fused_moe_reference(first.x, weights.gate_up[0], weights.down[0], first.ids, first.weights, True)
    else:  # the first tokens (each output row depends on its own token only)
        n = min(T, PARITY_TOKENS)
        reference = fused_moe_w8a8_reference if dot == "fp8" else fused_moe_quantized_reference
        expected = reference(first.x[:n], weights.gate_up[0], weights.down[0], first.ids[:n], first.weights[:n], True)
        actual = actual[:n]
    diff = (actual.float() - expected.float()).abs().max().item()
    tol = TOLERANCE[dtype]
    parity = bool(torch.allclose(actual.float(), expected.float(), atol=tol, rtol=tol))
    del actual, expected

    itemsize = torch.finfo(dtype).bits // 8
    touched = sum(b.experts_touched() for b in batches) / len(batches)
    moved = touched * weights.expert_bytes + 2 * T * H * itemsize
    flops = 6.0 * H * I * T * K
    seconds = timing.seconds
    bw_share = moved / seconds / ceilings.bandwidth
    flop_share = flops / seconds / ceilings.matmul_flops
    goal = target(name, T)
    achieved = None if goal is None else (bw_share if goal[0] == "bandwidth" else flop_share)
    return {
        "shape": name, "E": E, "H": H, "I": I, "K": K, "T": T,
        "weights": fmt or str(dtype).removeprefix("torch."), "dot": None if fmt is None else dot,
        "regime": "decode" if T <= 256 else "prefill",
        "ms": seconds * 1e3, "timing": "cuda graph" if timing.graph else ("eager" if device.type == "cuda" else "wall clock"),
        "eager_ms": eager.seconds * 1e3 if eager else None,
        "experts_touched": touched, "bytes": moved, "gbps": moved / seconds / 1e9, "bandwidth_share": bw_share,
        "flops": flops, "tflops": flops / seconds / 1e12, "compute_share": flop_share,
        "max_abs_diff": diff, "parity": parity,
        "target": None if goal is None else {"of": goal[0], "at_least": goal[1]},
        "pass": None if goal is None else bool(parity and achieved >= goal[1]),
    }


def _ceilings(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> Ceilings:
    """Measured now (bench/device_ceilings.py), or as given by --peak-gbps and --peak-tflops."""
    if args.peak_gbps and args.peak_tflops:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
        return Ceilings(name, args.peak_gbps * 1e9, args.peak_tflops * 1e12, str(dtype).removeprefix("torch."))
    measured = measure(device, dtype)
    if args.peak_gbps or args.peak_tflops:
        measured = Ceilings(measured.device, (args.peak_gbps or measured.bandwidth / 1e9) * 1e9,
                            (args.peak_tflops or measured.matmul_flops / 1e12) * 1e12, measured.dtype)
    return measured


HEADER = ("| shape | T | weights | ms | eager ms | GB/s | % BW | TFLOP/s | % peak | max\\|diff\\| | target | pass |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|")


def _markdown_row(r: dict) -> str:
    goal = "-" if r["target"] is None else f"{'BW' if r['target']['of'] == 'bandwidth' else 'peak'} >= {r['target']['at_least']:.0%}"
    verdict = "-" if r["pass"] is None else ("pass" if r["pass"] else "FAIL")
    if not r["parity"]:
        verdict += " (parity)"
    eager = "-" if r["eager_ms"] is None else f"{r['eager_ms']:.4f}"
    weights = r["weights"] + (f" ({r['dot']})" if r["dot"] else "")
    return (f"| {r['shape']} | {r['T']} | {weights} | {r['ms']:.4f} | {eager} | {r['gbps']:,.0f} | {r['bandwidth_share']:.1%} | "
            f"{r['tflops']:.1f} | {r['compute_share']:.1%} | {r['max_abs_diff']:.2e} | {goal} | {verdict} |")


def markdown_table(rows: list[dict]) -> str:
    return "\n".join([HEADER] + [_markdown_row(r) for r in rows])
