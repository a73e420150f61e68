"""The dispatch rule: which rank serves a token's (layer, expert) pair. One rule for serving and replay,
so simulated and measured traffic agree exactly.

A token on rank s routed to expert e goes to
  1. the replica of e on rank s, if s holds e;
  2. else a replica on s's node;
  3. else a replica on another node.
Within the first non-empty tier it takes the replica at index `position % count`, replicas sorted by
rank (a rank holding e in two slots contributes two consecutive entries), `position` being the token's
0-based position in its request. The tie-break spreads a request's tokens over replicas
deterministically, with no shared state between ranks.

Lookup tables (built once per plan), shape legend: L MoE layers, R ranks, E experts, P = R * slots.
Column 0 of every [L, R, E + 1] table stands for "no expert" (trace id -1), so a trace id e reads
column e + 1 and no masking is needed on the hot path.
    replica_ranks [L * P]        int16  per layer, the rank of every slot, sorted by (expert, rank)
    replica_slots [L * P]        int32  the same entries as physical slots p = rank * slots + j (the
                                        runtime needs the slot, not only the rank: a rank may hold
                                        an expert twice)
    fixed         [L, R, E + 1]  int16  destination when the chosen tier has one replica; -1 when it has
                                        several; R (a rank that does not exist) for "no expert"
    start, count  [L, R, E + 1]  int32  the chosen tier's replicas: replica_ranks[start : start + count]
Each tier is one contiguous run of the rank-sorted replica list: rank s's own slots, or its node's
(ranks are node-major, so a node is a contiguous rank range), or, when the node holds none, the
whole list. So index i = position % count of the tier is entry start + i.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from locus.routing.plan.placement import PlacementPlan, validate


@dataclass(frozen=True)
class DispatchTable:
    num_ranks: int
    num_experts: int
    gpus_per_node: int
    replica_ranks: np.ndarray
    replica_slots: np.ndarray
    fixed: np.ndarray
    start: np.ndarray
    count: np.ndarray
    has_choices: bool  # False when no tier anywhere holds two replicas: `fixed` alone answers

    @property
    def num_layers(self) -> int:
        return self.fixed.shape[0]

    @property
    def none_rank(self) -> int:
        """The sentinel destination of a missing expert (trace id -1)."""
        return self.num_ranks


def build_dispatch_table(plan: PlacementPlan) -> DispatchTable:
    validate(plan)  # the tables assume every expert has a slot in every layer
    slots = np.asarray(plan.slots, dtype=np.int64)  # [L, R, S]
    L, R, S = slots.shape
    E, G, P = plan.num_experts, plan.topology.gpus_per_node, R * S
    if R + 1 > np.iinfo(np.int16).max:
        raise ValueError(f"{R} ranks do not fit the int16 dispatch tables")
    if L * R * (E + 1) >= 2**31:
        raise ValueError(f"{L} layers x {R} ranks x {E} experts overflow the int32 table keys")

    # held[l, r, e]: slots of rank r holding e; below[l, r, e]: slots holding e on ranks < r.
    keys = (np.arange(L)[:, None, None] * R + np.arange(R)[None, :, None]) * E + slots
    held = np.bincount(keys.ravel(), minlength=L * R * E).reshape(L, R, E)
    below = np.zeros((L, R + 1, E), dtype=np.int64)
    np.cumsum(held, axis=1, out=below[:, 1:])
    total = below[:, R]  # [L, E]
    expert_start = np.arange(L)[:, None] * P + np.cumsum(total, axis=1) - total  # [L, E]

    # Sorting each layer's slots by expert (stable, slots are rank-major) lists replicas by rank.
    order = np.argsort(slots.reshape(L, P), axis=1, kind="stable")
    replica_ranks = (order // S).astype(np.int16).ravel()
    replica_slots = order.astype(np.int32).ravel()  # p = r * S + j, the slot itself

    rank = np.arange(R)
    node_lo, node_hi = (rank // G) * G, (rank // G + 1) * G
    a_s, b_s = below[:, rank], below[:, rank + 1]  # [L, R, E] s's own block
    a_n, b_n = below[:, node_lo], below[:, node_hi]  # s's node's block
    on_rank, on_node = b_s - a_s, b_n - a_n
    local, near = on_rank > 0, (on_rank == 0) & (on_node > 0)
    # Remote tier (neither): the own node holds none, so the tier is every replica of e.
    start = expert_start[:, None, :] + np.where(local, a_s, np.where(near, a_n, 0))
    count = np.where(local, on_rank, np.where(near, on_node, total[:, None, :]))
    fixed = np.where(count == 1, replica_ranks[start], -1)

    def with_none_column(table: np.ndarray, none_value: int, dtype) -> np.ndarray:
        out = np.empty((L, R, E + 1), dtype=dtype)
        out[:, :, 0] = none_value
        out[:, :, 1:] = table
        return out

    return DispatchTable(
        num_ranks=R,
        num_experts=E,
        gpus_per_node=G,
        replica_ranks=replica_ranks,
        replica_slots=replica_slots,
        fixed=with_none_column(fixed, R, np.int16),
        start=with_none_column(start, 0, np.int32),
        count=with_none_column(count, 1, np.int32),
        has_choices=bool((count > 1).any()),
    )


def table_keys(table: DispatchTable, expert_ids: np.ndarray, src_rank: np.ndarray, layers=None) -> np.ndarray:
    """Flat index into the [L, R, E + 1] tables for every (token, layer, k), [T, L', K] int32.

    expert_ids [T, L', K] (-1 = none), src_rank [T]; `layers` names the table layer of each of the L'
    columns (default: all layers, in order).
    """
    T, L_, _ = expert_ids.shape
    R, E1 = table.num_ranks, table.num_experts + 1
    layers = np.arange(table.num_layers) if layers is None else np.asarray(layers)
    row_base = ((layers[None, :] * R + np.asarray(src_rank)[:, None]) * E1 + 1).astype(np.int32)  # [T, L']
    return row_base[:, :, None] + expert_ids


def destinations(table: DispatchTable, keys: np.ndarray, position: np.ndarray) -> np.ndarray:
    """Destination rank of every key from `table_keys`, same shape, int16; `table.none_rank` for no expert.

    position [T]: each token's position in its request (keys' first axis is the token).
    """
    dest = table.fixed.ravel()[keys]
    if not table.has_choices:
        return dest
    pick = np.flatnonzero(dest < 0)
    if len(pick):
        per_token = keys[0].size if keys.ndim > 1 else 1
        k = keys.ravel()[pick]
        i = np.asarray(position, dtype=np.int64)[pick // per_token] % table.count.ravel()[k]
        dest.ravel()[pick] = table.replica_ranks[table.start.ravel()[k] + i]
    return dest


def destination_slots(table: DispatchTable, keys: np.ndarray, position: np.ndarray) -> np.ndarray:
    """Destination physical slot of every key from `table_keys`: the same choice as `destinations`
    (its rank is slot // slots_per_gpu), int32 of keys' shape, -1 for no expert. The expert-parallel
    runtime's entry to the rule: a rank may hold an expert in two slots, and the tie-break picks one.

    position [T]: each token's position in its request (keys' first axis is the token).
    """
    count = table.count.ravel()[keys]
    i = np.asarray(position, dtype=np.int64).reshape(-1, *([1] * (keys.ndim - 1))) % count
    slot = table.replica_slots[table.start.ravel()[keys] + i]
    return np.where(keys % (table.num_experts + 1) == 0, -1, slot).astype(np.int32)


def route(table: DispatchTable, expert_ids, src_rank, position, layers=None) -> np.ndarray:
    """Destination ranks for expert_ids [T, L', K] (or [T, K] with one layer index in `layers`).

    src_rank [T], position [T]; returns int64 of expert_ids' shape, -1 where the expert id is -1.
    """
    ids = np.asarray(expert_ids)
    single = ids.ndim == 2
    if single:
        if layers is None or np.ndim(layers) != 0:
            raise ValueError("route: [T, K] expert ids need one layer index in `layers`")
        ids, layers = ids[:, None, :], [int(layers)]
    if ids.ndim != 3:
        raise ValueError(f"route: expert_ids must be [T, L, K] or [T, K], got shape {ids.shape}")
    src, pos = np.asarray(src_rank), np.asarray(position)
    if src.shape != (ids.shape[0],) or pos.shape != (ids.shape[0],):
        raise ValueError(f"route: src_rank and position must be [{ids.shape[0]}], got {src.shape}, {pos.shape}")
    if ids.size and (ids.min() < -1 or ids.max() >= table.num_experts):
        raise ValueError(f"route: expert ids must lie in -1..{table.num_experts - 1}")
    if src.size and (src.min() < 0 or src.max() >= table.num_ranks):
        raise ValueError(f"route: source ranks must lie in 0..{table.num_ranks - 1}")
    if pos.size and pos.min() < 0:
        raise ValueError("route: positions must be non-negative")
    dest = destinations(table, table_keys(table, ids.astype(np.int32), src, layers), pos).astype(np.int64)
    dest[dest == table.none_rank] = -1
    return dest[:, 0, :] if single else dest
