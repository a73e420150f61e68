"""Replica budget by marginal gain: which experts each node holds when the dispatch rule is node-aware.

The default selection (replica_selection.select_replicas) gives every node the experts its own requests
use most, so a hot, domain-generic expert gets a copy on every node. Under the node-aware rule
(dispatch_rule.py) that last copy saves little for top-K routing: a token that lacks the expert locally
reaches some of its other experts' nodes anyway, and the expert joins one of them if it is held there.
So here each expert first gets one copy, on the node that wants it most and has room (hottest expert
first); then every spare slot goes, one at a time, to the (node, expert) that saves the most expected
node crossings:
    gain[n, e] = D[n, e] * prod over the nodes j holding e of (1 - q[n, j])
    q[n, j]    = 1 - (1 - m[n, j])^(K - 1): the chance a token of node n reaches node j through its
                 other K - 1 experts, m[n, j] the share of n's pairs served on j (replicas share evenly)
With K = 1 (q = 0) this is "most local pairs per slot", the same objective as the default selection.
The node balance, GPU packing and cap search that follow are the default ones (locality.py).

Shape legend: N nodes, E experts.  demand [N, E] float, x [N, E] int.
"""

from __future__ import annotations

import numpy as np


def reach_probability(demand: np.ndarray, x: np.ndarray, top_k: int) -> np.ndarray:
    """q [N, N]: chance a token of node n reaches node j through its other top_k - 1 experts (0 on the diagonal)."""
    held = x > 0
    share = x / np.maximum(x.sum(0, keepdims=True), 1)  # [N(j), E] share of e's replicas on j
    p = demand / np.maximum(demand.sum(1, keepdims=True), 1e-12)  # [N, E] node n's pair distribution
    m = (p * ~held) @ share.T  # [N, N] share of n's pairs served on j
    np.fill_diagonal(m, 0.0)
    return 1.0 - (1.0 - np.clip(m, 0.0, 1.0)) ** max(top_k - 1, 0)


def select_by_marginal_gain(demand: np.ndarray, capacity: int, top_k: int) -> np.ndarray:
    """x [N, E]: every expert once, then the spare slots by expected node crossings saved (module docstring)."""
    N, E = demand.shape
    x = np.zeros((N, E), dtype=np.int64)
    room = np.full(N, capacity, dtype=np.int64)
    for e in np.argsort(-demand.sum(0), kind="stable"):  # one copy each, hottest first
        n = next(int(n) for n in np.argsort(-demand[:, e], kind="stable") if room[n] > 0)
        x[n, e] = 1
        room[n] -= 1
    while room.sum() > 0:
        miss = np.log(np.clip(1.0 - reach_probability(demand, x, top_k), 1e-12, 1.0))  # [N, N]
        gain = demand * np.exp(miss @ (x > 0))  # [N, E]
        gain = np.where((x == 0) & (room[:, None] > 0), gain, -np.inf)
        n, e = np.unravel_index(int(np.argmax(gain)), gain.shape)
        if not np.isfinite(gain[n, e]):
            break  # a node with room holds every expert already (slots > experts)
        x[n, e] += 1
        room[n] -= 1
    for n in np.flatnonzero(room):  # more slots than experts: split the node's heaviest replicas
        for _ in range(int(room[n])):
            x[n, int(np.argmax(demand[n] / np.maximum(x[n], 1)))] += 1
    return x
