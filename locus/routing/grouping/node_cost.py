"""Expected inter-node bytes per token of a request, on every node it could run on: the grouper's
cost model.

Under a plan, a pair (token on node n, expert e, layer l) stays on n if n holds e, else goes to node j
with probability x[j, e] / X[e] (the dispatch rule spreads a tier's replicas evenly). A request's
per-layer pair distribution p[l, e] (its prefill signature, shrunk towards the planning data's expert
popularity by `prior_tokens` pseudo-tokens, since a short prompt says little) gives the share m[n, l, j]
of its pairs that node n would send to node j. With its K pairs per token drawn independently from p,
node j is sent a token with probability 1 - (1 - m)^K, and the expected bytes per token are
    bytes_per_send * sum over layers l and nodes j != n of (1 - (1 - m[n, l, j])^K)
(exact for K = 1; for K > 1 the request's own co-activation makes the true figure a little lower).

Shape legend: B requests, L MoE layers, E experts, N nodes.
    route [L, E, N * N] float32   [l, e, n * N + j]: share of node n's pairs for (l, e) served on node j
                                  (0 when j == n); one GEMM per layer scores every (request, n, j)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from locus.routing.plan.grouping_spec import GroupingSpec
from locus.routing.plan.placement import node_replicas

# Requests scored per batch: keeps the [B, L, E] distributions near 16 MB for DeepSeek shapes.
BATCH = 256


@dataclass(frozen=True)
class NodeCostModel:
    route: np.ndarray  # [L, E, N * N]
    top_k: int
    bytes_per_send: int
    prior: np.ndarray  # [L, E] rows sum to 1
    prior_tokens: float

    @classmethod
    def from_plan(cls, plan, spec: GroupingSpec, moe_layers=None) -> "NodeCostModel":
        """`moe_layers`: the order of the signatures' layers (default: the plan's own order)."""
        if moe_layers is not None and tuple(int(x) for x in moe_layers) != tuple(plan.moe_layers):
            # imported here: the simulator brings torch (its payload formats), which a grouper on
            # the plan's own layer order (`locus route`'s) never needs
            from locus.routing.replay.simulator import plan_in_trace_order

            plan = plan_in_trace_order(plan, moe_layers)
        N = plan.topology.nodes
        x = node_replicas(np.asarray(plan.slots), N, plan.num_experts).astype(np.float32)  # [L, N, E]
        share = x / np.maximum(x.sum(1, keepdims=True), 1)  # [L, N(j), E]
        L, E = x.shape[0], x.shape[2]
        # [L, E, n, j]: node n sends nothing for experts it holds, else share x[j, e] / X[e] to each j. Written
        # in place in the layout the scores read (a select, then a C-order copy, cost one more pass over
        # L E N^2 floats, most of the table's time at 32 nodes).
        route = np.empty((L, E, N, N), dtype=np.float32)
        route[...] = share.transpose(0, 2, 1)[:, :, None, :]
        route[(x > 0).transpose(0, 2, 1)] = 0.0
        return cls(route.reshape(L, E, N * N), spec.top_k, spec.bytes_per_send, spec.expert_prior, spec.prior_tokens)

    @property
    def nodes(self) -> int:
        return int(round(self.route.shape[2] ** 0.5))

    def distribution(self, counts: np.ndarray) -> np.ndarray:
        """Pair counts [B, L, E] -> shrunk per-layer distributions [B, L, E] float32."""
        counts = np.asarray(counts, dtype=np.float32)
        mixed = counts
        if self.prior_tokens:  # adding 0 * prior changes no count: spare the pass when there is no prior
            mixed = counts + np.float32(self.prior_tokens * self.top_k) * self.prior.astype(np.float32)[None]
        total = mixed.sum(-1, keepdims=True)
        uniform = np.float32(1.0 / mixed.shape[-1])
        return np.where(total > 0, mixed / np.where(total > 0, total, 1), uniform).astype(np.float32, copy=False)

    def expected_bytes(self, counts: np.ndarray) -> np.ndarray:
        """Expected inter-node bytes per token on each node, [B, N], from pair counts [B, L, E]."""
        counts = np.asarray(counts)
        single = counts.ndim == 2
        counts = counts[None] if single else counts
        N = self.nodes
        out = np.empty((counts.shape[0], N), dtype=np.float64)
        for a in range(0, counts.shape[0], BATCH):
            p = np.ascontiguousarray(self.distribution(counts[a : a + BATCH]).transpose(1, 0, 2))  # [L, B, E]
            # einsum's own loops, not BLAS: multi-threaded BLAS on these small products is many times
            # slower when another core is busy (docs/planner.md has the measurement).
            m = np.einsum("lbe,lek->lbk", p, self.route)  # [L, B, N * N]
            sends = self._sends(m)  # [B, N * N]
            out[a : a + BATCH] = sends.reshape(-1, N, N).sum(-1) * self.bytes_per_send
        return out[0] if single else out

    def _sends(self, m: np.ndarray) -> np.ndarray:
        """Expected sends over the layers (axis 0) from each route's per-layer expert mass m: a token's
        top_k picks reach a destination at least once with probability 1 - (1 - m)^top_k. One piece of code
        for both scores, whose figures must agree bit for bit."""
        return (1.0 - np.clip(1.0 - m, 0.0, 1.0) ** self.top_k).sum(0)

    def expected_bytes_on(self, counts: np.ndarray, node: np.ndarray) -> np.ndarray:
        """expected_bytes(counts)[b, node[b]], [B]: each request's bytes on its own node only, from pair
        counts [B, L, E] and nodes [B]. The requests of one node are scored together against that node's
        N columns of route (1 / N of the work), with the requests as einsum's inner axis. The figures must
        be expected_bytes' bit for bit (a last-bit difference can flip the planner's near ties;
        tests/routing/grouping/test_node_cost.py holds them to it): the sums over layers and over nodes
        keep expected_bytes' memory layout, since numpy's summation order follows the layout."""
        node = np.asarray(node)
        out = np.empty(len(counts), dtype=np.float64)
        for n in np.unique(node):
            rows = np.flatnonzero(node == n)
            out[rows] = self.bytes_on_node(counts, rows, int(n))
        return out

    def bytes_on_node(self, counts: np.ndarray, rows: np.ndarray, n: int) -> np.ndarray:
        """expected_bytes(counts[rows])[:, n], [len(rows)]: expected_bytes_on for the requests `rows` of node n
        (each node's figures are independent of the others', so nodes may be scored in any order or apart)."""
        N = self.nodes
        route = np.ascontiguousarray(self.route[:, :, n * N : (n + 1) * N])  # [L, E, N(j)]
        out = np.empty(len(rows), dtype=np.float64)
        for a in range(0, len(rows), BATCH):
            batch = rows[a : a + BATCH]
            p = np.ascontiguousarray(self.distribution(counts[batch]).transpose(1, 2, 0))  # [L, E, b]
            m = np.einsum("lek,leb->lkb", route, p)  # [L, N(j), b]; einsum's own loops, as above
            sends = self._sends(m)  # [N(j), b]
            out[a : a + BATCH] = np.ascontiguousarray(sends.T).sum(-1) * self.bytes_per_send  # float32 product
        return out
