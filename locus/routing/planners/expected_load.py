"""Expected expert load under the dispatch rule, from per-node demand: what the planner balances.

The dispatch rule (dispatch_rule.py) sends a token on rank s routed to expert e to s itself if s holds
e, else to a replica on s's node, else to any replica; ties spread by `position % count`, i.e. evenly
in expectation. So with demand D[n, e] (pairs that node n's requests route to e) and x[n, e] replicas
of e on node n:
  - a node holding e serves its own demand for e: each of its replicas gets D[n, e] / x[n, e];
  - the demand of nodes without e (its "remote" demand, rem[e]) spreads over all X[e] replicas.
At rank granularity the own-rank tier matters a little: a rank holding e keeps its own tokens, the
node's other ranks spread theirs over the node's replicas. `rank_loads` models that exactly, with a
node's tokens spread evenly over its ranks (the grouper fills a node's ranks least-loaded first).
This is the `position` rule. Under the `node-aware` rule (the default, docs/replay.md) a remote
pair may instead join a node its token reaches anyway, so the remote share of an expert held on
several nodes is no longer even. Every function here therefore takes an optional `pull`: per source
node n, expert e and node j, the weight of one replica of e on j for n's remote pairs. n's remote
demand for e then splits over the holders in proportion to x[j, e] * pull[n, e, j] (evenly over the
replicas of one node, as both rules do). pull = None (or all ones) is the even spread, exact under
`position`; dispatch_pull.py measures pull by routing a sample of the planning requests with the
node-aware rule itself (dispatch_rule.py), which makes the model follow that rule.

Shape legend: L MoE layers, N nodes, G GPUs per node, R = N * G ranks, S slots per GPU, E experts.
    demand [.., N, E] float   x [.., N, E] int   slots [L, R, S] expert ids
    pull [.., N(source), E, N(holder)] float > 0, or None
"""

from __future__ import annotations

import numpy as np


def remote_share(demand: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Remote demand each replica of e receives under the even spread, [.., E]: rem[e] / X[e]."""
    remote = np.where(x > 0, 0.0, demand).sum(-2)
    return remote / np.maximum(x.sum(-2), 1)


def remote_loads(demand: np.ndarray, x: np.ndarray, pull: np.ndarray | None = None) -> np.ndarray:
    """Remote demand one replica of e on node j receives, [.., N, E] (meaningless where x is 0)."""
    if pull is None:
        return np.broadcast_to(remote_share(demand, x)[..., None, :], x.shape)
    remote = np.where(x > 0, 0.0, demand)  # [.., N(src), E]
    xt = np.swapaxes(x, -1, -2)[..., None, :, :]  # [.., 1, E, N(holder)]
    denom = (pull * xt).sum(-1)  # [.., N(src), E]
    share = remote / np.maximum(denom, 1e-300)  # remote demand per unit of weight
    per_replica = (share[..., None] * pull).sum(-3)  # [.., E, N(holder)]
    return np.swapaxes(per_replica, -1, -2)


def replica_loads(demand: np.ndarray, x: np.ndarray, pull: np.ndarray | None = None) -> np.ndarray:
    """Load of one replica of e on node n, [.., N, E] (0 where the node holds none)."""
    own = demand / np.maximum(x, 1)
    return np.where(x > 0, own + remote_loads(demand, x, pull), 0.0)


def node_replica_loads(demand: np.ndarray, x: np.ndarray, n: int) -> np.ndarray:
    """replica_loads(demand, x)[n], [E], for demand / x [N, E] under the even spread, without computing the
    other nodes' rows (the same operations per element, so the same figures)."""
    own = demand[n] / np.maximum(x[n], 1)
    return np.where(x[n] > 0, own + remote_share(demand, x), 0.0)


def node_loads(demand: np.ndarray, x: np.ndarray, pull: np.ndarray | None = None) -> np.ndarray:
    """Pairs each node serves, [.., N]."""
    return (x * replica_loads(demand, x, pull)).sum(-1)


def rank_loads(slots: np.ndarray, demand: np.ndarray, pull: np.ndarray | None = None) -> np.ndarray:
    """Expected pairs each rank computes, [L, R], for slots [L, R, S], node demand [L, N, E] and
    pull [L, N, E, N] (None: the even spread).

    Exact in expectation under the `position` rule (pull None) when each node's tokens spread evenly
    over its ranks; under `node-aware` as exact as pull.
    """
    L, R, S = slots.shape
    N, E = demand.shape[1], demand.shape[2]
    G = R // N
    keys = (np.arange(L)[:, None, None] * R + np.arange(R)[None, :, None]) * E + slots
    held = np.bincount(keys.ravel(), minlength=L * R * E).reshape(L, R, E).astype(np.float64)  # copies on rank
    x = held.reshape(L, N, G, E).sum(2)  # [L, N, E]
    has = (held > 0).reshape(L, N, G, E)
    per_rank = demand / G  # [L, N, E] tokens of one rank of the node
    # Ranks of the node without e hand their tokens to the node's replicas, each getting held / x.
    without = G - has.sum(2)  # [L, N, E]
    spill = np.where(x > 0, per_rank * without / np.maximum(x, 1), 0.0)  # per replica
    own = np.where(has, per_rank[:, :, None, :], 0.0)  # [L, N, G, E]
    remote = remote_loads(demand, x, pull)  # [L, N, E] per replica on each node
    local = own + held.reshape(L, N, G, E) * (spill + remote)[:, :, None, :]
    return local.reshape(L, R, E).sum(-1)
