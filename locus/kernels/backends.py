"""Which fused-MoE implementation runs, and running it eagerly: `run_fused_moe` is what `fused_moe`
calls outside compiled graphs and what the custom ops of moe_op.py call inside them (the backends
are listed in this package's docstring)."""

from __future__ import annotations

import torch

from locus.kernels.formats import QuantizedTensor
from locus.kernels.moe_quantized import fused_moe_quantized_reference
from locus.kernels.moe_reference import fused_moe_reference

MOE_BACKENDS = ("auto", "torch", "triton", "cpu")


def run_fused_moe(x, gate_up, down, topk_ids, topk_weights, weight_on_input, expert_map, backend) -> torch.Tensor:
    """`fused_moe` run eagerly (what the custom op's implementation calls)."""
    backend = resolve_backend(backend, x.device)
    if backend == "torch":
        if isinstance(gate_up, QuantizedTensor):
            return fused_moe_quantized_reference(x, gate_up, down, topk_ids, topk_weights, weight_on_input, expert_map)
        return fused_moe_reference(x, gate_up, down, topk_ids, topk_weights, weight_on_input, expert_map)
    if backend == "cpu":
        from locus.kernels.moe_cpu import fused_moe_cpu

        return fused_moe_cpu(x, gate_up, down, topk_ids, topk_weights, weight_on_input, expert_map)
    from locus.kernels.moe_triton import fused_moe_triton

    return fused_moe_triton(x, gate_up, down, topk_ids, topk_weights, weight_on_input, expert_map)


def resolve_backend(backend: str, device: torch.device) -> str:
    """The concrete backend ("torch", "triton" or "cpu") that `backend` means for tensors on `device`."""
    if backend not in MOE_BACKENDS:
        raise ValueError(f"unknown MoE backend {backend!r}; choose one of {MOE_BACKENDS}")
    if backend == "auto":
        if device.type == "cuda":
            return "triton"
        from locus.kernels.moe_cpu import available

        return "cpu" if device.type == "cpu" and available() else "torch"
    if backend == "cpu" and device.type != "cpu":
        raise ValueError(f"the cpu MoE backend runs on CPU tensors, not {device.type}")
    return backend
