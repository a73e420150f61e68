"""Moving to a new placement while serving (a live re-plan): align the new plan to the old one, then
fill the changed slots layer by layer, a few MoE layers per iteration, without stopping the engine.

Align. A planner numbers its ranks freely; within a node, which rank holds which set of experts does
not matter to anything the plan promises (node-level locality, the grouper's domain -> node map,
per-rank load caps are all the same under a relabelling). So for every MoE layer and node the new
ranks are matched to the old ones to keep the most experts where they are (every permutation for up
to 6 ranks a node, greedy beyond), and within a rank an expert it already holds keeps its slot.

Move. Every rank runs the same schedule (it received the same command in the same iteration): in each
iteration, before the step, the next `layers_per_step` MoE layers switch. For a layer, every changed slot
takes its expert's weights from a rank that holds it in the old placement (itself if it can, else a
rank of its node, else the first holder), all of them in one all_to_all of exactly the needed weights
over the control group, each expert as its bytes as held (narrow experts: elements then scales, so
one collective carries both; model/expert_rows.py); each rank stages what it receives, then copies
it into its existing tensors (so compiled graphs stay valid), and only then does the placement switch to the new
layer's slots: a new epoch. Tokens never reach a slot before its weights are there, because the
placement a step routes by is the one set before the step, on every rank alike.

Shape legend: S slots a rank, H hidden, I expert width.
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from locus.engine.ep.invariant import PlacementDisagreement
from locus.engine.model.expert_rows import expert_as_bytes, expert_nbytes, write_expert
from locus.routing.plan.placement import PlacementPlan, validate


def align(old: PlacementPlan, new: PlacementPlan) -> PlacementPlan:
    """`new` relabelled (ranks within a node, slots within a rank, per layer) to keep the most slots'
    experts where `old` has them. Raises if the two do not share a topology and layers."""
    if old.topology != new.topology or tuple(old.moe_layers) != tuple(new.moe_layers):
        raise ValueError(f"a re-plan must keep the topology and layers: {old.topology} / {new.topology}")
    G, N = old.topology.gpus_per_node, old.topology.nodes
    slots = np.array(new.slots, copy=True)
    for moe_index in range(len(old.moe_layers)):
        for node in range(N):
            ranks = list(range(node * G, (node + 1) * G))
            olds = [Counter(old.slots[moe_index][r].tolist()) for r in ranks]
            news = [Counter(new.slots[moe_index][r].tolist()) for r in ranks]
            match = _best_match(olds, news)  # match[i] = the new rank placed on old rank ranks[i]
            placed = [new.slots[moe_index][ranks[j]].tolist() for j in match]
            for i, r in enumerate(ranks):
                slots[moe_index][r] = _keep_slots(old.slots[moe_index][r].tolist(), placed[i])
    aligned = PlacementPlan(new.model, new.num_experts, tuple(new.moe_layers), new.topology, slots,
                            grouping=new.grouping, provenance=dict(new.provenance), dispatch=new.dispatch)
    validate(aligned)
    return aligned


def _best_match(olds: list[Counter], news: list[Counter]) -> list[int]:
    """A permutation p maximising sum_i |olds[i] & news[p[i]]| (multiset overlap)."""
    G = len(olds)
    overlap = [[sum((o & n).values()) for n in news] for o in olds]
    if G <= 6:
        return list(max(itertools.permutations(range(G)), key=lambda p: sum(overlap[i][p[i]] for i in range(G))))
    free, match = set(range(G)), [0] * G
    for i in sorted(range(G), key=lambda i: -max(overlap[i])):
        match[i] = max(free, key=lambda j: overlap[i][j])
        free.remove(match[i])
    return match


def _keep_slots(old: list[int], new: list[int]) -> list[int]:
    """`new`'s experts ordered so that each one `old` holds at a slot stays at that slot."""
    out: list[int | None] = [None] * len(old)
    rest = Counter(new)
    for j, e in enumerate(old):
        if rest[e] > 0:
            out[j] = e
            rest[e] -= 1
    remaining = list(rest.elements())
    for j in range(len(out)):
        if out[j] is None:
            out[j] = remaining.pop(0)
    return out


@dataclass(frozen=True)
class SlotFill:
    """One changed slot: rank `rank`'s slot `slot` of the MoE layer at `moe_index` (docs/design.md's MoE
    index: its position in moe_layers) takes expert `expert` from `source` (a rank holding it in the old
    placement) at `source_slot`."""

    moe_index: int
    rank: int
    slot: int
    expert: int
    source: int
    source_slot: int


