"""The CPU routed-expert kernel (moe_cpu.c): built on first use with the system C compiler, called
through ctypes.

`fused_moe_cpu` has `fused_moe_reference`'s signature and results. It runs the C kernel when every
expert holds at most CPU_MAX_ROWS[dtype] rows (decode: the kernel reads each touched expert's weights once,
where a small-M `bmm` reads them about twice) and the weights are float32 or bfloat16 with unit
column stride; otherwise (prefill, other dtypes) it is the reference. The kernel does the whole layer
(pair sort, row gather, both GEMMs, slot sum) in two library calls, no tensor op between them.

Quantized expert weights (moe_quantized.py: fp8, mxfp8, mxfp4) run through `locus_moe_run_q_*`
(moe_cpu_quantized.h), which widens each weight in registers: the same pair sort, row gather and slot
sum around it. Up to CPU_MAX_ROWS_QUANTIZED rows per expert; beyond that, and for layouts it does not
take, fused_moe_quantized_reference.

Build: c_library.py (on first use, cached per machine). No compiler, or a failed build: one warning,
and the `cpu` backend is not available (`"auto"` then means the torch reference on CPU).

Shape legend as in moe_reference: T tokens, K slots, E experts held here, H hidden, I expert width.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from locus.kernels import c_library
from locus.kernels.formats import QuantizedTensor
from locus.kernels.moe_quantized import check_expert_weights, fused_moe_quantized_reference
from locus.kernels.moe_reference import check_shapes, fused_moe_reference

SOURCE = Path(__file__).with_name("moe_cpu.c")
KERNEL_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}
# Above this many rows per expert the reference's GEMMs may be faster. bfloat16: oneDNN's bf16 GEMM
# overtakes the kernel at 12-14 rows. float32: on the `small` expert shape the kernel still won at
# 128 rows, but MKL's float32 GEMM gains more with size on larger shapes, so the limit stays at 64.
# Measured with bench/moe_kernels.py --cpu-max-rows, 2 threads (docs/kernels.md).
CPU_MAX_ROWS = {torch.float32: 64, torch.bfloat16: 12}
# Quantized weights: the alternative is dequantizing the experts in use before the reference's
# GEMMs, so the kernel keeps much larger batches: on the `small` expert shape (4 experts in use, one
# thread) it was faster up to 256 rows per expert and slower at 512 (docs/formats.md).
CPU_MAX_ROWS_QUANTIZED = 256
QUANTIZED_FORMATS = {"fp8": 1, "mxfp8": 2, "mxfp4": 3}  # moe_cpu_quantized.h's QFMT_*


class QWeights(ctypes.Structure):
    """moe_cpu_quantized.h's qweights: one quantized expert tensor, strides in elements."""

    _fields_ = [("data", ctypes.c_void_p), ("se", ctypes.c_int64), ("sk", ctypes.c_int64),
                ("scale", ctypes.c_void_p), ("sse", ctypes.c_int64), ("ssk", ctypes.c_int64)]

    @classmethod
    def of(cls, q: QuantizedTensor) -> "QWeights":
        return cls(q.data.data_ptr(), q.data.stride(0), q.data.stride(1), q.scale.data_ptr(), q.scale.stride(0),
                   q.scale.stride(1))


@functools.cache
def load_library() -> ctypes.CDLL | None:
    """The compiled kernel library, built if this machine has none yet; None if it cannot be built."""
    ptr, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    run = [ptr, ptr, i32, i32, i32, ptr, i64, i64, ptr, i64, i64, i32, i32, i32, ptr, ptr, ptr, i32]
    run_q = [ptr, ptr, i32, i32, i32, ctypes.POINTER(QWeights), ctypes.POINTER(QWeights), i32, i32, i32, i32, ptr,
             ptr, ptr, i32]
    return c_library.build(SOURCE, "the cpu MoE kernel", "using the torch reference", {
        "locus_moe_sort": ([ptr, i64, ptr, i64, i32, ptr], i64),
        **{f"locus_moe_run_{suffix}": (run, None) for suffix in KERNEL_DTYPES.values()},
        **{f"locus_moe_run_q_{suffix}": (run_q, None) for suffix in KERNEL_DTYPES.values()},
    })


