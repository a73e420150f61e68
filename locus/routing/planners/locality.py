"""Locality placement of one MoE layer: node-level replica choice, GPU packing, expert-load cap.

    demand D[n, e] --select--> x[n, e] --copies--> --balance nodes--> --pack GPUs--> slots [R, S] --enforce cap-->

select / balance: replica_selection.py (or, budget "marginal", replica_budget.py); copies: replica_copies.py
(more copies of experts too heavy to pack under the cap; the search falls back to the start without them
when it misses the cap from it); pack: gpu_packing.py; the cap: slot_search.py, checked with
expected_load.rank_loads (the dispatch rule's expected per-rank load). Balancing nodes first to a tighter
limit than the cap leaves the GPU packing some room, so the cap search starts close. A layer the
search cannot bring under the cap comes back with met_cap False, and the planner decides what to do
(EPLB's balance for that layer, or an error).

Shape legend: N nodes, G GPUs per node, S slots per GPU, C = G * S slots per node, E experts, R = N * G.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from locus.routing.planners.gpu_packing import pack_replicas
from locus.routing.planners.replica_budget import select_by_marginal_gain
from locus.routing.planners.replica_copies import REPLICA_SHARE, spread_heavy_experts
from locus.routing.planners.expected_load import rank_loads, replica_loads
from locus.routing.plan.placement import node_replicas
from locus.routing.planners.replica_selection import balance_nodes, select_replicas
from locus.routing.planners.slot_search import enforce_cap
from locus.traces.metrics import max_over_mean

# Share of the cap's headroom the node-level balance may use; the rest absorbs GPU packing granularity.
NODE_HEADROOM = 0.5


@dataclass(frozen=True)
class LayerPlacement:
    slots: np.ndarray  # [R, S] expert ids
    imbalance: float  # expected max/mean rank load on the planning demand
    locality: float  # share of the planning demand served on its own node
    met_cap: bool


BUDGETS = ("top", "marginal")  # replica_selection.select_replicas; replica_budget.select_by_marginal_gain


def place_layer(demand: np.ndarray, gpus: int, slots_per_gpu: int, cap: float, budget: str = "top",
                top_k: int = 1) -> LayerPlacement:
    """demand [N, E] -> the layer's slots [N * gpus, slots_per_gpu] and its expected figures: the cap search
    from each start sketch_starts gives, in order, until one meets the cap (else the least imbalanced)."""
    N, E = demand.shape
    total = float(demand.sum())
    mean_rank = total / (N * gpus)
    best = None
    for start in sketch_starts(demand, gpus, slots_per_gpu, cap, budget, top_k):
        slots = enforce_cap(demand, start, gpus, target=cap * mean_rank * (1 - 1e-9))
        loads = rank_loads(slots[None], demand[None])[0]
        imb = float(max_over_mean(loads))
        if best is None or imb < best.imbalance:
            x = node_replicas(slots[None], N, E)[0]
            local = float((demand * (x > 0)).sum() / total) if total > 0 else 1.0
            best = LayerPlacement(slots, imb, local, imb <= cap)
        if best.met_cap:
            break
    return best


def sketch_layer(demand: np.ndarray, gpus: int, slots_per_gpu: int, cap: float, budget: str = "top",
                 top_k: int = 1) -> np.ndarray:
    """The layer's slots [N * gpus, slots_per_gpu] before the cap search (sketch_starts' first)."""
    return next(sketch_starts(demand, gpus, slots_per_gpu, cap, budget, top_k))


def sketch_starts(demand: np.ndarray, gpus: int, slots_per_gpu: int, cap: float, budget: str = "top",
                  top_k: int = 1) -> Iterator[np.ndarray]:
    """Starts for the cap search, slots [N * gpus, slots_per_gpu] each: replicas chosen, nodes balanced, GPUs
    packed. Where some replica is too heavy to pack under the cap (replica_copies.py), first with those
    experts given more copies, then (computed only when asked for) without; else the one start."""
    N, E = demand.shape
    C = gpus * slots_per_gpu
    total = float(demand.sum())
    x = select_by_marginal_gain(demand, C, top_k) if budget == "marginal" else select_replicas(demand, C)
    limit = (1 + NODE_HEADROOM * (cap - 1)) * total / N
    spread = spread_heavy_experts(demand, x, REPLICA_SHARE * cap * total / (N * gpus)) if total > 0 else x
    if not np.array_equal(spread, x):
        yield pack_layer(demand, balance_nodes(demand, spread, limit), gpus, slots_per_gpu)[0]
    yield pack_layer(demand, balance_nodes(demand, x, limit), gpus, slots_per_gpu)[0]


def pack_layer(demand: np.ndarray, x: np.ndarray, gpus: int, slots_per_gpu: int) -> tuple[np.ndarray, np.ndarray]:
    """Slots [R, S] from replica counts x [N, E], packed per node; and the expected rank loads [R]."""
    N, E = x.shape
    C = gpus * slots_per_gpu
    experts = np.stack([np.repeat(np.arange(E), x[n]) for n in range(N)])  # [N, C]
    weights = np.take_along_axis(replica_loads(demand, x), experts, 1)  # [N, C]
    gpu = pack_replicas(weights, gpus)  # [N, C]
    order = np.lexsort((experts, gpu), axis=1)  # by GPU, then expert id (deterministic slot order)
    slots = np.take_along_axis(experts, order, 1).reshape(N * gpus, slots_per_gpu)
    loads = rank_loads(slots[None], demand[None])[0]
    return slots, loads


def place_layers(demand: np.ndarray, gpus: int, slots_per_gpu: int, cap: float, budget: str = "top",
                 top_k: int = 1) -> list[LayerPlacement]:
    """place_layer for every layer of demand [L, N, E]."""
    return [place_layer(demand[l], gpus, slots_per_gpu, cap, budget, top_k) for l in range(demand.shape[0])]
