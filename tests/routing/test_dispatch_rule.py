import numpy as np
import pytest
from tests.routing.routing_reference import reference_destination, reference_node_aware

from locus.routing.dispatch_rule import build_dispatch_table, route
from locus.routing.plan.placement import PlacementPlan
from locus.routing.plan.topology import Topology


def plan_of(slots, nodes, gpus) -> PlacementPlan:
    slots = np.asarray(slots)
    E = int(slots.max()) + 1
    return PlacementPlan("toy", E, tuple(range(slots.shape[0])), Topology(nodes, gpus, slots.shape[2]), slots)


# 2 nodes x 3 GPUs, 2 slots each. Expert 0: ranks 0, 2, 4, 5 (two on each node); expert 1: ranks 1, 4;
# expert 2: ranks 3, 3 (two slots on one rank); the others once.
SLOTS = [[[0, 3], [1, 4], [0, 5], [2, 2], [0, 1], [0, 6]]]


def dest(table, src, expert, pos, layer=0):
    return int(route(table, [[expert]], [src], [pos], layers=layer)[0, 0])


def test_tier_order_own_rank_then_node_then_remote():
    table = build_dispatch_table(plan_of(SLOTS, 2, 3), "position")
    assert dest(table, 0, 0, pos=1) == 0  # rank 0 holds expert 0 itself: no other replica is considered
    assert dest(table, 1, 0, pos=0) == 0  # rank 1 lacks it; node 0 holds it on ranks 0 and 2
    assert dest(table, 1, 0, pos=1) == 2
    assert dest(table, 1, 0, pos=2) == 0
    assert dest(table, 3, 1, pos=0) == 4  # node 1's own replica beats node 0's rank 1
    assert dest(table, 3, 1, pos=1) == 4
    assert dest(table, 0, 2, pos=5) == 3  # only node 1 holds expert 2
    assert dest(table, 5, 4, pos=3) == 1


def test_remote_tie_break_is_position_mod_count_by_rank():
    # Expert 0 seen from node 1 when node 1 holds none: replicas on ranks 0 and 2, in rank order.
    slots = [[[0, 6], [1, 7], [0, 8], [2, 3], [4, 1], [5, 9]]]
    table = build_dispatch_table(plan_of(slots, 2, 3), "position")
    assert [dest(table, 4, 0, pos=p) for p in range(5)] == [0, 2, 0, 2, 0]


def test_remote_tier_lists_every_replica_by_rank():
    # 3 nodes x 2 GPUs: expert 0 on ranks 0 (node 0), 4 and 5 (node 2). The remote tier is only reached
    # when the own node holds no replica, so it always lists them all: [0, 4, 5].
    slots = [[[0, 1], [2, 3], [4, 5], [1, 2], [0, 3], [0, 4]]]
    table = build_dispatch_table(plan_of(slots, 3, 2), "position")
    assert [dest(table, 3, 0, pos=p) for p in range(4)] == [0, 4, 5, 0]
    assert [dest(table, 2, 0, pos=p) for p in range(3)] == [0, 4, 5]
    assert [dest(table, 1, 0, pos=p) for p in range(2)] == [0, 0]  # node 0's rank 0 wins
    assert dest(table, 4, 0, pos=7) == 4  # rank 4 holds it: local, even though rank 5 does too


def test_two_slots_on_one_rank_count_twice():
    # Expert 0: rank 0 twice and rank 1 once, all on node 0; from node 1 the remote list is [0, 0, 1].
    slots = [[[0, 0], [0, 1], [2, 3], [1, 2]]]
    table = build_dispatch_table(plan_of(slots, 2, 2), "position")
    assert [dest(table, 2, 0, pos=p) for p in range(6)] == [0, 0, 1, 0, 0, 1]


def test_missing_expert_routes_nowhere():
    table = build_dispatch_table(plan_of(SLOTS, 2, 3), "position")
    out = route(table, [[0, -1, 1]], [1], [0], layers=0)
    assert out.tolist() == [[0, -1, 1]]


