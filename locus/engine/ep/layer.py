"""Expert parallelism applied to a built model from outside (as gpt-fast's `apply_tp` does for
tensor parallelism): each MoE block's expert call becomes route -> dispatch rule -> two-tier
dispatch -> local fused MoE over local slots -> combine. The model's code does not change, and a
model without `apply_expert_parallel` runs exactly as before.

Rank r keeps only the experts of its slots in the placement, stacked in slot order as
[S, H, 2I] / [S, I, H] (a rank may hold one expert in two slots). Attention, norms, the router, the
shared expert and the dense layers stay whole on every rank (data-parallel attention). A layer reads
the runtime's placement when it is called, never a copy of it.

The dispatch rule's tie-break needs each token's position in its request: a forward pre-hook on
the model takes them from the batch, once per forward, for the lane running it.

Shape legend: T tokens, K experts per token, H hidden, I expert width, S slots per rank.
"""

from __future__ import annotations

import itertools
import weakref

import torch
from torch import nn

from locus.engine.ep.groups import Groups
from locus.engine.ep.placement import ExpertPlacement
from locus.engine.ep.runtime import EPRuntime
from locus.engine.model.expert_rows import select_experts
from locus.engine.model.slices import slices_of
from locus.engine.model.model import Llama4ForCausalLM
from locus.engine.model.moe import RoutedMoE
from locus.kernels import fused_moe
from locus.routing.gate import TopK
from locus.routing.plan.placement import PlacementPlan


class ExpertParallelMoE(nn.Module):
    def __init__(self, block: RoutedMoE, moe_index: int, slot_experts: list[int], runtime: EPRuntime):
        super().__init__()
        self.top_k, self.moe_backend = block.top_k, block.moe_backend
        self.router, self.shared_expert = block.router, block.shared_expert  # shared_expert: None in some families
        self.rule, self.weight_on_input = block.rule, block.weight_on_input  # the family's routing (model/moe.py)
        experts = block.experts
        if experts.expert_ids is not None:  # loaded as this rank's slice (slices.py): take it as is
            if list(experts.expert_ids) != list(slot_experts):
                raise ValueError(f"MoE index {moe_index}: the model holds experts {experts.expert_ids}, "
                                 f"the plan gives this rank {slot_experts}")
            self.gate_up_proj, self.down_proj = experts.gate_up_proj, experts.down_proj
        else:  # a whole model: keep the local slots' experts, in slot order; the full tensors are dropped
            index = torch.tensor(slot_experts, dtype=torch.long)  # narrow experts stay narrow (expert_rows.py)
            self.gate_up_proj = select_experts(experts.gate_up_proj, index)
            self.down_proj = select_experts(experts.down_proj, index)
        self.moe_index = moe_index  # this layer's MoE index: its position in moe_layers, the placement's first axis
        self.runtime = runtime
        self.handle = next(_handles)  # how the compiled graph's opaque op finds this layer
        _LAYERS[self.handle] = self

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, TopK]:
        topk = self.rule(self.router(x))
        positions = self.runtime.positions
        if positions is None or positions.shape[0] != x.shape[0]:
            raise RuntimeError("the EP runtime must hold the batch's token positions before the forward")
        if torch.compiler.is_compiling() or self.runtime.padded:
            # compiled: the exchange is host work and collectives, one opaque op; padded (a decode
            # graph's batch): the op also keeps padding tokens out of the exchange
            routed = ep_routed_experts(x, topk.ids, topk.weights, positions, self.handle)
        else:
            routed = self.route_and_exchange(x, topk.ids, topk.weights, positions)
        return (routed if self.shared_expert is None else self.shared_expert(x) + routed), topk

    def route_and_exchange(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                           positions: torch.Tensor) -> torch.Tensor:
        """The dispatch rule, then dispatch -> local experts -> combine: the routed output [T, H]."""
        runtime = self.runtime
        placement = runtime.placement
        slots = placement.route(self.moe_index, ids, positions)
        return runtime.lane().run(x, slots, weights.to(x.dtype), placement.slots_per_gpu, self._compute,
                                  runtime.capacity)

    def exchange_nothing(self) -> None:
        H = self.router.in_features
        dtype, device = self.router.weight.dtype, self.router.weight.device
        self.runtime.lane().run(torch.empty(0, H, dtype=dtype, device=device),
                                torch.empty(0, self.top_k, dtype=torch.long, device=device),
                                torch.empty(0, self.top_k, dtype=dtype, device=device),
                                self.runtime.placement.slots_per_gpu, self._compute, self.runtime.capacity)

    def _compute(self, x: torch.Tensor, local_slots: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        return fused_moe(x, self.gate_up_proj, self.down_proj, local_slots, weights,
                         weight_on_input=self.weight_on_input, backend=self.moe_backend)


# Layers by handle, for the custom op below (an op's arguments are tensors and scalars, not modules).
# Held weakly: a model that is dropped takes its layers with it.
_LAYERS: weakref.WeakValueDictionary[int, ExpertParallelMoE] = weakref.WeakValueDictionary()
_handles = itertools.count()


@torch.library.custom_op("locus::ep_routed_experts", mutates_args=())
def ep_routed_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, positions: torch.Tensor,
                      handle: int) -> torch.Tensor:
    """The routed output of layer `handle` inside a compiled decode graph (decode_graph.py). Tokens at
    position -1 are the graph's padding: they are not sent anywhere (so the exchange's bytes stay
    those of the real tokens) and their routed output is zero."""
    layer = _LAYERS[handle]
    real = positions >= 0
    if bool(real.all()):
        return layer.route_and_exchange(x, ids, weights, positions)
    out = torch.zeros_like(x)
    out[real] = layer.route_and_exchange(x[real], ids[real], weights[real], positions[real])
    return out


