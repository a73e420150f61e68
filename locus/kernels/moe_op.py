"""`locus::fused_moe`: the fused-MoE call as a torch custom op, for compiled graphs.

torch.compile cannot trace the expert computation into a static graph: how many rows each expert
gets is known only at run time (the torch path sorts and counts them on the host, the Triton path
sizes its grid from them). As a custom op the call is one opaque node: the graph around it (norms,
attention, router, shared expert) compiles, and the op runs the same eager code as `fused_moe`.
The fake implementation tells the compiler only the output's shape and dtype: x's.
"""

from __future__ import annotations

import torch

from locus.kernels.backends import run_fused_moe
from locus.kernels.formats import QuantizedTensor


@torch.library.custom_op("locus::fused_moe", mutates_args=())
def fused_moe_op(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    weight_on_input: bool,
    expert_map: torch.Tensor | None,
    backend: str,
) -> torch.Tensor:
    return run_fused_moe(x, gate_up, down, topk_ids, topk_weights, weight_on_input, expert_map, backend)


@fused_moe_op.register_fake
def _(x, gate_up, down, topk_ids, topk_weights, weight_on_input, expert_map, backend) -> torch.Tensor:
    return torch.empty_like(x)


@torch.library.custom_op("locus::fused_moe_quantized", mutates_args=())
def fused_moe_quantized_op(
    x: torch.Tensor,
    gate_up_data: torch.Tensor,
    gate_up_scale: torch.Tensor,
    down_data: torch.Tensor,
    down_scale: torch.Tensor,
    weight_format: str,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    weight_on_input: bool,
    expert_map: torch.Tensor | None,
    backend: str,
) -> torch.Tensor:
    """`locus::fused_moe` with quantized expert weights (moe_quantized.py), passed as their tensors:
    an op's arguments are tensors and scalars. The logical shapes follow from x and the data:
    gate_up [E, H, 2I], down [E, I, H]."""
    E, H, two_i = gate_up_data.shape[0], x.shape[1], gate_up_data.shape[2]
    gate_up = QuantizedTensor(gate_up_data, gate_up_scale, weight_format, (E, H, two_i), 1)
    down = QuantizedTensor(down_data, down_scale, weight_format, (E, two_i // 2, H), 1)
    return run_fused_moe(x, gate_up, down, topk_ids, topk_weights, weight_on_input, expert_map, backend)


@fused_moe_quantized_op.register_fake
def _(x, gate_up_data, gate_up_scale, down_data, down_scale, weight_format, topk_ids, topk_weights, weight_on_input,
      expert_map, backend) -> torch.Tensor:
    return torch.empty_like(x)
