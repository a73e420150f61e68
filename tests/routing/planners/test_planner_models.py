"""The planner's building blocks: the expected-load model against the dispatch rule itself, GPU packing,
the cap search, replica selection."""

import numpy as np

from locus.routing.dispatch_rule import build_dispatch_table, route
from locus.routing.planners.gpu_packing import gpu_sums, pack_replicas
from locus.routing.planners.expected_load import node_loads, rank_loads, remote_share, replica_loads
from locus.routing.plan.placement import PlacementPlan, node_replicas
from locus.traces.metrics import max_over_mean
from locus.routing.planners.locality import place_layer
from locus.routing.planners.replica_selection import select_replicas, transfer_effects_batch
from locus.routing.planners.slot_search import enforce_cap
from locus.routing.plan.topology import Topology


def brute_force_loads(slots: np.ndarray, demand: np.ndarray, gpus: int) -> np.ndarray:
    """Expected rank loads by routing, through the real dispatch rule, every (source rank, expert,
    position) with a node's demand spread evenly over its ranks and over positions 0..P-1."""
    L, R, S = slots.shape
    N, E = demand.shape[1:]
    plan = PlacementPlan("toy", E, tuple(range(L)), Topology(N, gpus, S), slots)
    table = build_dispatch_table(plan)
    P = 2 * 3 * 4 * 5 * 7  # every replica count up to 8 divides it: each tier splits exactly evenly
    out = np.zeros((L, R))
    src = np.repeat(np.arange(R), P)
    pos = np.tile(np.arange(P), R)
    for l in range(L):
        for e in range(E):
            ids = np.full((len(src), 1), e)
            dest = route(table, ids, src, pos, layers=l)[:, 0]
            weight = demand[l, src // gpus, e] / gpus / P
            out[l] += np.bincount(dest, weights=weight, minlength=R)
    return out


def test_rank_loads_equal_the_dispatch_rule_in_expectation():
    rng = np.random.default_rng(0)
    N, G, S, E = 2, 3, 3, 7
    slots = rng.integers(0, E, (2, N * G, S))
    slots[:, 0, :] = [[0, 1, 2], [3, 4, 5]]
    slots[:, 1, 0] = 6  # every expert somewhere, some twice on one rank, some on both nodes
    demand = rng.random((2, N, E)) * 100
    np.testing.assert_allclose(rank_loads(slots, demand), brute_force_loads(slots, demand, G), rtol=1e-9)


def test_replica_loads_spread_remote_demand_over_all_copies():
    demand = np.array([[10.0, 4.0], [6.0, 2.0]])  # 2 nodes, 2 experts
    x = np.array([[1, 1], [2, 0]])  # expert 1 only on node 0
    loads = replica_loads(demand, x)
    np.testing.assert_allclose(loads, [[10 + 0, 4 + 2], [3, 0]])


def test_pack_replicas_fills_every_gpu_exactly_and_evens_loads():
    rng = np.random.default_rng(1)
    weights = rng.pareto(1.5, (20, 12)) + 0.1  # 20 rows, 4 GPUs x 3 slots
    gpu = pack_replicas(weights, 4)
    assert all((np.bincount(row, minlength=4) == 3).all() for row in gpu)
    sums = gpu_sums(weights, gpu, 4)
    # never worse than the largest single replica or the mean, whichever binds
    assert (sums.max(1) <= np.maximum(weights.max(1) + 2 * weights.min(1), sums.mean(1)) * 1.5).all()


def test_select_replicas_keeps_capacity_and_places_every_expert():
    rng = np.random.default_rng(2)
    demand = rng.pareto(1.0, (4, 30))
    x = select_replicas(demand, capacity=9)
    assert (x.sum(1) == 9).all() and (x.sum(0) >= 1).all()
    # a node holds the expert its own requests use most
    assert all(x[n, np.argmax(demand[n])] >= 1 for n in range(4))


def test_enforce_cap_brings_a_hot_node_under_the_target():
    N, G, S, E = 4, 2, 3, 16
    demand = np.ones((N, E))
    demand[0, 0] = 8.0  # node 0 loves expert 0: one copy would overload its GPU
    layer = place_layer(demand, G, S, cap=1.10)
    assert layer.met_cap and layer.imbalance <= 1.10
    x = node_replicas(layer.slots[None], N, E)[0]
    assert x[0, 0] >= 2  # split on its own node, where its demand is
    # Starting from round robin (expert 0 with its 8 + 3 pairs on rank 0), the search alone also gets there.
    slots = np.arange(N * G * S).reshape(N * G, S) % E
    assert float(max_over_mean(rank_loads(slots[None], demand[None]))[0]) > 1.4
    fixed = enforce_cap(demand, slots, G, 1.10 * demand.sum() / (N * G))
    assert float(max_over_mean(rank_loads(fixed[None], demand[None]))[0]) <= 1.10 + 1e-9
    assert (np.bincount(fixed.ravel(), minlength=E) >= 1).all()


def test_a_node_demand_no_placement_can_absorb_is_reported_as_missed():
    # Node 0's own demand for expert 0 (30 pairs) exceeds its whole share of the load (~1.1 x 45 / 2):
    # under the dispatch rule whichever node holds expert 0 for node 0 serves all of it.
    demand = np.ones((2, 8))
    demand[0, 0] = 30.0
    layer = place_layer(demand, 2, 3, cap=1.10)
    assert not layer.met_cap and layer.imbalance > 1.10


def _transfer_case(seed: int):
    """8 nodes x 64 experts of heavy-tailed demand, its replicas, and every (src, dst) node pair."""
    rng = np.random.default_rng(seed)
    N, E = 8, 64
    demand = rng.pareto(1.2, (N, E)) * 100
    x = select_replicas(demand, E // N + 3)
    rho = remote_share(demand, x)
    src = np.array([s for s in range(N) for d in range(N) if d != s])
    dst = np.array([d for s in range(N) for d in range(N) if d != s])
    return rng, N, E, demand, x, rho, src, dst


def test_a_transfers_figures_do_not_depend_on_its_batch():
    # balance_nodes scores all destination nodes in one batch; its near ties must break as they would
    # with each (src, dst) pair scored alone, so a pair's figures must be the same to the last bit.
    _, N, E, demand, x, rho, src, dst = _transfer_case(3)
    delta, local = transfer_effects_batch(demand, x, rho, src, dst)
    assert delta.shape == (len(src), E, N) and local.shape == (len(src), E)
    for i in range(len(src)):
        one_delta, one_local = transfer_effects_batch(demand, x, rho, src[i : i + 1], dst[i : i + 1])
        assert one_delta[0].tobytes() == delta[i].tobytes() and one_local[0].tobytes() == local[i].tobytes()
    # Moving expert e from src to dst changes src's and dst's loads by what node_loads says.
    s, d = 0, 1
    e = int(np.flatnonzero(x[s] >= 1)[0])
    moved = x.copy()
    moved[s, e] -= 1
    moved[d, e] += 1
    k = int(np.flatnonzero((src == s) & (dst == d))[0])
    np.testing.assert_allclose(node_loads(demand, moved) - node_loads(demand, x), delta[k, e], atol=1e-9)


def test_a_transfers_figures_for_named_experts_equal_the_full_batch():
    # best_swap asks only for the experts each side holds; those rows must equal the all-experts batch's
    # to the last bit, or its near ties would break differently.
    rng, N, E, demand, x, rho, src, dst = _transfer_case(4)
    full_delta, full_local = transfer_effects_batch(demand, x, rho, src, dst)
    experts = np.stack([rng.choice(E, 5, replace=False) for _ in src])
    delta, local = transfer_effects_batch(demand, x, rho, src, dst, experts)
    assert delta.shape == (len(src), 5, N) and local.shape == (len(src), 5)
    rows = np.arange(len(src))[:, None]
    assert delta.tobytes() == full_delta[rows, experts].tobytes()
    assert local.tobytes() == full_local[rows, experts].tobytes()
