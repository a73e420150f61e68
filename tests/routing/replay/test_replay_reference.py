"""The vectorised replay against a per-token Python reference on random traces, plans and assignments."""

import numpy as np
import pytest
from tests.routing.routing_reference import reference_replay

from locus.routing.replay import simulator as replay_module
from locus.routing.replay.assignment import Assignment
from locus.routing.planners.baselines import eplb, round_robin
from locus.routing.plan.placement import PlacementPlan
from locus.routing.replay.simulator import count_expert_loads, replay
from locus.routing.replay.metrics import LinkModel
from locus.routing.plan.topology import Topology
from locus.traces.format import TraceMeta
from locus.traces.reader import TraceReader
from locus.traces.writer import TraceWriter

FIELDS = [
    "tokens", "steps", "routings", "inter_node_bytes", "inter_node_bytes_nodedup", "intra_node_bytes",
    "intra_node_bytes_nodedup", "inter_node_bytes_per_token", "locality", "own_rank_share",
    "expert_imbalance_mean", "expert_imbalance_worst", "step_expert_imbalance_mean",
    "step_expert_imbalance_worst", "attention_imbalance", "step_attention_imbalance_mean",
    "step_attention_imbalance_worst", "a2a_seconds",
]


def random_trace(path, rng, E, K, L, num_requests):
    """Requests of 1..40 tokens, skewed expert choice, distinct ids per token, ~5% of slots -1."""
    meta = TraceMeta("rand", E, K, tuple(range(0, 2 * L, 2)), hidden_size=8, dtype_bytes=2)
    weights = 1.0 / np.arange(1, E + 1) ** 1.1
    requests = []
    with TraceWriter(path, meta) as writer:
        for i in range(num_requests):
            n = int(rng.integers(1, 41))
            rows = np.array([[rng.choice(E, K, replace=False, p=rng.permutation(weights) / weights.sum())
                              for _ in range(L)] for _ in range(n)])
            rows[rng.random(rows.shape) < 0.05] = -1
            writer.add_request(f"q{i}", "chat", int(rng.integers(0, n + 1)), rows)
            requests.append(rows.tolist())
    return TraceReader(path), requests


def random_plan(rng, E, L, topology):
    R, S = topology.ranks, topology.slots_per_gpu
    slots = np.stack([rng.permutation(np.concatenate([np.arange(E), rng.integers(0, E, R * S - E)])).reshape(R, S)
                      for _ in range(L)])
    return PlacementPlan("rand", E, tuple(range(0, 2 * L, 2)), topology, slots, provenance={"planner": "random"})


@pytest.mark.parametrize(
    "topology, E, K, L, batch_tokens, seed",
    [(Topology(2, 3, 3), 11, 3, 3, 16, 0), (Topology(3, 2, 2), 9, 2, 2, 7, 1), (Topology(1, 4, 3), 10, 4, 2, 64, 2),
     (Topology(4, 1, 4), 13, 3, 1, 5, 3)],
)
@pytest.mark.parametrize("rule", ["position", "node-aware"])
def test_random_replays_match_the_reference(tmp_path, monkeypatch, topology, E, K, L, batch_tokens, seed, rule):
    rng = np.random.default_rng(seed)
    reader, requests = random_trace(tmp_path / "trace", rng, E, K, L, num_requests=12)
    start, stop = 3, 12
    ranks = rng.integers(0, topology.ranks, stop - start)
    links = LinkModel(inter_gbps=40.0, intra_gbps=300.0, latency_us=3.0)
    monkeypatch.setattr(replay_module, "CHUNK_ROUTINGS", 29 * L * K)  # chunks that cut steps and requests
    loads = count_expert_loads(reader, 0, start)
    plans = (random_plan(rng, E, L, topology), round_robin(E, reader.meta.moe_layers, topology),
             eplb(loads, reader.meta.moe_layers, topology))
    for plan, order in zip(plans + plans[:1], ("trace", "trace", "trace", "ranks")):
        plan.dispatch = rule
        report = replay(reader, plan, topology, Assignment("rand", start, ranks), batch_tokens=batch_tokens,
                        links=links, step_order=order).to_dict()
        want = reference_replay(plan.slots.tolist(), topology.gpus_per_node, requests[start:stop], ranks.tolist(),
                                8, 2, batch_tokens, 40.0, 300.0, 3.0, order=order, rule=rule)
        for name in FIELDS:
            assert report[name] == pytest.approx(want[name], rel=1e-9), (plan.planner, order, name)