def test_matches_brute_force_on_random_plans():
    rng = np.random.default_rng(7)
    for nodes, gpus, slots_per_gpu, E, L in [(2, 3, 3, 11, 3), (3, 2, 4, 7, 2), (1, 4, 2, 8, 1), (4, 1, 5, 9, 2)]:
        R = nodes * gpus
        slots = np.empty((L, R, slots_per_gpu), dtype=np.int64)
        for l in range(L):
            extra = rng.integers(0, E, R * slots_per_gpu - E) if l % 2 else np.zeros(R * slots_per_gpu - E, int)
            slots[l] = rng.permutation(np.concatenate([np.arange(E), extra])).reshape(R, slots_per_gpu)
        table = build_dispatch_table(plan_of(slots, nodes, gpus), "position")
        T, K = 64, 3
        ids = rng.integers(-1, E, (T, L, K))
        src = rng.integers(0, R, T)
        pos = rng.integers(0, 50, T)
        got = route(table, ids, src, pos)
        for t in range(T):
            for l in range(L):
                for k in range(K):
                    want = -1 if ids[t, l, k] < 0 else reference_destination(
                        slots[l].tolist(), gpus, int(src[t]), int(ids[t, l, k]), int(pos[t]))
                    assert got[t, l, k] == want, (nodes, gpus, t, l, k)


def test_route_checks_its_inputs():
    table = build_dispatch_table(plan_of(SLOTS, 2, 3), "position")
    with pytest.raises(ValueError, match=r"expert ids must lie in -1..6"):
        route(table, [[10]], [0], [0], layers=0)
    with pytest.raises(ValueError, match="source ranks"):
        route(table, [[1]], [6], [0], layers=0)
    with pytest.raises(ValueError, match="one layer index"):
        route(table, [[1]], [0], [0])


