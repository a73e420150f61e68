"""Expert kernels: Triton fused-MoE and the torch references beside them. Imports nothing of ours.

`fused_moe` is the one entry point the model calls; `backend` picks the implementation.
"""

from __future__ import annotations

import torch

from locus.kernels.moe_reference import fused_moe_reference

MOE_BACKENDS = ("torch", "triton")


def fused_moe(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    weight_on_input: bool = True,
    expert_map: torch.Tensor | None = None,
    backend: str = "torch",
) -> torch.Tensor:
    """Routed-expert output [T, H] for x [T, H]; see moe_reference for the math and shapes."""
    if backend == "torch":
        return fused_moe_reference(x, gate_up, down, topk_ids, topk_weights, weight_on_input, expert_map)
    raise ValueError(f"unknown MoE backend {backend!r}; choose one of {MOE_BACKENDS}")
