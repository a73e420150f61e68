"""The dispatch rule: which rank serves a token's (layer, expert) pair. One rule for serving and replay,
so simulated and measured traffic agree exactly. Two variants (docs/replay.md), named by the plan's
`dispatch` field or by the caller:

A token on rank s routed to expert e goes to
  1. the replica of e on rank s, if s holds e;
  2. else a replica on s's node;
  3. else a replica on another node.
`position`: within the first non-empty tier it takes the replica at index
`position % count`, replicas sorted by rank (a rank holding e in two slots contributes two consecutive
entries), `position` being the token's 0-based position in its request. The tie-break spreads a
request's tokens over replicas deterministically, with no shared state between ranks.
`node-aware`: tiers 1 and 2 as above; in tier 3, the remote nodes are chosen for the token's K experts
together so that it reaches as few remote nodes as it can (node_cover.py); an expert then takes the
replica at `position % count` of its replicas on the nodes chosen for it. Where no node is saved (an
expert held by one remote node only, a lone remote expert, top-1) it routes exactly as `position`.

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
    remote_mask   [L, R, E + 1]  uint    node-aware: the nodes holding e when s's node holds none, else 0
    flexible      [L, R, E + 1]  bool    node-aware: remote tier with replicas on two or more nodes
    node_start, node_count [L, N, E + 1] int32  the replicas of e on node n: one run of replica_ranks
Each tier is one contiguous run of the rank-sorted replica list: rank s's own slots, or its node's
(ranks are node-major, so a node is a contiguous rank range), or, when the node holds none, the
whole list. So index i = position % count of the tier is entry start + i.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from locus.errors import LocusError
from locus.routing.node_cover import cover_nodes, popcount, replica_in
from locus.routing.plan.placement import DISPATCH_RULES, PlacementPlan

RULES = DISPATCH_RULES
DEFAULT_RULE = "node-aware"  # measured: docs/replay.md, "The dispatch rule"
# The rule a planner's plans carry when the caller names none: EPLB balances its replicas assuming remote
# traffic spreads evenly over them, which is `position`; node-aware raises its imbalance (docs/planner.md).
PLANNER_RULES = {"eplb": "position"}


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
    rule: str = "position"
    remote_mask: np.ndarray | None = None  # node-aware tables (None under `position`)
    flexible: np.ndarray | None = None
    node_start: np.ndarray | None = None
    node_count: np.ndarray | None = None

    @property
    def num_layers(self) -> int:
        return self.fixed.shape[0]

    @property
    def none_rank(self) -> int:
        """The sentinel destination of a missing expert (trace id -1)."""
        return self.num_ranks


def resolve_rule(plan: PlacementPlan, rule: str | None = None) -> str:
    """The rule to route `plan` by: the caller's, else the plan's `dispatch` field, else DEFAULT_RULE."""
    rule = rule or plan.dispatch or DEFAULT_RULE
    if rule not in RULES:
        raise LocusError(f"unknown dispatch rule {rule!r}; choose one of {', '.join(RULES)}")
    return rule


def planner_rule(planner: str, rule: str | None = None) -> str:
    """The rule a `planner`'s plan is made for: the caller's, else the planner's own, else DEFAULT_RULE."""
    rule = rule or PLANNER_RULES.get(planner, DEFAULT_RULE)
    if rule not in RULES:
        raise LocusError(f"unknown dispatch rule {rule!r}; choose one of {', '.join(RULES)}")
    return rule


