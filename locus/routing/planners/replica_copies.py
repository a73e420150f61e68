"""Copies per expert before GPU packing: no replica so heavy that its GPU cannot stay under the rank cap.

The node-level selection (replica_selection.select_replicas) gives each node its own top experts, so a
hot, domain-generic expert gets a copy on most nodes while the cold tail gets one copy each. With few
slots per GPU (2 at 32 x 8 GPUs, 256 experts on 512 slots) an expert with one copy carries the whole
cluster's demand for it, about the mean rank load, and a GPU holding two such replicas is twice the mean:
no packing of the node's replicas onto its GPUs can meet the cap, and the cap search (slot_search.py)
then repairs one rank a step. Here, while the heaviest replica of some expert weighs more than `limit`
(a share of the rank target), that expert gets one more copy, on the node where it gains the most
local pairs net of what the slot costs (as select_replicas places its orphans), in place of that node's
cheapest replica whose expert stays light enough with one copy fewer, and only where the copy lowers the
expert's heaviest replica (where a node's own demand alone makes it heavy, on that node). The replica weights are
expected_load's (even remote spread).

Shape legend: N nodes, E experts.  demand [N, E] float, x [N, E] int.
"""

from __future__ import annotations

import numpy as np

from locus.routing.planners.expected_load import replica_loads
from locus.routing.planners.replica_selection import cheapest_replica, removal_costs

# Heaviest replica allowed, as a share of the rank target: the rest of the target is left for the
# replicas its GPU shares with it.
REPLICA_SHARE = 0.85


def spread_heavy_experts(demand: np.ndarray, x: np.ndarray, limit: float, max_copies: int | None = None) -> np.ndarray:
    """x [N, E] with more copies of the experts whose heaviest replica weighs over `limit` pairs, each node
    keeping its slot count (module docstring); stops when none is over, or when no slot can be freed
    without making its expert too heavy. max_copies: most copies added (default: one per slot)."""
    if limit <= 0:
        raise ValueError(f"the replica weight limit must be positive, got {limit}")
    x = x.copy()
    N, E = demand.shape
    for _ in range(int(x.sum()) if max_copies is None else max_copies):
        heaviest = replica_loads(demand, x).max(0)  # [E]
        e = int(np.argmax(heaviest))
        if heaviest[e] <= limit:
            break
        costs = removal_costs(demand, x)  # [N, E]
        costs[heaviest_without_copy(demand, x) > limit] = np.inf  # the freed slot's expert must stay light
        costs[:, e] = np.inf
        gain = demand[:, e] * (x[:, e] == 0) - costs.min(1)  # [N]
        gain[heaviest_with_copy(demand[:, e], x[:, e]) >= heaviest[e]] = -np.inf  # only where the copy helps
        n = int(np.argmax(gain))
        if not np.isfinite(gain[n]):
            break
        x[n, cheapest_replica(demand, x, costs[n], n)] -= 1
        x[n, e] += 1
    return x


def heaviest_with_copy(demand_e: np.ndarray, x_e: np.ndarray) -> np.ndarray:
    """An expert's heaviest replica load with one more copy on each node, [N], from its node demand and
    copies [N] (expected_load.replica_loads' rule: own demand over the node's copies plus an even share of
    the demand of nodes without a copy)."""
    N = len(x_e)
    x = x_e[None, :] + np.eye(N, dtype=x_e.dtype)  # [N(copy added on), N]
    remote = np.where(x > 0, 0.0, demand_e[None, :]).sum(1) / x.sum(1)  # [N]
    return np.where(x > 0, demand_e[None, :] / np.maximum(x, 1) + remote[:, None], 0.0).max(1)


def heaviest_without_copy(demand: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Each expert's heaviest replica load with one copy fewer on each node, [N, E] (meaningless where the
    node holds none or it is the expert's last copy), by replica_loads' rule: the node's own demand
    splits over one copy less, or turns remote with its last copy there, and the remote demand over one
    copy less."""
    N, E = demand.shape
    copies = x.sum(0)
    own = np.where(x > 0, demand / np.maximum(x, 1), -np.inf)  # [N, E]
    top = np.argmax(own, 0)  # [E]
    first = own[top, np.arange(E)]
    own[top, np.arange(E)] = -np.inf
    second = own.max(0)
    others = np.where(np.arange(N)[:, None] == top[None, :], second[None, :], first[None, :])  # [N, E] max elsewhere
    own_after = np.where(x >= 2, demand / np.maximum(x - 1, 1), -np.inf)
    remote = np.where(x > 0, 0.0, demand).sum(0)  # [E]
    remote_after = (remote[None, :] + np.where(x == 1, demand, 0.0)) / np.maximum(copies - 1, 1)[None, :]
    return np.maximum(others, own_after) + remote_after
