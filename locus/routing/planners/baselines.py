"""Baseline placement planners every evaluation reports: `round_robin` and `eplb`.

Shape legend: L MoE layers, E experts, R ranks (GPUs), S slots per GPU, P = R * S physical slots.
    loads  [L, E]  tokens routed to each expert in each layer (e.g. counted on a trace)

eplb follows DeepSeek's EPLB algorithm (github.com/deepseek-ai/EPLB), reimplemented in numpy:
  1. replicate: start with one replica per expert, then repeatedly give one more replica to the expert
     whose load per replica is the largest, until all slots are used;
  2. pack: sort replicas by load per replica, heaviest first, and put each on the lightest GPU that still
     has a free slot (so every GPU ends up with exactly S replicas).
Hierarchical variant, used when the model's experts form `groups` groups and the node count divides
`groups` (DeepSeek-V3: 8 groups of 32 experts): first pack whole groups onto nodes by group load (equal
group counts per node), then replicate and pack within each node over that node's slots, so that
group-limited routing keeps most of a token's experts on few nodes. Otherwise the policy is global
(one node of R GPUs). Ties go to the lowest expert / GPU index, which keeps plans deterministic.
"""

from __future__ import annotations

import datetime

import numpy as np

from locus.errors import LocusError
from locus.routing.plan.placement import PlacementPlan
from locus.routing.plan.topology import Topology


def round_robin(num_experts: int, moe_layers, topology: Topology, model: str = "") -> PlacementPlan:
    """Physical slot p holds expert p % E and is dealt to rank p % R (slot 0 to rank 0, slot 1 to rank 1,
    ..., slot R to rank 0 again), so rank r holds experts (r + j * R) % E for j = 0 .. S - 1.

    The same placement serves every layer; the loads are not consulted.
    """
    topology.check_fits(num_experts)
    R, S = topology.ranks, topology.slots_per_gpu
    p = np.arange(S)[None, :] * R + np.arange(R)[:, None]  # [R, S]: slot index of rank r's j-th slot
    layer = p % num_experts
    slots = np.broadcast_to(layer, (len(moe_layers), R, S)).copy()
    return _plan(slots, num_experts, moe_layers, topology, model, "round_robin")


def eplb(loads, moe_layers, topology: Topology, groups: int | None = None, model: str = "") -> PlacementPlan:
    """DeepSeek-EPLB-equivalent placement balancing `loads` [L, E] (see the module docstring)."""
    loads = np.asarray(loads, dtype=np.float64)
    if loads.ndim != 2 or loads.shape[0] != len(moe_layers):
        raise LocusError(f"eplb: loads must be [{len(moe_layers)} layers, experts], got shape {loads.shape}")
    if (loads < 0).any():
        raise LocusError("eplb: loads must be non-negative")
    L, E = loads.shape
    topology.check_fits(E)
    nodes, G, S = topology.nodes, topology.gpus_per_node, topology.slots_per_gpu
    hierarchical = groups is not None and groups % nodes == 0 and E % groups == 0
    if hierarchical:
        slots = _eplb_hierarchical(loads, groups, nodes, G, S)
        policy = f"hierarchical over {groups} groups"
    else:
        slots = _place_on_node(loads, np.arange(E)[None, :].repeat(L, 0), topology.ranks, S)
        policy = "global"
    plan = _plan(slots, E, moe_layers, topology, model, "eplb")
    plan.provenance["policy"] = policy
    return plan


def _eplb_hierarchical(loads: np.ndarray, groups: int, nodes: int, G: int, S: int) -> np.ndarray:
    L, E = loads.shape
    size = E // groups
    group_loads = loads.reshape(L, groups, size).sum(-1)  # [L, groups]
    node_of_group, _ = balanced_pack(group_loads, nodes)  # [L, groups]
    slots = np.empty((L, nodes * G, S), dtype=np.int64)
    for n in range(nodes):
        # [L, E / nodes]: the experts of the groups node n received, group by group.
        mine = np.stack([np.flatnonzero(np.repeat(node_of_group[l] == n, size)) for l in range(L)])
        slots[:, n * G : (n + 1) * G] = _place_on_node(np.take_along_axis(loads, mine, 1), mine, G, S)
    return slots


def _place_on_node(loads: np.ndarray, experts: np.ndarray, gpus: int, S: int) -> np.ndarray:
    """Replicate the experts (ids `experts` [L, X], loads [L, X]) over gpus * S slots and pack the
    replicas onto `gpus` GPUs; returns the expert ids per GPU, [L, gpus, S]."""
    L = loads.shape[0]
    owner, copies = replicate(loads, gpus * S)  # owner [L, gpus * S] indexes the X experts
    per_replica = np.take_along_axis(loads / copies, owner, 1)
    gpu, place = balanced_pack(per_replica, gpus)
    out = np.empty((L, gpus, S), dtype=np.int64)
    layer = np.arange(L)[:, None]
    out[layer, gpu, place] = np.take_along_axis(experts, owner, 1)
    return out


def replicate(loads: np.ndarray, num_slots: int) -> tuple[np.ndarray, np.ndarray]:
    """Spread X experts over num_slots replicas, minimising the largest load per replica (greedy).

    loads [L, X] -> owner [L, num_slots] (expert index of each replica; the first X are 0..X-1),
    copies [L, X] (replicas per expert).
    """
    L, X = loads.shape
    if num_slots < X:
        raise LocusError(f"eplb: {num_slots} slots cannot hold {X} experts")
    owner = np.empty((L, num_slots), dtype=np.int64)
    owner[:, :X] = np.arange(X)
    copies = np.ones((L, X), dtype=np.int64)
    layer = np.arange(L)
    for p in range(X, num_slots):
        hottest = np.argmax(loads / copies, axis=1)  # first index on ties
        owner[:, p] = hottest
        copies[layer, hottest] += 1
    return owner, copies


def balanced_pack(weights: np.ndarray, packs: int) -> tuple[np.ndarray, np.ndarray]:
    """Put N items into `packs` packs of exactly N / packs items each, balancing pack weights greedily:
    heaviest item first, each to the lightest pack that still has room (lowest index on ties).

    weights [L, N] -> pack [L, N] (pack of each item), place [L, N] (its index inside the pack).
    """
    L, N = weights.shape
    if N % packs:
        raise LocusError(f"eplb: {N} items do not split evenly into {packs} packs")
    room = N // packs
    order = np.argsort(-weights, axis=1, kind="stable")
    pack = np.empty((L, N), dtype=np.int64)
    place = np.empty((L, N), dtype=np.int64)
    load = np.zeros((L, packs))
    filled = np.zeros((L, packs), dtype=np.int64)
    layer = np.arange(L)
    for i in range(N):  # one item per layer at a time, all layers at once
        item = order[:, i]
        target = np.argmin(np.where(filled < room, load, np.inf), axis=1)
        pack[layer, item] = target
        place[layer, item] = filled[layer, target]
        load[layer, target] += weights[layer, item]
        filled[layer, target] += 1
    return pack, place


def _plan(slots, num_experts, moe_layers, topology, model, planner) -> PlacementPlan:
    created = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    return PlacementPlan(
        model=model,
        num_experts=int(num_experts),
        moe_layers=tuple(int(x) for x in moe_layers),
        topology=topology,
        slots=slots,
        provenance={"planner": planner, "created": created},
    )