def test_destination_slots_make_the_same_choice_and_name_the_slot():
    """The runtime's entry (physical slots) and replay's (ranks) are one rule: slot // S == rank."""
    from locus.routing.dispatch_rule import destination_slots, destinations, table_keys

    rng = np.random.default_rng(3)
    for slots in (SLOTS, [[[0, 0], [0, 1], [2, 3], [1, 2]]]):
        plan = plan_of(slots, 2, len(slots[0]) // 2)
        table, S = build_dispatch_table(plan), plan.topology.slots_per_gpu
        ids = rng.integers(-1, plan.num_experts, size=(50, 1, 2)).astype(np.int32)
        src, pos = rng.integers(0, table.num_ranks, 50), rng.integers(0, 100, 50)
        keys = table_keys(table, ids, src)
        got, ranks = destination_slots(table, keys, pos), destinations(table, keys, pos).astype(np.int64)
        assert ((got // S == ranks) | (ids < 0)).all() and ((got == -1) == (ids < 0)).all()
        held = np.asarray(slots).reshape(1, -1)[0]
        assert (held[got[ids >= 0]] == ids[ids >= 0]).all()  # the slot holds the expert asked for
    # rank 0 holds expert 0 twice: the tie-break alternates between its two slots, then rank 1's
    table = build_dispatch_table(plan_of([[[0, 0], [0, 1], [2, 3], [1, 2]]], 2, 2))
    keys = table_keys(table, np.zeros((6, 1, 1), np.int32), np.full(6, 2))
    assert destination_slots(table, keys, np.arange(6)).ravel().tolist() == [0, 1, 2, 0, 1, 2]


def _random_plan(rng, nodes, gpus, slots_per_gpu, E, L):
    """Every expert once, the spare slots random replicas (so experts sit on several nodes)."""
    R = nodes * gpus
    slots = np.empty((L, R, slots_per_gpu), dtype=np.int64)
    for l in range(L):
        extra = rng.integers(0, E, R * slots_per_gpu - E)
        slots[l] = rng.permutation(np.concatenate([np.arange(E), extra])).reshape(R, slots_per_gpu)
    return plan_of(slots, nodes, gpus)


def test_node_aware_matches_brute_force_on_random_plans():
    from locus.routing.dispatch_rule import destination_slots, table_keys

    rng = np.random.default_rng(11)
    for nodes, gpus, slots_per_gpu, E, L, K in [(4, 2, 3, 9, 2, 4), (3, 2, 4, 7, 2, 3), (8, 1, 3, 10, 1, 6),
                                                (1, 4, 2, 8, 1, 2), (5, 2, 2, 6, 2, 5)]:
        plan = _random_plan(rng, nodes, gpus, slots_per_gpu, E, L)
        table = build_dispatch_table(plan, "node-aware")
        T = 80
        ids = rng.integers(-1, E, (T, L, K))
        src, pos = rng.integers(0, nodes * gpus, T), rng.integers(0, 50, T)
        got = route(table, ids, src, pos)
        slots = destination_slots(table, table_keys(table, ids.astype(np.int32), src), pos)
        for t in range(T):
            for l in range(L):
                want = reference_node_aware(plan.slots[l].tolist(), gpus, int(src[t]), ids[t, l].tolist(), int(pos[t]))
                assert got[t, l].tolist() == want, (nodes, gpus, t, l)
        ok = ids >= 0
        assert ((slots // slots_per_gpu == got) | ~ok).all() and (plan.slots.reshape(L, -1)[
            np.arange(L)[None, :, None], np.maximum(slots, 0)][ok] == ids[ok]).all()


def test_node_aware_joins_a_node_the_token_needs_anyway():
    # 3 nodes x 1 GPU. Expert 0 only on node 1; expert 1 on nodes 1 and 2; expert 2 only on node 2.
    slots = [[[3, 4], [0, 1], [1, 2]]]
    position, node_aware = (build_dispatch_table(plan_of(slots, 3, 1), r) for r in ("position", "node-aware"))
    for p in range(4):
        assert route(node_aware, [[0, 1]], [0], [p], layers=0).tolist() == [[1, 1]]  # one remote node
        assert route(node_aware, [[2, 1]], [0], [p], layers=0).tolist() == [[2, 2]]
    assert [route(position, [[0, 1]], [0], [p], layers=0).tolist() for p in range(2)] == [[[1, 1]], [[1, 2]]]
    # alone, expert 1 alternates between its two nodes by position, as under `position`
    assert [route(node_aware, [[1]], [0], [p], layers=0)[0, 0] for p in range(4)] == [1, 2, 1, 2]


def test_node_aware_reaches_no_more_nodes_than_position_and_is_minimal_with_one_extra_node():
    from itertools import combinations

    rng = np.random.default_rng(5)
    nodes, gpus, S, E, K = 6, 2, 3, 16, 6
    plan = _random_plan(rng, nodes, gpus, S, E, 1)
    tables = {r: build_dispatch_table(plan, r) for r in ("position", "node-aware")}
    T = 400
    ids, src, pos = rng.integers(0, E, (T, 1, K)), rng.integers(0, nodes * gpus, T), rng.integers(0, 99, T)
    count = {r: [len({d // gpus for d in row} - {s // gpus}) for row, s in zip(route(tab, ids, src, pos)[:, 0], src)]
             for r, tab in tables.items()}
    worse = 0
    for t in range(T):
        own = src[t] // gpus
        holders = [{r // gpus for r in range(nodes * gpus) if e in plan.slots[0, r]} for e in ids[t, 0]]
        remote = [h for h in holders if own not in h]
        best = next(n for n in range(K + 1) for c in combinations(range(nodes), n)
                    if all(h & set(c) for h in remote))
        forced = {next(iter(h)) for h in remote if len(h) == 1}
        assert count["node-aware"][t] >= best
        if best <= len(forced) + 1:
            assert count["node-aware"][t] == best, t
        worse += count["node-aware"][t] > best
    assert sum(count["node-aware"]) < sum(count["position"])
    assert worse <= T // 50  # greedy cover: rarely one node more than the minimum


def test_plan_names_its_dispatch_rule():
    from locus.routing.plan.placement import PlanError, plan_from_dict

    plan = plan_of(SLOTS, 2, 3)
    assert build_dispatch_table(plan).rule == "node-aware"  # the default
    plan.dispatch = "position"
    data = plan.to_dict()
    assert data["dispatch"] == "position" and build_dispatch_table(plan_from_dict(data)).rule == "position"
    assert build_dispatch_table(plan, "node-aware").rule == "node-aware"  # the caller's choice wins
    with pytest.raises(PlanError, match="dispatch is 'nearest'"):
        plan_from_dict({**data, "dispatch": "nearest"})
