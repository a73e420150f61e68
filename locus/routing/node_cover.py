"""Node-aware replica choice: the part of the dispatch rule (dispatch_rule.py, rule `node-aware`) that
picks, for one token in one layer, which remote node serves each of its remote experts, so that the
token reaches as few remote nodes as it can.

A token's remote experts (those its own node holds no replica of) each have a set of nodes holding a
replica. Experts held by one remote node only fix that node ("forced" nodes). The others ("flexible":
held on two or more nodes) are covered by nodes the token reaches anyway where one holds them; then,
while some node holds two or more still-uncovered flexible experts, the node holding the most is added
(ties rotate by the token's position: the tied nodes in node order, index `position % ties`). Every
flexible expert that a reached node holds takes the replica at `position % count` of its replicas on
the reached nodes (rank order); one left uncovered needs a node of its own whichever it takes, so it
takes `position % count` of all its replicas, exactly as under the `position` rule. So the rule only
departs from `position` where that saves a node, and a lone remote expert (always, with top-1) is
spread over its replicas exactly as before: the load balance EPLB and the planner count on is kept
except where a node is saved.

Greedy set cover is optimal whenever one node beyond the forced ones suffices (the case that matters:
K <= 8 experts, hot experts replicated); with several uncovered experts spread over many nodes it may
use one node more than the minimum (tests/routing/test_dispatch_rule.py measures how often).

Shape legend: M token-layer rows, K top-k, N nodes.
    mask [M, K] uint    nodes holding each pair's expert when the pair is remote, 0 when it is served on
                        the token's own node or names no expert
"""

from __future__ import annotations

import numpy as np

if hasattr(np, "bitwise_count"):
    popcount = np.bitwise_count
else:  # numpy < 2.0: a byte lookup table
    _BYTE_BITS = np.array([bin(i).count("1") for i in range(256)], dtype=np.uint8)

    def popcount(x: np.ndarray) -> np.ndarray:
        b = np.ascontiguousarray(x)[..., None].view(np.uint8)
        return _BYTE_BITS[b].sum(-1, dtype=np.uint8)


def cover_nodes(mask: np.ndarray, position: np.ndarray, nodes: int) -> np.ndarray:
    """The nodes each pair of mask [M, K] may be served on (see the module docstring), same shape and
    dtype; 0 where mask is 0 (the pair is not remote). mask: any unsigned dtype wide enough for `nodes`."""
    pos = np.asarray(position, dtype=np.int64)
    zero, one = mask.dtype.type(0), mask.dtype.type(1)
    bits = np.left_shift(one, np.arange(nodes, dtype=mask.dtype))  # [N]
    flexible = (mask & (mask - one)) != 0  # two or more bits
    chosen = np.bitwise_or.reduce(np.where(flexible, zero, mask), axis=1)  # [M] forced nodes
    uncovered = flexible & ((mask & chosen[:, None]) == 0)  # [M, K]
    live = np.flatnonzero(np.count_nonzero(uncovered, axis=1) >= 2)
    for _ in range(mask.shape[1]):  # each round covers two or more flexible pairs of every live row
        if len(live) == 0:
            break
        m, u = mask[live], uncovered[live]
        counts = np.zeros((len(live), nodes), dtype=np.int64)
        for n in range(nodes):  # uncovered pairs node n would cover
            counts[:, n] = np.count_nonzero(u & ((m & bits[n]) != 0), axis=1)
        best = counts.max(1)
        gain = best >= 2  # a node that serves one uncovered pair only saves nothing: leave it to `position`
        live, counts, m, u = live[gain], counts[gain], m[gain], u[gain]
        chosen[live] |= bits[nth_true(counts == best[gain][:, None], pos[live])]
        u &= (m & chosen[live][:, None]) == 0
        uncovered[live] = u
        live = live[np.count_nonzero(u, axis=1) >= 2]
    # Covered pairs keep to the reached nodes; the others (one extra node each, whichever) any holder.
    return np.where(uncovered, mask, mask & chosen[:, None])


def replica_in(reach: np.ndarray, counts: np.ndarray, position: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For each pair, the replica at index `position % total` of its replicas on the nodes of `reach`,
    replicas in rank (so node) order: returns (node [F], index of the replica within that node [F]).

    reach [F] node masks, counts [F, N] replicas of the pair's expert on every node, position [F].
    """
    F, N = counts.shape
    held = (reach[:, None] >> np.arange(N, dtype=reach.dtype)) & reach.dtype.type(1)  # [F, N]
    on = counts * held.astype(np.int64)
    before = np.cumsum(on, axis=1)
    j = np.asarray(position, dtype=np.int64) % before[:, -1]
    node = np.argmax(before > j[:, None], axis=1)
    rows = np.arange(F)
    return node, j - (before[rows, node] - on[rows, node])


def nth_true(flags: np.ndarray, position: np.ndarray) -> np.ndarray:
    """Per row of flags [M, N] (each with at least one True), the column of its (position % count)-th
    True, [M] int64."""
    count = flags.sum(1)
    j = np.asarray(position, dtype=np.int64) % count
    return np.argmax(np.cumsum(flags, axis=1) > j[:, None], axis=1)
