"""Which experts each node holds, and how many copies: the node-level half of the locality planner.

One MoE layer at a time. Input: demand D[n, e], the (token, k) pairs node n's requests route to
expert e (planning data, after grouping). Output: x[n, e], replicas of e on node n, every node holding
exactly `capacity` = GPUs x slots replicas and every expert at least one.

  select   every node takes the experts its own requests use most (its top `capacity`); a hot,
           domain-generic expert is in every node's top list and so gets a replica everywhere. Experts
           no node picked ("orphans", the cold tail) must still live somewhere: each goes, hottest
           first, to the node where it costs least (the node's least valuable duplicate replica makes
           room, minus what the orphan's own demand there wins back).
  balance  locality piles load where demand is: a node serves its own demand for the experts it holds
           plus a share of every other node's demand for them (expected_load.py). While some node serves
           more than `limit` pairs, swap one replica of the most loaded node with one of another node,
           choosing the swap that removes the most overload per local pair lost.
  split    a replica too heavy for one GPU gets another copy on the same node, in place of the node's
           cheapest replica (the one whose loss costs the fewest local pairs).

Shape legend: N nodes, E experts.  demand [N, E] float, x [N, E] int.
"""

from __future__ import annotations

import numpy as np

from locus.routing.planners.expected_load import node_loads, node_replica_loads, remote_share

MAX_BALANCE_MOVES = 400


def select_replicas(demand: np.ndarray, capacity: int) -> np.ndarray:
    """x [N, E]: each node's top experts by its own demand, orphans placed where they cost least."""
    N, E = demand.shape
    x = np.zeros((N, E), dtype=np.int64)
    top = np.argsort(-demand, axis=1, kind="stable")[:, : min(capacity, E)]
    x[np.arange(N)[:, None], top] = 1
    for orphan in np.argsort(-demand.sum(0), kind="stable"):
        if x[:, orphan].any():
            continue
        costs = removal_costs(demand, x)  # [N, E]
        n = int(np.argmax(demand[:, orphan] - costs.min(1)))
        x[n, cheapest_replica(demand, x, costs[n], n)] -= 1
        x[n, orphan] += 1
    for n in range(N):  # capacity > E: the extra slots split the node's heaviest replicas
        while x[n].sum() < capacity:
            x[n, int(np.argmax(node_replica_loads(demand, x, n)))] += 1
    return x


