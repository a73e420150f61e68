"""Surviving a lost rank (`--ep-elastic`): the survivors form a new process group, re-plan onto
themselves, and go on; the lost rank's requests are re-admitted on them from their prompt and the
tokens already streamed (rank 0's side: driver.py).

    a collective fails (a peer died: its connections closed; or it hung past --ep-timeout)
      -> every survivor leaves the old group at once (its own peers' collectives then fail too), and
         writes g<N>/alive/<old rank> into the rendezvous store (rank 0 hosts it)
      -> rank 0 waits `grace` seconds for the survivors, then writes g<N>/members (old ranks, in order)
         and g<N>/plan (the placement onto them); a survivor not listed leaves
      -> each member joins a new process group on the same store under the prefix g<N>/pg/, its rank
         its index in members, and makes the new groups
      -> re-plan onto the survivors: every expert keeps the slots it has on a survivor; an expert only
         the lost rank held takes a spare slot (a rank may grow to `max_slots` slots when the survivors
         have too few), its weights read from the checkpoint (or drawn from the preset's seed)
      -> a new placement epoch; the engines' requests are untouched (the failed step left no trace:
         sampling runs after every forward), so the next iteration re-runs it.

Topology after a loss: the survivors keep their nodes when every node keeps the same number of ranks;
otherwise each survivor is its own node (the two-tier exchange needs equal nodes), which counts every
peer as remote: conservative for the inter-node figures, and the same definition for replay.
"""

from __future__ import annotations

import gc
import json
import logging
import time
from collections import Counter
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from locus.errors import LocusError
from locus.routing.plan.placement import PlacementPlan, plan_from_dict, validate
from locus.routing.plan.topology import Topology

log = logging.getLogger("locus.engine")


class NotASurvivor(LocusError):
    """This rank registered too late: the others went on without it."""