def build_dispatch_table(plan: PlacementPlan, rule: str | None = None) -> DispatchTable:
    """Lookup tables for `plan` under `rule` (default: the plan's own, see resolve_rule). `plan` is one
    its maker checked (placement.validate: loaded, planned, re-planned); what the tables rely on is
    asserted, since a plan that breaks it would give wrong tables without an error."""
    rule = resolve_rule(plan, rule)
    slots = np.asarray(plan.slots, dtype=np.int64)  # [L, R, S]
    L, R, S = slots.shape
    E, G, P = plan.num_experts, plan.topology.gpus_per_node, R * S
    # an id outside 0..E-1 would land in another rank's or layer's keys below
    assert (L, R, S) == (len(plan.moe_layers), plan.topology.ranks, plan.topology.slots_per_gpu) and (
        not slots.size or 0 <= slots.min() <= slots.max() < E), "the plan's slots do not match its topology and experts"
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
    assert total.all(), "an expert has no slot in some layer"  # its tier would be empty: no rank to send to
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

    extra = {}
    if rule == "node-aware":
        N = R // G
        if N > 64:
            raise LocusError(f"the node-aware rule keeps node sets in 64-bit masks; {N} nodes are too many")
        node_lo = np.arange(N) * G
        n_start = expert_start[:, None, :] + below[:, node_lo]  # [L, N, E]
        n_count = below[:, node_lo + G] - below[:, node_lo]
        bit = next(t for t in (np.uint8, np.uint16, np.uint32, np.uint64) if N <= 8 * np.dtype(t).itemsize)
        holds = (n_count > 0).astype(bit) << np.arange(N, dtype=bit)[None, :, None]
        nodes_of = np.bitwise_or.reduce(holds, axis=1)  # [L, E] nodes holding e
        remote = ~(local | near)  # [L, R, E]
        mask = np.where(remote, nodes_of[:, None, :], bit(0))
        flexible = remote & (popcount(nodes_of) >= 2)[:, None, :]
        extra = dict(remote_mask=with_none_column(mask, 0, bit),
                     flexible=with_none_column(flexible, False, bool),
                     node_start=np.concatenate([np.zeros((L, N, 1), np.int32), n_start.astype(np.int32)], axis=2),
                     node_count=np.concatenate([np.ones((L, N, 1), np.int32), n_count.astype(np.int32)], axis=2))
        if not flexible.any():
            extra = {}  # no expert is held on two remote nodes: both rules route alike, no tables needed
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
        rule=rule,
        **extra,
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

    keys [T, L', K]; position [T]: each token's position in its request.
    """
    dest = table.fixed.ravel()[keys]
    if not table.has_choices:
        return dest
    pick = np.flatnonzero(dest < 0)
    if len(pick):
        dest.ravel()[pick] = table.replica_ranks[_entries(table, keys, position, pick)]
    return dest


def destination_slots(table: DispatchTable, keys: np.ndarray, position: np.ndarray) -> np.ndarray:
    """Destination physical slot of every key from `table_keys`: the same choice as `destinations`
    (its rank is slot // slots_per_gpu), int32 of keys' shape, -1 for no expert. The expert-parallel
    runtime's entry to the rule: a rank may hold an expert in two slots, and the tie-break picks one.

    keys [T, L', K]; position [T]: each token's position in its request.
    """
    every = np.arange(keys.size)
    slot = table.replica_slots[_entries(table, keys, position, every)].reshape(keys.shape)
    return np.where(keys % (table.num_experts + 1) == 0, -1, slot).astype(np.int32)


def _entries(table: DispatchTable, keys: np.ndarray, position: np.ndarray, pick: np.ndarray) -> np.ndarray:
    """Index into replica_ranks / replica_slots of the flat keys `pick` (sorted), [len(pick)] int64."""
    T = keys.shape[0]
    per_token = keys.size // T if T else 1
    k = keys.ravel()[pick]
    pos = np.asarray(position, dtype=np.int64)[pick // per_token]
    entry = table.start.ravel()[k] + pos % table.count.ravel()[k]
    if table.flexible is None:  # `position`, or nothing to choose
        return entry
    flex = np.flatnonzero(table.flexible.ravel()[k])
    if len(flex) == 0:
        return entry
    # Whole token-layer rows: the node choice looks at all K experts of a token together.
    K = keys.shape[-1]
    row_of = pick[flex] // K  # sorted, as pick is
    new = np.ones(len(row_of), dtype=bool)
    new[1:] = row_of[1:] != row_of[:-1]
    rows = row_of[new]  # [M] distinct rows of keys viewed as [T * L', K]
    row_keys = keys.reshape(-1, K)[rows]  # [M, K]
    row_pos = np.asarray(position, dtype=np.int64)[rows * K // per_token]
    N = table.num_ranks // table.gpus_per_node
    reach = cover_nodes(table.remote_mask.ravel()[row_keys], row_pos, N)
    reach = reach[np.cumsum(new) - 1, pick[flex] % K]  # [F] nodes each flexible pair may use
    E1, R = table.num_experts + 1, table.num_ranks
    fk = k[flex]
    node_key = ((fk // (R * E1)) * N)[:, None] * E1 + np.arange(N)[None, :] * E1 + (fk % E1)[:, None]  # [F, N]
    node, i = replica_in(reach, table.node_count.ravel()[node_key], pos[flex])
    entry[flex] = table.node_start.ravel()[node_key[np.arange(len(fk)), node]] + i
    return entry


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
