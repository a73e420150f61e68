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
expert-load cap; the placement that follows handles both. Searched exhaustively for up to 7 domains,
else by pairwise swaps from the size order until none lowers the cost. Ties keep the size order
(largest first), the layout without affinity, so data without expert structure plans as before.

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
    names, per = domain_tokens(domains, tokens)
    size_order = [names[i] for i in sorted(range(len(names)), key=lambda i: (-per[i], names[i]))]
    if len(names) < 2 or nodes < 2:
        return size_order

    def cost(order: list[str]) -> float:
        return uncovered_pairs(node_fractions(order, names, per, nodes), profiles, slots_per_node)

    best, best_cost = size_order, cost(size_order)
    if len(names) <= EXHAUSTIVE:
        for perm in itertools.permutations(size_order):
            c = cost(list(perm))
            if c < best_cost - 1e-9 * max(best_cost, 1.0):
                best, best_cost = list(perm), c
        return best
    improved = True
    while improved:
        improved = False
        for i, j in itertools.combinations(range(len(best)), 2):
            trial = list(best)
            trial[i], trial[j] = trial[j], trial[i]
            c = cost(trial)
            if c < best_cost - 1e-9 * max(best_cost, 1.0):
                best, best_cost, improved = trial, c, True
    return best
