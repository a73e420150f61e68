"""Which experts one expert-parallel rank holds, and building a model that holds only those.

A rank keeps, for each MoE layer, the experts of its slots in slot order (`plan.layers[l].slots[r]`;
one expert may fill two slots). The loaders (checkpoint and preset) take these slices *before* any
expert tensor is materialised, so a rank never holds, or reads, another rank's experts: a checkpoint
is read through safetensors slices, a preset draws each full tensor from the seed one at a time and
keeps its rows (same weights as the whole model, anywhere).

Shape legend: E experts, S slots of this rank, H hidden, I expert width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from locus.engine.model.expert_rows import expert_nbytes, weight_nbytes
from locus.engine.model.model import Llama4ForCausalLM
from locus.routing.plan.placement import PlacementPlan

ExpertSlices = dict[int, list[int]]  # MoE layer index -> the expert id of each local slot, in slot order


def slices_of(plan: PlacementPlan, rank: int) -> ExpertSlices:
    return {int(layer): [int(e) for e in plan.slots[row][rank]] for row, layer in enumerate(plan.moe_layers)}


def keep_slices(model: Llama4ForCausalLM, slices: ExpertSlices) -> None:
    """Give each MoE layer's `Experts` only the rows of `slices` ([S, H, 2I], [S, I, H]), on the
    model's current device (meta before loading: nothing is allocated here)."""
    for layer, experts in moe_experts(model).items():
        if layer not in slices:
            raise ValueError(f"no expert slice for MoE layer {layer}")
        ids = slices[layer]
        device = experts.gate_up_proj.device
        for name in ("gate_up_proj", "down_proj"):
            full = getattr(experts, name)
            setattr(experts, name, nn.Parameter(torch.empty(len(ids), *full.shape[1:], dtype=full.dtype, device=device),
                                                requires_grad=False))
        experts.expert_ids = list(ids)


def moe_experts(model: Llama4ForCausalLM) -> dict[int, nn.Module]:
    """MoE layer index -> its `Experts` module."""
    return {int(layer): model.model.layers[layer].feed_forward.experts for layer in model.config.moe_layers}


@dataclass
class ExpertMemory:
    """What a rank's expert weights take, against the whole model's."""

    held_bytes: int
    full_bytes: int  # every expert of every MoE layer once, in the same dtype or narrow format
    slots: int  # summed over MoE layers

    def describe(self) -> str:
        mib = 1 << 20
        return (f"{self.slots} expert slots over the MoE layers, {self.held_bytes / mib:.1f} MiB of expert weights "
                f"({self.held_bytes / max(1, self.full_bytes):.0%} of the whole model's {self.full_bytes / mib:.1f} MiB)")


def expert_memory(model: Llama4ForCausalLM) -> ExpertMemory:
    """Measured from the parameters the model holds now (after loading, or after expert parallelism
    was applied)."""
    config = model.config
    held = full = slots = 0
    for layer in config.moe_layers:
        ff = model.model.layers[layer].feed_forward
        params = (ff.gate_up_proj, ff.down_proj) if hasattr(ff, "gate_up_proj") else (ff.experts.gate_up_proj, ff.experts.down_proj)
        held += sum(weight_nbytes(p) for p in params)  # narrow experts: elements and scales (expert_rows.py)
        full += sum(expert_nbytes(p) * config.num_local_experts for p in params)
        slots += params[0].shape[0]
    return ExpertMemory(held, full, slots)
