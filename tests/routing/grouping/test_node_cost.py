"""NodeCostModel.expected_bytes_on must give expected_bytes' figures bit for bit: the planner chooses
between layouts and rounds on them, and a last-bit difference could flip a near tie (and a plan)."""

import numpy as np
import pytest

from locus.routing.grouping.node_cost import BATCH, NodeCostModel
from locus.routing.plan.placement import PlacementPlan
from locus.routing.plan.topology import Topology


def random_model(rng, nodes: int, layers: int, experts: int, top_k: int, prior_tokens: float) -> NodeCostModel:
    gpus, slots = 2, 2 * experts // (nodes * 2) + 1  # every expert once, spare slots for replicas
    ids = np.stack([np.concatenate([rng.permutation(experts), rng.integers(0, experts, nodes * gpus * slots - experts)])
                    for _ in range(layers)]).reshape(layers, nodes * gpus, slots)
    plan = PlacementPlan("toy", experts, tuple(range(layers)), Topology(nodes, gpus, slots), ids)
    prior = rng.random((layers, experts))
    spec = type("Spec", (), dict(top_k=top_k, bytes_per_send=7168, expert_prior=prior / prior.sum(1, keepdims=True),
                                 prior_tokens=prior_tokens))
    return NodeCostModel.from_plan(plan, spec)


@pytest.mark.parametrize("nodes,top_k,prior_tokens", [(8, 8, 0.0), (4, 2, 0.0), (8, 4, 3.0), (2, 1, 0.0)])
def test_bytes_on_each_requests_node_equal_the_full_table_bit_for_bit(nodes, top_k, prior_tokens):
    rng = np.random.default_rng(nodes * 10 + top_k)
    layers, experts = 3, 32
    cost = random_model(rng, nodes, layers, experts, top_k, prior_tokens)
    requests = BATCH + 37  # more than one batch
    counts = rng.integers(0, 6, (requests, layers, experts)).astype(np.float32)
    counts[:5] = 0  # empty signatures take the uniform distribution
    node = rng.integers(0, nodes, requests)
    full = cost.expected_bytes(counts)[np.arange(requests), node]
    assert cost.expected_bytes_on(counts, node).tobytes() == full.tobytes()
