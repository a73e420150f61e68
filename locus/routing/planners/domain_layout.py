"""The order of the tagged domains on the grouping line (grouping_spec.domain_node_weights): which domains
share a node.

The line gives every domain its token share of the nodes, so a node holds whole domains and at most a
few shares cut at node boundaries; which domains meet on a node is the order's only effect. A node's
pairs can stay on it only for the experts it holds, at most `slots per node` of them per layer, so the
order is scored by what no placement can keep local on the nodes' own demand:

    cost(order) = sum over nodes n and layers l of (pairs of n in l) - (its top-k experts' pairs),
    k = gpus_per_node * slots_per_gpu (0 when k >= E: every node can hold every expert),

with node n's demand = sum over domains d of (share of d's tokens on n) * d's pairs per layer and
expert (the planning signatures). This ignores that every expert still needs a slot somewhere and the
expert-load cap, so it only shortlists: the planner places the size order (largest first, the layout
without affinity) and the two lowest-scoring other layouts that score below it, each on its own
grouping, and keeps the one with the lowest expected inter-node bytes, as it chooses between rounds
(planner._domain_layout); ties keep the size order. Scored exhaustively for up to 7 domains (orders
that put the same shares on the same nodes, up to the nodes' numbering, count once), else pairwise
swaps from the size order until none lowers the score.

Shape legend: D domains, N nodes, L MoE layers, E experts.
"""

from __future__ import annotations

import itertools

import numpy as np

from locus.routing.plan.grouping_spec import domain_node_weights, domain_tokens, tagged_domains

EXHAUSTIVE = 7  # domains up to which every order is scored (7! = 5,040 orders)


def node_fractions(order: list[str], names: list[str], per: np.ndarray, nodes: int) -> np.ndarray:
    """[D, N] the share of each domain's tokens that the line in `order` puts on each node (rows in
    `names` order; `per` [D] their tokens)."""
    weights = domain_node_weights(names, per, nodes, order=order)
    w = np.array([weights[d] for d in names])
    return w / np.maximum(w.sum(1, keepdims=True), 1e-12)


def domain_profiles(domains: list[str], pairs: np.ndarray) -> np.ndarray:
    """[D, L, E] the pairs of each tagged domain (domain_tokens' order), from pairs [R, L, E] per request."""
    names = tagged_domains(domains)
    tags = np.asarray(domains)
    return np.stack([pairs[tags == d].sum(0) for d in names]) if names else np.zeros((0, *pairs.shape[1:]))


def uncovered_pairs(fractions: np.ndarray, profiles: np.ndarray, k: int) -> float:
    """fractions [D, N], profiles [D, L, E] pairs: the pairs outside every node's top-k experts."""
    demand = np.einsum("dn,dle->nle", fractions, profiles)  # [N, L, E]
    if k >= demand.shape[-1]:
        return 0.0
    top = np.sort(demand, axis=-1)[..., demand.shape[-1] - k:]
    return float(demand.sum() - top.sum())


def choose_domain_order(domains: list[str], tokens: np.ndarray, profiles: np.ndarray, nodes: int,
                        slots_per_node: int) -> list[str]:
    """The line order of the tagged domains that leaves the fewest pairs outside the nodes' top experts.
    domains [R] and tokens [R] per planning request, profiles [D, L, E] the pairs of each tagged domain
    (in sorted domain order, as domain_tokens names them)."""
    return ranked_orders(domains, tokens, profiles, nodes, slots_per_node, 1)[0][1]


def domain_orders(domains: list[str], tokens: np.ndarray, profiles: np.ndarray, nodes: int, slots_per_node: int,
                  count: int) -> list[list[str]]:
    """Up to `count` orders to place and compare: the size order first, then the lowest-scoring other
    layouts that score below it (orders that put the same shares on the same nodes, up to renumbering
    the nodes, count once)."""
    names, per = domain_tokens(domains, tokens)
    size = size_order(names, per)
    if len(names) < 2 or nodes < 2:  # one layout
        return [size]
    size_cost = uncovered_pairs(node_fractions(size, names, per, nodes), profiles, slots_per_node)
    out = [size]
    for cost, order in ranked_orders(domains, tokens, profiles, nodes, slots_per_node, count + 1):
        if len(out) < count and cost < size_cost - 1e-9 * max(size_cost, 1.0) and all(
                layout_key(order, names, per, nodes) != layout_key(o, names, per, nodes) for o in out):
            out.append(order)
    return out


def size_order(names: list[str], per: np.ndarray) -> list[str]:
    return [names[i] for i in sorted(range(len(names)), key=lambda i: (-per[i], names[i]))]


def layout_key(order: list[str], names: list[str], per: np.ndarray, nodes: int) -> tuple:
    """What an order puts on the nodes, the same for orders that differ only by the nodes' numbering."""
    f = np.round(node_fractions(order, names, per, nodes), 9)
    return tuple(sorted(tuple(col) for col in f.T))


def ranked_orders(domains: list[str], tokens: np.ndarray, profiles: np.ndarray, nodes: int, slots_per_node: int,
                  count: int) -> list[tuple[float, list[str]]]:
    """(score, order) of the `count` lowest-scoring orders of distinct layouts, lowest first (ties: the
    size order, then the order they are met in)."""
    names, per = domain_tokens(domains, tokens)
    size = size_order(names, per)
    if len(names) < 2 or nodes < 2:
        return [(0.0, size)]

    def cost(order: list[str]) -> float:
        return uncovered_pairs(node_fractions(order, names, per, nodes), profiles, slots_per_node)

    if len(names) <= EXHAUSTIVE:
        scored, seen = [], set()
        for perm in itertools.permutations(size):
            order = list(perm)
            key = layout_key(order, names, per, nodes)
            if key not in seen:
                seen.add(key)
                scored.append((cost(order), len(scored), order))
        scored.sort(key=lambda x: (round(x[0], 6), x[1]))
        return [(c, order) for c, _, order in scored[:count]]
    best, best_cost = size, cost(size)
    improved = True
    while improved:
        improved = False
        for i, j in itertools.combinations(range(len(best)), 2):
            trial = list(best)
            trial[i], trial[j] = trial[j], trial[i]
            c = cost(trial)
            if c < best_cost - 1e-9 * max(best_cost, 1.0):
                best, best_cost, improved = trial, c, True
    return [(best_cost, best)]
