"""Expert kernels: Triton fused-MoE and the torch references beside them. Imports nothing of ours.

`fused_moe` is the one entry point the model calls; `backend` picks the implementation:
    "torch"   moe_reference.fused_moe_reference (any device)
    "triton"  moe_triton.fused_moe_triton: align (moe_align) -> grouped GEMMs (moe_gemm) -> slot sum,
              block sizes from moe_configs; needs CUDA, or TRITON_INTERPRET=1 on CPU (tests)
    "cpu"     moe_cpu.fused_moe_cpu: a C kernel built on first use for decode-sized batches (few rows
              per expert), the reference's per-expert loop otherwise; CPU tensors
    "auto"    triton for CUDA tensors; cpu for CPU tensors when its kernel builds, else torch
gate_up and down may be `QuantizedTensor`s (moe_quantized.py: fp8, mxfp8, mxfp4 expert weights): the
cpu backend reads them in its C kernel, triton in its GEMMs (moe_narrow.py); torch runs
fused_moe_quantized_reference.
The Triton modules are imported on first use, so importing this package never needs triton. On CPU,
TRITON_INTERPRET=1 must be set before anything imports Triton at all (tests/conftest.py, bench scripts).
"""

from __future__ import annotations

import torch

from locus.kernels.backends import MOE_BACKENDS, resolve_backend, run_fused_moe
from locus.kernels.formats import QuantizedTensor

__all__ = ["MOE_BACKENDS", "QuantizedTensor", "fused_moe", "resolve_backend", "run_fused_moe"]


def fused_moe(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    weight_on_input: bool = True,
    expert_map: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Routed-expert output [T, H] for x [T, H]; see moe_reference for the math and shapes.

    Under torch.compile this is one opaque custom op (`locus::fused_moe`, moe_op.py): the rows per
    expert are data-dependent, so the compiled graph calls the kernels instead of tracing them."""
    if torch.compiler.is_compiling():
        from locus.kernels.moe_op import fused_moe_op, fused_moe_quantized_op

        if isinstance(gate_up, QuantizedTensor):
            return fused_moe_quantized_op(x, gate_up.data, gate_up.scale, down.data, down.scale, gate_up.format,
                                          topk_ids, topk_weights, weight_on_input, expert_map, backend)

        return fused_moe_op(x, gate_up, down, topk_ids, topk_weights, weight_on_input, expert_map, backend)
    return run_fused_moe(x, gate_up, down, topk_ids, topk_weights, weight_on_input, expert_map, backend)