def survivor_topology(old: Topology, survivors: list[int], slots: int) -> Topology:
    """The topology of the surviving old ranks (see the module doc)."""
    G = old.gpus_per_node
    per_node = Counter(r // G for r in survivors)
    counts = set(per_node.values())
    if len(counts) == 1:
        return Topology(len(per_node), counts.pop(), slots)
    return Topology(len(survivors), 1, slots)


def survivor_slots(num_experts: int, slots_per_gpu: int, survivors: int, max_slots: int) -> int:
    """The expert slots each of `survivors` ranks needs for every expert to keep one (at least the
    plan's own); LocusError when that is more than `max_slots`."""
    need = max(slots_per_gpu, -(-num_experts // survivors))
    if need > max_slots:
        raise LocusError(f"the {survivors} surviving ranks need {need} expert slots each to hold all {num_experts} "
                         f"experts, more than --ep-max-slots {max_slots}")
    return need


def plan_onto(plan: PlacementPlan, survivors: list[int], max_slots: int) -> PlacementPlan:
    """`plan` re-laid onto the surviving old ranks: each keeps its slots; experts no survivor holds
    take spare slots, replacing the most replicated experts first, then growing every rank's slot count
    (up to `max_slots`) when there is nothing left to replace."""
    E, L = plan.num_experts, len(plan.moe_layers)
    S = plan.topology.slots_per_gpu
    try:
        slots_per = survivor_slots(E, S, len(survivors), max_slots)
    except LocusError as exc:
        raise LocusError(f"{exc}; the server cannot continue") from None
    topology = survivor_topology(plan.topology, survivors, slots_per)
    table = np.full((L, len(survivors), slots_per), -1, dtype=np.int64)
    for row in range(L):
        held = [list(plan.slots[row][r]) + [-1] * (slots_per - S) for r in survivors]
        count = Counter(e for slots in held for e in slots if e >= 0)
        missing = [e for e in range(E) if count[e] == 0]
        for e in missing:
            # a free slot first; else the slot of the expert with the most replicas (never the last one)
            free = [(i, j) for i, slots in enumerate(held) for j, x in enumerate(slots) if x < 0]
            if free:
                i, j = min(free, key=lambda ij: (sum(x >= 0 for x in held[ij[0]]), ij))
            else:
                i, j = max(((i, j) for i, slots in enumerate(held) for j, x in enumerate(slots) if count[x] > 1),
                           key=lambda ij: (count[held[ij[0]][ij[1]]], -ij[0], -ij[1]))
                count[held[i][j]] -= 1
            held[i][j] = e
            count[e] += 1
        for i, slots in enumerate(held):  # a slot still free repeats the rank's first expert (a second copy)
            table[row, i] = [x if x >= 0 else slots[0] for x in slots]
    new = PlacementPlan(plan.model, E, tuple(plan.moe_layers), topology, table, grouping=None,
                        provenance={**plan.provenance, "planner": plan.provenance.get("planner", "round_robin"),
                                    "survivors_of": [int(r) for r in survivors]},
                        dispatch=plan.dispatch)
    validate(new)
    return new


def rendezvous_members(store, generation: int, rank: int, previous: list[int], grace: float, timeout: float,
                       is_alive=None) -> list[int]:
    """Register this rank (its identity) as alive; rank 0 decides who made it. Returns the members.

    Rank 0 waits for every previous member that is still alive (`is_alive(identity)`: the processes it
    started itself; a hung one counts as dead past `timeout`), or, without that knowledge, `grace`
    seconds."""
    prefix = f"locus/ep/g{generation}/"
    store.set(f"{prefix}alive/{rank}", "1")
    if rank == 0:
        deadline = time.monotonic() + (timeout if is_alive is not None else grace)
        while True:
            registered = [r for r in previous if r == 0 or store.check([f"{prefix}alive/{r}"])]
            waiting = [r for r in previous if r not in registered and (is_alive is None or is_alive(r))]
            if not waiting or time.monotonic() >= deadline:
                break
            time.sleep(0.02)
        store.set(f"{prefix}members", json.dumps(registered))
        return registered
    store.wait([f"{prefix}members"], timedelta(seconds=timeout))
    members = json.loads(store.get(f"{prefix}members"))
    if rank not in members:
        raise NotASurvivor(f"rank {rank} registered after the survivors of generation {generation} were decided")
    return members


def join_group(store, generation: int, members: list[int], rank: int, backend: str, timeout: timedelta) -> int:
    """Join the survivors' new process group (the old one was left before the rendezvous, regroup);
    returns the new rank."""
    new_rank = members.index(rank)
    dist.init_process_group(backend, store=dist.PrefixStore(f"locus/ep/g{generation}/pg/", store), rank=new_rank,
                            world_size=len(members), timeout=timeout)
    return new_rank


def refill_experts(runtime, new_plan: PlacementPlan, new_rank: int, read_experts) -> int:
    """Give every EP layer this rank's slots of `new_plan`: kept weights copied, the others read by
    `read_experts({moe layer: [expert, ...]}) -> {moe layer: (gate_up [n,H,2I], down [n,I,H])}`.
    Returns how many expert slots were read from the source."""
    old_local = runtime.placement.local_experts
    wanted: dict[int, list[int]] = {}
    rows = []
    for row, layer in enumerate(runtime.layers):
        new_ids = [int(e) for e in new_plan.slots[row][new_rank]]
        have = {e: j for j, e in enumerate(old_local[row])}
        missing = sorted({e for e in new_ids if e not in have})
        if missing:
            wanted[int(new_plan.moe_layers[row])] = missing
        rows.append((layer, new_ids, have, missing))
    fetched = read_experts(wanted) if wanted else {}
    read = 0
    with torch.no_grad():
        for (layer, new_ids, have, missing), moe_layer in zip(rows, new_plan.moe_layers):
            up, down = fetched.get(int(moe_layer), (None, None))
            ups, downs = [], []
            for e in new_ids:
                if e in have:
                    ups.append(layer.gate_up_proj[have[e]].clone())
                    downs.append(layer.down_proj[have[e]].clone())
                else:
                    k = missing.index(e)
                    ups.append(up[k].to(layer.gate_up_proj.dtype))
                    downs.append(down[k].to(layer.down_proj.dtype))
                    read += 1
            layer.gate_up_proj = nn.Parameter(torch.stack(ups), requires_grad=False)
            layer.down_proj = nn.Parameter(torch.stack(downs), requires_grad=False)
    return read


def new_plan_of(store, generation: int, rank: int, compute, timeout: float) -> PlacementPlan:
    """Rank 0 computes the survivors' plan and publishes it; the others read it."""
    key = f"locus/ep/g{generation}/plan"
    if rank == 0:
        plan = compute()
        store.set(key, plan.to_json())
        return plan
    store.wait([key], timedelta(seconds=timeout))
    return plan_from_dict(json.loads(store.get(key)))


@dataclass
class ElasticOptions:
    store: object  # the rendezvous store (rank 0 hosts it): outlives every process group
    backend: str
    read_experts: object  # {moe layer: [experts]} -> {moe layer: (gate_up, down)}
    max_slots: int  # a survivor's expert slots, at most
    lanes: int = 1  # process-group lanes (2 with --ep-overlap)
    is_alive: object = None  # rank 0: identity -> is that process still running (the ranks it started)
    grace_s: float = 1.5  # without is_alive: how long rank 0 waits for survivors to register


def expert_reader(model: str | None, dtype, device, moe_backend: str, seed: int):
    """Reads given experts' weights from the model's source (checkpoint slices, or the preset's seed)."""
    from locus.engine.checkpoint.loader import load
    from locus.engine.ep.slices import moe_experts

    def read(wanted: dict[int, list[int]]) -> dict[int, tuple]:
        slices = {layer: wanted.get(layer, []) for layer in loaded_layers()}
        source = load(model, dtype, device, moe_backend, seed, expert_slices=slices).model
        return {layer: (e.gate_up_proj.detach(), e.down_proj.detach()) for layer, e in moe_experts(source).items()
                if layer in wanted}

    def loaded_layers():
        from locus.engine.checkpoint.loader import config_of

        return list(config_of(model).moe_layers)

    return read


def leave_groups(worker) -> timedelta:
    """Leave every old process group, for good: drop this rank's every reference to them and destroy
    them, so their connections close and a peer blocked in a collective or a point-to-point send with
    this rank fails at once instead of at the timeout (a send only completes once its peer posts the
    receive; a survivor that left never will). Nothing else may hold a group (no cache keyed by one).
    Returns the groups' timeout."""
    runtime = worker.runtime
    timeout = runtime.groups.timeout
    runtime.groups, runtime.lanes, worker.control = None, [], None
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a broken group may refuse a clean teardown
            pass
    gc.collect()
    return timeout


def regroup(worker) -> dict[int, int]:
    """After a failed collective, on every survivor: leave the old group, meet the survivors, join their
    new group, re-plan onto them and refill this rank's expert slots. Returns {old rank: new rank}."""
    from locus.engine.ep.control import ControlPlane
    from locus.engine.ep.groups import make_groups
    from locus.engine.ep.placement import ExpertPlacement
    from locus.engine.ep.slices import expert_memory

    opts, runtime = worker.elastic, worker.runtime
    loop_nice = runtime.groups.loop_nice
    timeout = leave_groups(worker)
    generation = worker.generation + 1
    members = rendezvous_members(opts.store, generation, worker.identity, worker.members, opts.grace_s,
                                 timeout.total_seconds(), opts.is_alive)
    old_rank_of = {identity: worker.members.index(identity) for identity in members}
    new_rank = join_group(opts.store, generation, members, worker.identity, opts.backend, timeout)
    current = runtime.placement
    survivors = [old_rank_of[i] for i in members]
    plan = new_plan_of(opts.store, generation, new_rank, lambda: plan_onto(current.plan, survivors, opts.max_slots),
                       timeout.total_seconds())
    topo = plan.topology
    groups = make_groups(topo.nodes, topo.gpus_per_node, opts.lanes, timeout, loop_nice)
    read = refill_experts(runtime, plan, new_rank, opts.read_experts)
    device = current.start.device
    runtime.regroup(groups, ExpertPlacement.build(plan, new_rank, current.epoch + 1, device), device)
    if runtime.memory is not None:
        runtime.memory = expert_memory(worker.core.model)
        worker.expert_bytes = runtime.memory.held_bytes
    worker.control = ControlPlane(groups.control, new_rank, len(members))
    worker.rank, worker.world, worker.members, worker.generation = new_rank, len(members), members, generation
    log.warning("generation %d: rank %d (was %d) of %d survivors %s, topology %s, %d expert slots read from the "
                "model", generation, new_rank, old_rank_of[worker.identity], len(members), members, topo, read)
    return {old_rank_of[i]: k for k, i in enumerate(members)}
