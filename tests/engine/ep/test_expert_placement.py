"""ExpertPlacement.route, the runtime's form of the dispatch rule, picks the same physical slot as
the shared rule's `destination_slots` (what the replay is costed by), on random plans with replicas,
one expert in two slots of a rank, and both rules."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from locus.engine.ep.placement import ExpertPlacement
from locus.routing.dispatch_rule import build_dispatch_table, destination_slots, table_keys
from locus.routing.plan.placement import PlacementPlan
from locus.routing.plan.topology import Topology


def random_plan(rng: np.random.Generator, nodes: int, gpus: int, slots: int, experts: int, layers: int,
                rule: str) -> PlacementPlan:
    """Every expert once per layer, the spare slots filled with random replicas (repeats allowed)."""
    R = nodes * gpus
    table = np.empty((layers, R * slots), dtype=np.int64)
    for layer in range(layers):
        fill = np.concatenate([np.arange(experts), rng.integers(0, experts, R * slots - experts)])
        table[layer] = rng.permutation(fill)
    return PlacementPlan("toy", experts, tuple(range(layers)), Topology(nodes, gpus, slots),
                         table.reshape(layers, R, slots), dispatch=rule)


@pytest.mark.parametrize("rule", ["position", "node-aware"])
@pytest.mark.parametrize("nodes,gpus,slots,experts,top_k", [(2, 2, 3, 8, 2), (3, 2, 4, 16, 3), (1, 4, 2, 6, 1), (4, 1, 5, 12, 2)])
def test_route_equals_the_shared_rule(rule, nodes, gpus, slots, experts, top_k):
    rng = np.random.default_rng(nodes * 100 + gpus * 10 + slots)
    for trial in range(4):
        plan = random_plan(rng, nodes, gpus, slots, experts, layers=3, rule=rule)
        table = build_dispatch_table(plan)
        for rank in range(nodes * gpus):
            placement = ExpertPlacement.build(plan, rank, epoch=trial)
            ids = rng.integers(-1, experts, (40, top_k))
            positions = rng.integers(0, 1000, 40)
            for row in range(3):
                got = placement.route(row, torch.from_numpy(ids), torch.from_numpy(positions))
                keys = table_keys(table, ids.astype(np.int32)[:, None, :], np.full(40, rank), [row])
                want = destination_slots(table, keys, positions)[:, 0, :]
                assert got.tolist() == want.tolist()
            assert placement.local_experts == tuple(tuple(plan.slots[r][rank]) for r in range(3))


def test_node_aware_choices_run_on_the_host_only_where_needed():
    rng = np.random.default_rng(0)
    one_node = random_plan(rng, 1, 4, 3, 8, 2, "node-aware")  # no remote node: nothing to choose
    assert not ExpertPlacement.build(one_node, 0).host_rule
    slots = np.array([[[0, 1, 2, 3], [4, 5, 2, 3], [6, 7, 0, 1]]])  # experts 0-3 on two nodes each
    spread = PlacementPlan("toy", 8, (0,), Topology(3, 1, 4), slots, dispatch="node-aware")
    assert ExpertPlacement.build(spread, 1).host_rule
    assert not ExpertPlacement.build(PlacementPlan("toy", 8, (0,), Topology(3, 1, 4), slots, dispatch="position"), 1).host_rule
