"""Node-aligned locality placement (`locus plan --align-groups`): each expert group on one node, then
locality and balance within that.

    demand D[n, e] --group demand--> groups to nodes --replicas within each node--> slots [R, S]

1. groups to nodes: group g's demand from node n's requests is Dg[n, g], its load W[g] = sum over n.
   Start as EPLB's hierarchical policy does (heaviest group first to the least loaded node, the group
   counts per node as even as they can be), then move or swap groups between nodes while that raises the
   demand served on the requesting node and keeps every node's load under the limit, or under the start's
   heaviest node where whole groups could not meet the limit. A node holds at most floor(G * S / group size)
   groups and at least one.
2. within a node: its groups' experts once each, then each spare slot to the expert with the highest load
   per replica (EPLB's replicate: an aligned expert's whole demand lands on its node), packed on the
   node's GPUs (locality.pack_layer).
Every replica of an expert lies on its group's node, so both dispatch rules route alike (docs/replay.md)
and no token's experts lie on more than topk_group nodes. A layer whose aligned placement misses the
expert-load cap takes EPLB's hierarchical placement (also aligned) if that meets it; else the cap is
raised to the better of the two under `--expert-cap auto`, or the plan is refused naming the layer.

Shape legend: L MoE layers, N nodes, G GPUs per node, S slots per GPU, C = G * S, E experts, Gn groups.
"""

from __future__ import annotations

import numpy as np

from locus.errors import LocusError
from locus.routing.expert_groups import ExpertGroups
from locus.routing.planners.baselines import eplb, replicate
from locus.routing.planners.expected_load import rank_loads
from locus.routing.planners.locality import NODE_HEADROOM, pack_layer
from locus.routing.plan.topology import Topology
from locus.traces.metrics import max_over_mean


def check_alignable(groups: ExpertGroups, topology: Topology) -> None:
    """One clear error when the groups cannot be node-aligned on this topology."""
    groups.check_fits(topology)
    if groups.num_groups < topology.nodes:
        raise LocusError(f"--align-groups: {groups.num_groups} expert groups cannot cover {topology.nodes} nodes "
                         f"(a node holds whole groups only, and every node holds some)")


def assign_groups(group_demand: np.ndarray, room: int, limit: float) -> np.ndarray:
    """Node of every group, [Gn], for group demand [N, Gn] (see the module docstring, step 1)."""
    N, Gn = group_demand.shape
    W = group_demand.sum(0)
    most = min(room, -(-Gn // N))  # the even start: no node above ceil(Gn / N) groups
    node_of = np.empty(Gn, dtype=np.int64)
    load, count = np.zeros(N), np.zeros(N, dtype=np.int64)
    for g in np.argsort(-W, kind="stable"):
        n = int(np.argmin(np.where(count < most, load, np.inf)))
        node_of[g], load[n], count[n] = n, load[n] + W[g], count[n] + 1

    # whole groups rarely balance to the limit: the even start's heaviest node is then the bound a move keeps to,
    # so locality is bought only with balance the start has already given up
    limit = max(limit, float(load.max()))

    def score(node: np.ndarray, loads: np.ndarray) -> tuple[float, float]:
        return max(0.0, float(loads.max()) - limit), -float(group_demand[node, np.arange(Gn)].sum())

    current = score(node_of, load)
    for _ in range(4 * Gn * N):
        best = None
        for g in range(Gn):
            a = node_of[g]
            for n in range(N):  # move g to n
                if n == a or count[n] >= room or count[a] <= 1:
                    continue
                node, loads = node_of.copy(), load.copy()
                node[g], loads[a], loads[n] = n, loads[a] - W[g], loads[n] + W[g]
                best = _better(best, score(node, loads), node, loads)
            for h in range(g + 1, Gn):  # swap g and h
                b = node_of[h]
                if a == b:
                    continue
                node, loads = node_of.copy(), load.copy()
                node[g], node[h] = b, a
                loads[a] += W[h] - W[g]
                loads[b] += W[g] - W[h]
                best = _better(best, score(node, loads), node, loads)
        if best is None or not _improves(best[0], current):
            break
        current, node_of, load = best
        count = np.bincount(node_of, minlength=N)
    return node_of


def _better(best, candidate_score, node, loads):
    if best is None or _improves(candidate_score, best[0]):
        return candidate_score, node, loads
    return best


def _improves(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """Lexicographic (overload, -local demand), with a relative tolerance so float noise never loops."""
    tol = 1e-9 * (1.0 + abs(b[1]))
    if a[0] < b[0] - tol:
        return True
    return abs(a[0] - b[0]) <= tol and a[1] < b[1] - tol


def place_layer_aligned(demand: np.ndarray, groups: ExpertGroups, gpus: int, slots_per_gpu: int,
                        cap: float) -> np.ndarray:
    """demand [N, E] -> slots [N * gpus, slots_per_gpu] with every group's replicas on one node."""
    N, E = demand.shape
    C = gpus * slots_per_gpu
    size = groups.size
    group_demand = demand.reshape(N, groups.num_groups, size).sum(-1)  # [N, Gn]
    limit = (1 + NODE_HEADROOM * (cap - 1)) * float(demand.sum()) / N
    node_of = assign_groups(group_demand, C // size, limit)
    x = np.zeros((N, E), dtype=np.int64)
    load = demand.sum(0)  # [E]: all of an aligned expert's demand reaches its one node
    for n in range(N):
        experts = np.flatnonzero(np.repeat(node_of == n, size))
        _, copies = replicate(load[experts][None], C)
        x[n, experts] = copies[0]
    slots, _ = pack_layer(demand, x, gpus, slots_per_gpu)
    return slots


def place_aligned(demand: np.ndarray, moe_layers, topology: Topology, groups: ExpertGroups, cap: float,
                  auto: bool) -> tuple[np.ndarray, list[int], np.ndarray]:
    """Slots [L, R, S] of every layer for node demand [L, N, E], the MoE layers that took EPLB's hierarchical
    placement, and each layer's cap [L] (raised under auto where neither placement meets it)."""
    check_alignable(groups, topology)
    L = demand.shape[0]
    G, S, N = topology.gpus_per_node, topology.slots_per_gpu, topology.nodes
    slots = np.stack([place_layer_aligned(demand[l], groups, G, S, cap) for l in range(L)])
    imb = max_over_mean(rank_loads(slots, demand))  # [L]
    caps = np.full(L, float(cap))
    fallback = []
    over = np.flatnonzero(imb > cap)
    if len(over) and groups.num_groups % N == 0:
        backup = eplb(demand.sum(1), moe_layers, topology, groups=groups.num_groups).slots
        backup_imb = max_over_mean(rank_loads(backup, demand))
        for l in over:
            if backup_imb[l] < imb[l]:
                slots[l], imb[l] = backup[l], backup_imb[l]
                fallback.append(int(moe_layers[l]))
    for l in np.flatnonzero(imb > cap):
        if not auto:
            raise LocusError(
                f"MoE layer {moe_layers[l]}: no node-aligned placement found meets the expert-load cap {cap:.3f} with "
                f"{S} slots per GPU (it reaches {imb[l]:.3f}: whole groups of {groups.size} experts on "
                f"{N} nodes); give more --slots, a looser --expert-cap, or --expert-cap auto")
        caps[l] = imb[l]
    return slots, sorted(fallback), caps