def available() -> bool:
    return load_library() is not None


def kernel_applies(x: torch.Tensor, gate_up, down) -> bool:
    """The C kernel can take this call (rows per expert aside): CPU, a kernel dtype, unit column strides."""
    if isinstance(gate_up, QuantizedTensor):
        check_expert_weights(gate_up, down)
        return (x.device.type == gate_up.device.type == "cpu" and x.dtype in KERNEL_DTYPES
                and gate_up.format in QUANTIZED_FORMATS and available()
                and all(t.stride(2) == 1 for q in (gate_up, down) for t in (q.data, q.scale)))
    return (gate_up.device.type == "cpu" and gate_up.dtype in KERNEL_DTYPES and down.dtype == x.dtype == gate_up.dtype
            and gate_up.stride(2) == 1 and down.stride(2) == 1 and available())


def fused_moe_cpu(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    weight_on_input: bool = True,
    expert_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """Routed-expert output [T, H] in x's dtype; the math of fused_moe_reference, accumulated in
    float32 (the reference rounds g, u and silu(g)*u to the input dtype; this keeps them in float32).
    Two library calls: the pair sort (which says whether the kernel applies), then everything else."""
    T, H, K, E, I = check_shapes(x, gate_up, down, topk_ids, topk_weights)
    quantized = isinstance(gate_up, QuantizedTensor)
    reference = fused_moe_quantized_reference if quantized else fused_moe_reference
    if not kernel_applies(x, gate_up, down):
        return reference(x, gate_up, down, topk_ids, topk_weights, weight_on_input, expert_map)
    lib, P = load_library(), T * K
    ids = topk_ids.reshape(-1).to(torch.int64).contiguous()
    mapping = None if expert_map is None else expert_map.to(torch.int64).contiguous()
    iwork = torch.empty(2 * E + 1 + 2 * P, dtype=torch.int64)  # offsets, order, slot rows, cursors
    most = lib.locus_moe_sort(ids.data_ptr(), P, None if mapping is None else mapping.data_ptr(),
                              0 if mapping is None else mapping.numel(), E, iwork.data_ptr())
    if most < 0:
        bound = f"the expert map's {mapping.numel()} entries" if mapping is not None else f"{E} experts"
        raise ValueError(f"topk_ids hold an expert id outside {bound} (or the map sends one past {E} local experts)")
    if most > (CPU_MAX_ROWS_QUANTIZED if quantized else CPU_MAX_ROWS[x.dtype]):
        return reference(x, gate_up, down, topk_ids, topk_weights, weight_on_input, expert_map)
    held = int(iwork[E])
    x = x.contiguous()
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    fwork = torch.empty(held * (2 * H + I))  # rows, h, y (float32)
    out = torch.empty(T, H, dtype=x.dtype)
    if quantized:
        getattr(lib, f"locus_moe_run_q_{KERNEL_DTYPES[x.dtype]}")(
            x.data_ptr(), weights.data_ptr(), T, K, int(weight_on_input), ctypes.byref(QWeights.of(gate_up)),
            ctypes.byref(QWeights.of(down)), QUANTIZED_FORMATS[gate_up.format], E, H, I, iwork.data_ptr(),
            fwork.data_ptr(), out.data_ptr(), torch.get_num_threads())
        return out
    getattr(lib, f"locus_moe_run_{KERNEL_DTYPES[x.dtype]}")(
        x.data_ptr(), weights.data_ptr(), T, K, int(weight_on_input), gate_up.data_ptr(), gate_up.stride(0),
        gate_up.stride(1), down.data_ptr(), down.stride(0), down.stride(1), E, H, I, iwork.data_ptr(),
        fwork.data_ptr(), out.data_ptr(), torch.get_num_threads())
    return out
