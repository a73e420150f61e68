import numpy as np
import pytest

from locus.errors import LocusError
from locus.routing.planners.baselines import balanced_pack, eplb, replicate, round_robin
from locus.routing.plan.placement import validate
from locus.routing.plan.topology import Topology


def expected_rank_loads(plan, loads):
    """[L, R] load per rank if each expert's load splits evenly over its replicas (EPLB's model)."""
    L, R, _ = plan.slots.shape
    out = np.zeros((L, R))
    for l in range(L):
        copies = np.bincount(plan.slots[l].ravel(), minlength=plan.num_experts)
        for r in range(R):
            out[l, r] = sum(loads[l, e] / copies[e] for e in plan.slots[l, r])
    return out


def imbalance(rank_loads):
    return float((rank_loads.max(1) / rank_loads.mean(1)).mean())


def test_round_robin_deals_slots_to_ranks_in_turn():
    plan = round_robin(6, [1, 3], Topology(2, 2, 2))  # 8 slots: slot p -> expert p % 6, rank p % 4
    assert plan.slots[0].tolist() == [[0, 4], [1, 5], [2, 0], [3, 1]]
    np.testing.assert_array_equal(plan.slots[0], plan.slots[1])
    assert plan.planner == "round_robin"
    validate(plan, num_experts=6, moe_layers=[1, 3])


def test_replicate_gives_extra_slots_to_the_largest_load_per_replica():
    owner, copies = replicate(np.array([[10.0, 6.0, 1.0], [10.0, 1.0, 1.0]]), 5)
    # Layer 0: 10 -> 5 per replica, then 6 is the largest -> expert 1. Layer 1: expert 0 twice (10, 5, 3.3).
    assert copies.tolist() == [[2, 2, 1], [3, 1, 1]]
    assert owner.tolist() == [[0, 1, 2, 0, 1], [0, 1, 2, 0, 0]]


def test_balanced_pack_heaviest_first_to_lightest_pack_with_room():
    pack, place = balanced_pack(np.array([[5.0, 4.0, 3.0, 3.0, 2.0, 1.0]]), 2)
    # 5 -> A; 4 -> B; 3 -> B (7); 3 -> A (8); 2 -> B (9, full); 1 -> A (9).
    assert pack.tolist() == [[0, 1, 1, 0, 1, 0]]
    assert place.tolist() == [[0, 0, 1, 1, 2, 2]]
    with pytest.raises(LocusError, match="do not split evenly"):
        balanced_pack(np.ones((1, 5)), 2)


def skewed_loads(L, E, seed=0):
    rng = np.random.default_rng(seed)
    return np.stack([rng.permutation(1000.0 / np.arange(1, E + 1) ** 1.2) for _ in range(L)])


@pytest.mark.parametrize("topology", [Topology(2, 4, 5), Topology(4, 2, 4), Topology(1, 8, 6)])
def test_eplb_places_every_expert_with_equal_slots_and_beats_round_robin(topology):
    E, layers = 32, [0, 2, 4]
    loads = skewed_loads(len(layers), E)
    plan = eplb(loads, layers, topology)
    validate(plan, num_experts=E, moe_layers=layers)  # every expert in every layer, S per GPU
    assert plan.slots.shape == (3, topology.ranks, topology.slots_per_gpu)
    rr = round_robin(E, layers, topology)
    assert imbalance(expected_rank_loads(plan, loads)) <= imbalance(expected_rank_loads(rr, loads))


def test_eplb_hierarchical_keeps_each_group_on_one_node():
    E, groups, topology = 32, 4, Topology(2, 2, 10)  # 4 groups of 8 experts, 2 per node
    loads = skewed_loads(2, E, seed=3)
    plan = eplb(loads, [0, 1], topology, groups=groups)
    assert plan.provenance["policy"] == "hierarchical over 4 groups"
    validate(plan, num_experts=E)
    for l in range(2):
        for n in range(2):
            held = set(plan.slots[l, 2 * n : 2 * n + 2].ravel().tolist())
            node_groups = {e // 8 for e in held}
            assert len(node_groups) == 2 and held == {e for g in node_groups for e in range(8 * g, 8 * g + 8)}
    # Groups that the node count does not divide fall back to the global policy.
    assert eplb(loads, [0, 1], Topology(3, 1, 11), groups=4).provenance["policy"] == "global"


def test_eplb_checks_its_inputs():
    with pytest.raises(LocusError, match=r"loads must be \[2 layers, experts\]"):
        eplb(np.ones((3, 8)), [0, 1], Topology(1, 2, 4))
    with pytest.raises(LocusError, match="fewer than the 8 experts"):
        eplb(np.ones((1, 8)), [0], Topology(1, 2, 3))
    with pytest.raises(LocusError, match="non-negative"):
        eplb(-np.ones((1, 8)), [0], Topology(1, 2, 4))