def removal_costs(demand: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Local pairs each node loses by giving up one replica of each expert, [N, E]: inf where it has
    none, or where that is the expert's last replica anywhere; 0 for a second copy on the same node."""
    removable = (x >= 1) & (x.sum(0) >= 2)[None, :]
    return np.where(removable, np.where(x == 1, demand, 0.0), np.inf)


def cheapest_replica(demand: np.ndarray, x: np.ndarray, cost: np.ndarray, n: int) -> int:
    """Node n's cheapest replica to give up; among equally cheap ones the lightest, so that balance
    suffers least."""
    return int(np.lexsort((node_replica_loads(demand, x, n), cost))[0])


def split_replica(demand: np.ndarray, x: np.ndarray, n: int, e: int) -> bool:
    """Give expert e one more replica on node n (in place, in x), instead of n's cheapest other one."""
    cost = removal_costs(demand, x)[n]
    cost[e] = np.inf
    if not np.isfinite(cost).any():
        return False
    x[n, cheapest_replica(demand, x, cost, n)] -= 1
    x[n, e] += 1
    return True


def transfer_effects_batch(demand: np.ndarray, x: np.ndarray, rho: np.ndarray, src: np.ndarray,
                           dst: np.ndarray, experts: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Moving one replica of an expert from node src[d] to node dst[d], for D (src, dst) pairs, given rho =
    remote_share(demand, x) [E]; for every expert, or for the K experts [D, K] each pair names.

    Returns (delta_load [D, K, N]: change of every node's load, delta_local [D, K]: change of local
    pairs), K = E without `experts`; rows of experts src[d] does not hold are meaningless (the caller masks
    them). Elementwise only, so a (pair, expert)'s figures do not depend on what else shares its batch.
    """
    if experts is None:
        experts = np.broadcast_to(np.arange(x.shape[1]), (len(src), x.shape[1]))
    copies = np.maximum(x.sum(0), 1)[experts]  # [D, K]
    x_src, x_dst = x[src[:, None], experts], x[dst[:, None], experts]  # [D, K]
    rho_k = rho[experts]
    drop = x_src == 1  # src loses its last copy: its demand turns remote
    gain = x_dst == 0  # dst's demand turns local
    d_src, d_dst = demand[src[:, None], experts], demand[dst[:, None], experts]  # [D, K]
    rho_new = rho_k + (d_src * drop - d_dst * gain) / copies
    delta = x.T[experts] * (rho_new - rho_k)[:, :, None]  # [D, K, N] third nodes: only the remote share changes
    pairs = np.arange(len(src))
    delta[pairs, :, src] = -d_src * drop + (x_src - 1) * rho_new - x_src * rho_k
    delta[pairs, :, dst] = d_dst * gain + (x_dst + 1) * rho_new - x_dst * rho_k
    return delta, d_dst * gain - d_src * drop


def balance_nodes(demand: np.ndarray, x: np.ndarray, limit: float, max_moves: int = MAX_BALANCE_MOVES) -> np.ndarray:
    """Swap replicas between nodes until no node serves more than `limit` pairs (or no swap helps)."""
    x = x.copy()
    N, E = demand.shape
    scale = max(float(demand.sum()) / N, 1e-12)
    for _ in range(max_moves):
        loads = node_loads(demand, x)
        excess = np.maximum(loads - limit, 0.0).sum()
        if excess <= 1e-9 * scale:
            break
        src = int(np.argmax(loads))
        best = best_swap(demand, x, loads, excess, limit, scale, src)
        if best is None:
            break
        dst, ea, eb = best
        x[src, ea] -= 1
        x[dst, ea] += 1
        x[dst, eb] -= 1
        x[src, eb] += 1
    return x


def best_swap(demand: np.ndarray, x: np.ndarray, loads: np.ndarray, excess: float, limit: float, scale: float,
              src: int) -> tuple[int, int, int] | None:
    """The swap (dst, expert src gives, expert dst gives) removing the most overload per local pair
    lost, over every other node at once; the first best in (dst, a, b) order; None if none helps.

    Shapes: D = N - 1 other nodes, A experts src holds, B = the most experts any dst holds (shorter
    lists padded and masked).
    """
    dsts = np.array([n for n in range(demand.shape[0]) if n != src])
    D = len(dsts)
    a = np.flatnonzero(x[src] >= 1)  # [A]
    held = x[dsts] >= 1  # [D, E]
    width = int(held.sum(1).max())
    order = np.argsort(~held, axis=1, kind="stable")[:, :width]  # [D, B] held experts first, ascending
    valid = np.take_along_axis(held, order, 1)  # [D, B]
    # a: src -> dst and b: dst -> src, each for the experts its side holds: [D, A or B, N], [D, A or B]
    rho = remote_share(demand, x)
    da, la = transfer_effects_batch(demand, x, rho, np.full(D, src), dsts, np.broadcast_to(a, (D, len(a))))
    db, lb = transfer_effects_batch(demand, x, rho, dsts, np.full(D, src), order)
    over = loads + da[:, :, None, :] + db[:, None, :, :]  # [D, A, B, N] new loads
    np.subtract(over, limit, out=over)
    np.maximum(over, 0.0, out=over)
    reduced = excess - over.sum(-1)  # [D, A, B]
    loss = -(la[:, :, None] + lb[:, None, :])
    score = reduced / (np.maximum(loss, 0.0) + 1e-6 * scale)
    useless = (a[None, :, None] == order[:, None, :]) | ~valid[:, None, :]  # [D, A, B]
    useless |= reduced <= 1e-6 * scale
    score[useless] = -np.inf
    d, i, j = np.unravel_index(int(np.argmax(score)), score.shape)
    if not np.isfinite(score[d, i, j]):
        return None
    return int(dsts[d]), int(a[i]), int(order[d, j])
