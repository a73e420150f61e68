"""Routed experts with quantized weights: the layout, and the torch reference every kernel matches.

Expert weights keep their float layout, gate_up [E, H, 2I] and down [E, I, H], each read as
[E, K, N] with K the contraction dimension; a quantized one is a `QuantizedTensor` (formats.py) with
its scales shared along K (axis 1):
    format   data                     scale
    fp8      E4M3 [E, K, N]           float32 [E, 1, N]           one per output channel (FBGEMM's rows)
    mxfp8    E4M3 [E, K, N]           E8M0 [E, ceil(K/32), N]     per 32 consecutive k of one column
    mxfp4    E2M1 [E, ceil(K/2), N]   E8M0 [E, ceil(K/32), N]     two k a byte, the even one low
The block axis is the contraction axis, so a block of 32 products shares one scale (what MX dot
products and block-scaled tensor cores need); N is the contiguous dimension, as in the float layout,
so a kernel's column loads do not change shape.

Semantics (what the kernels must compute): each weight is `element * scale` in float32, exactly (for
the MX formats every such product is a float32), rounded to x's dtype, then the unquantized
fused_moe_reference. Only the experts some pair uses are dequantized.

The Triton kernels' "fp8" dot form (moe_narrow.py) computes something else on purpose: W8A8, the
activations quantized to E4M3 per row as well; `fused_moe_w8a8_reference` is that form's reference.

Shape legend: T tokens, K slots, E experts held here, H hidden, I expert width.
"""

from __future__ import annotations

import torch

from locus.kernels.formats import QuantizedTensor, quantize
from locus.kernels.moe_reference import fused_moe_reference

EXPERT_FORMATS = ("fp8", "mxfp8", "mxfp4")


def quantize_experts(gate_up: torch.Tensor, down: torch.Tensor, fmt: str) -> tuple[QuantizedTensor, QuantizedTensor]:
    """gate_up [E, H, 2I] and down [E, I, H] in `fmt`, scales along the contraction dimension."""
    if fmt not in EXPERT_FORMATS:
        raise ValueError(f"unknown expert weight format {fmt!r}; choose one of {', '.join(EXPERT_FORMATS)}")
    with torch.no_grad():
        return quantize(gate_up.detach(), fmt, axis=1), quantize(down.detach(), fmt, axis=1)


def is_quantized(weight) -> bool:
    return isinstance(weight, QuantizedTensor)


def check_expert_weights(gate_up: QuantizedTensor, down: QuantizedTensor) -> None:
    """ValueError unless both are expert weights of one format in the layout above."""
    for name, q in (("gate_up", gate_up), ("down", down)):
        if not isinstance(q, QuantizedTensor):
            raise ValueError(f"{name} is a plain tensor while the other expert weight is quantized")
        if q.format not in EXPERT_FORMATS or q.dim() != 3 or q.axis != 1:
            raise ValueError(f"{name}: a quantized expert weight is [E, K, N] in {', '.join(EXPERT_FORMATS)} with "
                             f"scales along axis 1 (got {q.format}, shape {q.shape}, axis {q.axis})")
    if gate_up.format != down.format:
        raise ValueError(f"gate_up is {gate_up.format} but down is {down.format}")


def local_ids(topk_ids: torch.Tensor, expert_map: torch.Tensor | None) -> torch.Tensor:
    """Expert ids (int64) mapped from global to this rank's local ids; -1 (not held) stays -1."""
    ids = topk_ids.long()
    if expert_map is None:
        return ids
    return torch.where(ids >= 0, expert_map.to(ids.device).long()[ids.clamp(min=0)], ids)


def fused_moe_quantized_reference(
    x: torch.Tensor,
    gate_up: QuantizedTensor,
    down: QuantizedTensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    weight_on_input: bool = True,
    expert_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """Routed-expert output [T, H] in x's dtype: dequantize the experts in use, then fused_moe_reference."""
    check_expert_weights(gate_up, down)
    E = gate_up.shape[0]
    ids = local_ids(topk_ids, expert_map)
    if bool(((ids < -1) | (ids >= E)).any()):
        raise ValueError(f"topk_ids hold an expert id outside the {E} experts held here")
    used = torch.unique(ids[ids >= 0])  # sorted local ids
    compact = torch.full((E,), -1, dtype=torch.long, device=ids.device)
    compact[used] = torch.arange(used.numel(), device=ids.device)
    ids = torch.where(ids >= 0, compact[ids.clamp(min=0)], ids)
    if used.numel() == 0:
        return torch.zeros_like(x)
    gu, dn = gate_up[used].dequantize(x.dtype), down[used].dequantize(x.dtype)
    return fused_moe_reference(x, gu, dn, ids, topk_weights, weight_on_input, None)


def fused_moe_w8a8_reference(
    x: torch.Tensor,
    gate_up: QuantizedTensor,
    down: QuantizedTensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    weight_on_input: bool = True,
    expert_map: torch.Tensor | None = None,
) -> torch.Tensor:
    """What the "fp8" dot form computes for row-wise fp8 weights: x quantized to E4M3 per token and
    h = silu(g) * u (rounded to x's dtype) per pair, each with its own float32 scale, products in
    float32, the routing weight scaling the gate_up product (weight on the input) or the output."""
    check_expert_weights(gate_up, down)
    if gate_up.format != "fp8":
        raise ValueError(f"W8A8 is the fp8 dot form of row-wise fp8 weights, not {gate_up.format}")
    T, K = topk_ids.shape
    ids = local_ids(topk_ids, expert_map).reshape(-1)
    weights = topk_weights.reshape(-1).float()
    xq = quantize(x, "fp8", axis=1).dequantize()  # [T, H] float32
    out = torch.zeros(T, x.shape[1], dtype=torch.float32, device=x.device)
    for e in torch.unique(ids[ids >= 0]).tolist():
        pairs = (ids == e).nonzero().flatten()
        gu = xq[pairs // K] @ gate_up[e].dequantize()
        if weight_on_input:
            gu = gu * weights[pairs, None]
        gate, up = gu.chunk(2, dim=-1)
        h = (torch.nn.functional.silu(gate) * up).to(x.dtype)
        y = quantize(h, "fp8", axis=1).dequantize() @ down[e].dequantize()
        if not weight_on_input:
            y = y * weights[pairs, None]
        out.index_add_(0, pairs // K, y)
    return out.to(x.dtype)
