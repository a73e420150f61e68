"""Where the node-aware dispatch rule sends remote pairs, measured with the rule itself: the `pull`
that makes the planner's expected-load model (expected_load.py) follow the plan's dispatch rule.

Under `position` a node's remote demand for expert e spreads evenly over e's replicas. Under
`node-aware` (docs/replay.md) a remote pair joins a node its token reaches anyway, so nodes that hold
the token's other experts draw more of it; how much depends on which experts the tokens select
together, which per-node demand does not record. So the planner routes a sample of its planning
requests (every m-th request, about SAMPLE_TOKENS tokens, each token on its planned node) through
dispatch_rule.route, the one implementation of the rule, and counts c[l, n, e, j]: remote pairs of
node n for expert e served on node j. From the counts, per layer:
    w[n, e, j]  share of n's remote pairs for e served on j, shrunk towards the layer's node
                preference by PRIOR_PAIRS pseudo-pairs (a sample sees few pairs of a cold expert)
    g0[n, j]    layer-level preference: remote pairs n -> j over what the even spread would send
    pull[n, e, j] = w[n, e, j] / x[j, e] on e's holders; elsewhere g0[n, j] on the same scale, so a
                search that gives e a copy on a new node j (slot_search) sees j draw as nodes like it do
With the plan it was measured on, expected_load with this pull reproduces the sample's remote split
(up to the shrinkage); after the cap search changes the plan it is an estimate, and the planner
measures again (planner._calibrate). With top-1 routing or two nodes the rules coincide and no pull
is needed.

Shape legend: T sampled tokens, L MoE layers, K top-k, N nodes, G GPUs per node, E experts.
    pull [L, N(source), E, N(holder)] float64 > 0
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from locus.routing.dispatch_rule import build_dispatch_table, route
from locus.routing.plan.placement import node_replicas

SAMPLE_TOKENS = 65536  # routed per measurement: about 2 s at deepseek-v3 scale (58 layers, top-8)
PRIOR_PAIRS = 16.0  # pseudo-pairs of the layer-level preference in every (node, expert) share


@dataclass(frozen=True)
class RoutingSample:
    """Routings of every m-th planning request: rows [T, L, K], each row's request (index among the
    planning requests), position in its request, and whether it is a decode row."""
    expert_ids: np.ndarray  # [T, L, K] int16
    request: np.ndarray  # [T] int64
    position: np.ndarray  # [T] int64
    decode: np.ndarray  # [T] bool

    @property
    def num_tokens(self) -> int:
        return len(self.request)


def sample_routings(reader, start: int, stop: int, max_tokens: int = SAMPLE_TOKENS) -> RoutingSample:
    """Every m-th request of [start, stop), m the smallest stride keeping the sample near max_tokens."""
    offsets = np.asarray(reader.offsets, dtype=np.int64)
    total = int(offsets[stop] - offsets[start])
    stride = max(1, -(-total // max(max_tokens, 1)))
    chosen = np.arange(start, stop, stride)
    prompt = np.fromiter((reader.requests[r].prompt_tokens for r in chosen), dtype=np.int64, count=len(chosen))
    sizes = offsets[chosen + 1] - offsets[chosen]
    rows = np.concatenate([np.arange(offsets[r], offsets[r + 1]) for r in chosen]) if len(chosen) else \
        np.zeros(0, dtype=np.int64)
    ids = np.asarray(reader.expert_ids[rows]) if len(rows) else \
        np.zeros((0, *reader.expert_ids.shape[1:]), dtype=np.int16)
    request = np.repeat(chosen - start, sizes)
    position = rows - np.repeat(offsets[chosen], sizes)
    decode = position >= np.repeat(prompt, sizes)
    return RoutingSample(ids, request, position, decode)


def remote_counts(plan, sample: RoutingSample, prefill_node: np.ndarray, decode_node: np.ndarray,
                  layers=None) -> np.ndarray:
    """c [L', N, E, N]: the sample's remote pairs from node n for expert e served on node j, routed by the
    node-aware rule under `plan`, each row on its request's node; for the plan's layers at indices
    `layers` (default all, in the plan's order)."""
    topo = plan.topology
    N, G, E = topo.nodes, topo.gpus_per_node, plan.num_experts
    layers = np.arange(len(plan.moe_layers)) if layers is None else np.asarray(layers, dtype=np.int64)
    L = len(layers)
    counts = np.zeros(L * N * E * N, dtype=np.int64)
    if sample.num_tokens == 0:
        return counts.reshape(L, N, E, N).astype(np.float64)
    table = build_dispatch_table(plan, "node-aware")
    node = np.where(sample.decode, decode_node[sample.request], prefill_node[sample.request]).astype(np.int64)
    step = 4096  # rows per route() call: bounds the [rows, L, K] int64 temporaries
    for a in range(0, sample.num_tokens, step):
        ids = sample.expert_ids[a : a + step][:, layers]
        src = node[a : a + step]
        dest = route(table, ids, src * G, sample.position[a : a + step], layers=layers)  # [T, L', K]
        dst = dest // G
        remote = (ids >= 0) & (dst != src[:, None, None])
        layer = np.broadcast_to(np.arange(L)[None, :, None], ids.shape)
        srcb = np.broadcast_to(src[:, None, None], ids.shape)
        keys = ((layer[remote] * N + srcb[remote]) * E + ids[remote]) * N + dst[remote]
        counts += np.bincount(keys, minlength=counts.size)
    return counts.reshape(L, N, E, N).astype(np.float64)


def pull_from_counts(counts: np.ndarray, x: np.ndarray, prior_pairs: float = PRIOR_PAIRS) -> np.ndarray:
    """pull [L, N, E, N] (module docstring) from remote counts c [L, N, E, N] and replicas x [L, N, E]."""
    L, N, E, _ = counts.shape
    xt = np.swapaxes(x, 1, 2).astype(np.float64)[:, None, :, :]  # [L, 1, E, N(holder)]
    holders = xt > 0
    even = xt / np.maximum(xt.sum(-1, keepdims=True), 1)  # [L, 1, E, N] the even spread's shares
    flexible = (holders.sum(-1, keepdims=True) >= 2)  # only experts on two or more nodes say anything
    sent = counts.sum(-1, keepdims=True)  # [L, N, E, 1] remote pairs of n for e
    measured = (counts * flexible).sum(2)  # [L, N, N]
    expected = (sent * even * flexible).sum(2)  # [L, N, N]
    floor = 1e-3 * max(float(expected.sum()) / max(L * N * N, 1), 1e-12)
    g0 = (measured + floor) / (expected + floor)  # [L, N(source), N(holder)]
    prior = xt * g0[:, :, None, :]  # [L, N, E, N]
    scale = prior.sum(-1, keepdims=True)  # [L, N, E, 1] > 0: every expert is held somewhere
    weight = sent + prior_pairs
    w = np.where(weight > 0, (counts * holders + prior_pairs * prior / scale) / np.maximum(weight, 1e-300),
                 prior / scale)  # shares over the holders
    return np.where(holders, w / np.maximum(xt, 1), g0[:, :, None, :] / scale)


def measure_pull(plan, sample: RoutingSample, prefill_node: np.ndarray, decode_node: np.ndarray,
                 layers=None) -> np.ndarray:
    """pull [L', N, E, N] of `plan` under the node-aware rule, from the sample's routings (layers as in
    remote_counts)."""
    layers = np.arange(len(plan.moe_layers)) if layers is None else np.asarray(layers, dtype=np.int64)
    counts = remote_counts(plan, sample, prefill_node, decode_node, layers)
    x = node_replicas(np.asarray(plan.slots)[layers], plan.topology.nodes, plan.num_experts)
    return pull_from_counts(counts, x)
