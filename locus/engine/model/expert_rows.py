"""One expert's weights as a layer holds them, float or narrow: its bytes, read and written a row
(an expert) at a time.

A layer's routed experts are [E, K, N] float Parameters or QuantizedTensors (kernels/formats.py:
elements [E, K', N] and scales [E, K'', N], both indexed by expert on their first dimension). What
moves an expert between ranks (a live re-plan's slot fills, elastic recovery's refill) and what
counts or fingerprints it must take both parts of a narrow one, in its narrow bytes: an expert row
is its elements' bytes followed by its scales' bytes, one flat uint8 tensor, so that one collective
carries a slot's elements and scales together.

Shape legend: E experts held, K contraction, N output.
"""

from __future__ import annotations

import torch
from torch import nn

from locus.kernels.formats import QuantizedTensor

ExpertWeight = torch.Tensor | QuantizedTensor  # [E, K, N]


def parts(weight: ExpertWeight) -> list[torch.Tensor]:
    """The plain tensors that hold `weight`: itself, or a narrow one's elements and scales."""
    if isinstance(weight, QuantizedTensor):
        return [weight.data, weight.scale]
    return [weight.detach()]


def weight_nbytes(weight: ExpertWeight) -> int:
    """Bytes `weight` holds (every expert in it), scales included."""
    return sum(t.numel() * t.element_size() for t in parts(weight))


def expert_nbytes(weight: ExpertWeight) -> int:
    """Bytes of one expert of `weight` (its first), scales included: what moving one expert moves."""
    return sum(t[0].numel() * t.element_size() for t in parts(weight))


def expert_as_bytes(weight: ExpertWeight, j: int) -> torch.Tensor:
    """Expert `j` of `weight` as one flat uint8 tensor [expert_nbytes]: elements, then scales (a copy)."""
    return torch.cat([t[j].contiguous().view(torch.uint8).reshape(-1) for t in parts(weight)])


def write_expert(weight: ExpertWeight, j: int, flat: torch.Tensor) -> None:
    """Overwrite expert `j` of `weight` in place (the tensors stay the same objects, so a compiled
    graph that holds them stays valid) with `flat`, bytes as expert_as_bytes gives them."""
    at = 0
    with torch.no_grad():
        for t in parts(weight):
            row = t[j].view(torch.uint8).reshape(-1)  # a view of the held row (rows are contiguous)
            row.copy_(flat[at:at + row.numel()])
            at += row.numel()
    if at != flat.numel():
        raise ValueError(f"an expert of this layer is {at} bytes, {flat.numel()} arrived")


def select_experts(weight: ExpertWeight, index: torch.Tensor) -> ExpertWeight:
    """The experts `index` of `weight`, stacked in that order (a copy): a Parameter for float weights,
    a QuantizedTensor (a plain attribute, never widened by the model's .to(dtype)) for narrow ones."""
    if isinstance(weight, QuantizedTensor):
        return weight[index].clone()
    return nn.Parameter(weight.detach()[index].clone(), requires_grad=False)


def stack_experts(rows: list[ExpertWeight], like: ExpertWeight) -> ExpertWeight:
    """Expert rows ([K, N] each, as `like[j]` gives them) stacked into a layer's weight [len(rows), K, N],
    in `like`'s form: float rows in its dtype, narrow ones in its format (a row of another format, or a
    float row for narrow weights, is refused: the rank would hold what no other rank holds)."""
    if not isinstance(like, QuantizedTensor):
        if any(isinstance(r, QuantizedTensor) for r in rows):
            raise ValueError("a narrow expert row for a layer holding float experts")
        return nn.Parameter(torch.stack([r.to(like.dtype) for r in rows]), requires_grad=False)
    for r in rows:
        if not isinstance(r, QuantizedTensor) or r.format != like.format or r.axis != like.axis - 1:
            got = r.format if isinstance(r, QuantizedTensor) else f"float {r.dtype}"
            raise ValueError(f"an expert row in {got} for a layer holding {like.format} experts")
    data, scale = torch.stack([r.data for r in rows]), torch.stack([r.scale for r in rows])
    return QuantizedTensor(data, scale, like.format, (len(rows), *like.shape[1:]), like.axis)