def fills(old: PlacementPlan, new: PlacementPlan, moe_index: int) -> list[SlotFill]:
    """The changed slots of one MoE layer, and where each one's weights come from."""
    G = old.topology.gpus_per_node
    holders: dict[int, list[tuple[int, int]]] = {}
    for r, held in enumerate(old.slots[moe_index].tolist()):
        for j, e in enumerate(held):
            holders.setdefault(e, []).append((r, j))
    out = []
    for r, (was, now) in enumerate(zip(old.slots[moe_index].tolist(), new.slots[moe_index].tolist())):
        for j, (a, b) in enumerate(zip(was, now)):
            if a == b:
                continue
            found = holders[b]
            source = next((h for h in found if h[0] == r), None) or next(
                (h for h in found if h[0] // G == r // G), None) or found[0]
            out.append(SlotFill(moe_index, r, j, b, *source))
    return out


@dataclass
class MoveStats:
    """What one rank's slots received in a move."""

    experts: int = 0  # slots filled
    local: int = 0  # of which copied on the rank itself
    intra_node_bytes: int = 0  # expert weights sent to another rank of the same node
    inter_node_bytes: int = 0  # ... to a rank of another node
    layers: int = 0  # MoE layers switched


@dataclass
class PlacementMove:
    """The move from the current placement to `target` (aligned), `layers_per_step` MoE layers an iteration."""

    target: PlacementPlan
    layers_per_step: int = 1
    done_layers: int = 0  # MoE layers switched so far, in moe_layers order
    stats: MoveStats = field(default_factory=MoveStats)
    last_switched: range = range(0)  # the MoE indices the last advance switched (the runtime checks their weights)

    @property
    def finished(self) -> bool:
        return self.done_layers >= len(self.target.moe_layers)

    def advance(self, runtime) -> PlacementPlan:
        """Fill the slots of the next MoE layers (every rank calls this in the same iteration, through the
        placement state, which switches to the plan returned: a new epoch)."""
        stop = min(self.done_layers + self.layers_per_step, len(self.target.moe_layers))
        current = runtime.placement
        plan = current.plan
        if plan.topology != self.target.topology or tuple(plan.moe_layers) != tuple(self.target.moe_layers):
            raise PlacementDisagreement(f"a move to {self.target.topology} cannot apply to the placement held, "
                                        f"{plan.topology}")  # before any weight is overwritten
        for moe_index in range(self.done_layers, stop):
            self._fill_layer(runtime, plan, moe_index)
            slots = np.array(plan.slots, copy=True)
            slots[moe_index] = self.target.slots[moe_index]
            plan = PlacementPlan(plan.model, plan.num_experts, tuple(plan.moe_layers), plan.topology, slots,
                                 grouping=self.target.grouping, provenance=dict(self.target.provenance),
                                 dispatch=self.target.dispatch)
            self.stats.layers += 1
        self.last_switched = range(self.done_layers, stop)
        self.done_layers = stop
        return plan

    def _fill_layer(self, runtime, plan: PlacementPlan, moe_index: int) -> None:
        """Every changed slot of the MoE layer at `moe_index` gets its weights; one all_to_all over the
        control group."""
        rank, world = runtime.groups.rank, runtime.groups.world
        G = plan.topology.gpus_per_node
        layer = runtime.layers[moe_index]
        params = (layer.gate_up_proj, layer.down_proj)  # float Parameters or QuantizedTensors
        layer_fills = fills(plan, self.target, moe_index)
        per_expert = sum(expert_nbytes(p) for p in params)  # one expert's bytes as held (narrow: elements + scales)
        device = params[0].device
        # what this rank sends each other rank, in (destination, slot) order, and the local copies; an
        # expert travels as its bytes (expert_rows.py), so any dtype or narrow format crosses gloo alike
        sends: list[list[torch.Tensor]] = [[] for _ in range(world)]
        staged: dict[int, torch.Tensor] = {}  # slot -> [per_expert] bytes of the weights it will hold
        for f in layer_fills:
            if f.source == rank:
                flat = torch.cat([expert_as_bytes(p, f.source_slot) for p in params])
                if f.rank == rank:
                    staged[f.slot] = flat
                else:
                    sends[f.rank].append(flat)
        incoming = [f for f in layer_fills if f.rank == rank and f.source != rank]
        send_counts = [len(s) * per_expert for s in sends]
        recv_counts = [0] * world
        for f in incoming:
            recv_counts[f.source] += per_expert
        if any(f.source != f.rank for f in layer_fills):  # someone sends: every rank takes part
            out = torch.cat([t for s in sends for t in s]) if any(sends) else torch.empty(0, dtype=torch.uint8, device=device)
            buf = torch.empty(sum(recv_counts), dtype=torch.uint8, device=device)
            dist.all_to_all_single(buf, out.contiguous(), recv_counts, send_counts, group=runtime.groups.control)
            offsets = np.concatenate([[0], np.cumsum(recv_counts)])
            taken = [0] * world
            for f in sorted(incoming, key=lambda f: (f.source, f.slot)):
                at = int(offsets[f.source]) + taken[f.source] * per_expert
                staged[f.slot] = buf[at:at + per_expert]
                taken[f.source] += 1
        for slot, flat in staged.items():  # all reads are done: now overwrite
            at = 0
            for p in params:
                n = expert_nbytes(p)
                write_expert(p, slot, flat[at:at + n])
                at += n
        for f in layer_fills:
            if f.rank != rank:  # each rank counts the slots it filled: summed over ranks, every slot once
                continue
            self.stats.experts += 1
            if f.source == f.rank:
                self.stats.local += 1
            elif f.source // G == f.rank // G:
                self.stats.intra_node_bytes += per_expert
            else:
                self.stats.inter_node_bytes += per_expert


def move_bytes(old: PlacementPlan, new: PlacementPlan, expert_bytes: int) -> tuple[int, int, int]:
    """(slots to fill, intra-node bytes, inter-node bytes) of moving from `old` to `new` (aligned)."""
    G = old.topology.gpus_per_node
    count = intra = inter = 0
    for moe_index in range(len(old.moe_layers)):
        for f in fills(old, new, moe_index):
            count += 1
            if f.source != f.rank:
                if f.source // G == f.rank // G:
                    intra += expert_bytes
                else:
                    inter += expert_bytes
    return count, intra, inter