@ep_routed_experts.register_fake
def _(x, ids, weights, positions, handle) -> torch.Tensor:
    return torch.empty_like(x)


def apply_expert_parallel(model: Llama4ForCausalLM, plan: PlacementPlan, groups: Groups, mode: str = "exact",
                          max_tokens_per_rank: int = 256, epoch: int = 0, dispatch_format: str = "model",
                          combine_format: str = "model") -> EPRuntime:
    """Swap every MoE block of `model` for its expert-parallel form on this rank; returns the runtime
    whose placement the layers read and whose exchanges count the bytes. dispatch_format /
    combine_format: how the exchanged rows travel (payload.py; "model": the model's dtype)."""
    topo = plan.topology  # the plan fits the model: checked where it entered (ranks/launch.py, load_rank)
    if (topo.nodes, topo.gpus_per_node) != (groups.nodes, groups.gpus_per_node):
        raise ValueError(f"the plan's topology {topo.nodes}x{topo.gpus_per_node} is not the process groups' "
                         f"{groups.nodes}x{groups.gpus_per_node}")
    placement = ExpertPlacement.build(plan, groups.rank, epoch, model.device)
    runtime = EPRuntime(groups, placement, mode, max_tokens_per_rank, model.device, dispatch_format, combine_format)
    moe_index_of = {int(layer): i for i, layer in enumerate(plan.moe_layers)}
    slices = slices_of(plan, groups.rank)  # what the loaders kept, if they sliced
    for layer in sorted(moe_index_of):  # forward order, which idle() follows
        decoder = model.model.layers[layer]
        decoder.feed_forward = ExpertParallelMoE(decoder.feed_forward, moe_index_of[layer], slices[layer], runtime)
        runtime.layers.append(decoder.feed_forward)

    def take_positions(module, args, kwargs):  # the dispatch rule's tie-break needs them
        batch = args[0] if args else kwargs["batch"]
        runtime.positions = batch.positions
        runtime.padded = getattr(batch, "padded", False)  # a decode graph's batch (position -1 = padding)

    model.register_forward_pre_hook(take_positions, with_kwargs=True)
    model.expert_parallel = runtime  # what the engine reads to know (decode graphs are not captured)
    return runtime
