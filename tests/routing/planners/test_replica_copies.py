"""More copies for the experts too heavy to pack (replica_copies.py), before the node balance and GPU packing."""

import numpy as np
import pytest

from locus.routing.planners import locality
from locus.routing.planners.expected_load import rank_loads, replica_loads
from locus.routing.planners.replica_copies import spread_heavy_experts
from locus.routing.planners.replica_selection import select_replicas
from locus.traces.metrics import max_over_mean


def _domains(rng, nodes, experts, hot=4):
    """Demand as at few slots per GPU: each node prefers its own block of experts, a few experts are hot
    everywhere, and the rest of the tail is used a little by every node."""
    demand = rng.gamma(1.0, 1.0, (nodes, experts))
    block = experts // nodes
    for n in range(nodes):
        demand[n, n * block : (n + 1) * block] *= 3.0
    demand[:, :hot] *= 1.5
    return demand


@pytest.mark.parametrize("seed", range(4))
def test_every_replica_ends_under_the_limit_with_each_nodes_slots_kept(seed):
    rng = np.random.default_rng(seed)
    N, G, S, E = 8, 4, 2, 32  # two slots an expert, as 256 experts on 32 x 8 GPUs x 2 slots
    demand = _domains(rng, N, E)
    x = select_replicas(demand, G * S)
    limit = 0.9 * 1.1 * demand.sum() / (N * G)
    assert replica_loads(demand, x).max() > limit  # the case needs the pass
    y = spread_heavy_experts(demand, x, limit)
    assert replica_loads(demand, y).max() <= limit
    np.testing.assert_array_equal(y.sum(1), x.sum(1))  # every node keeps its slot count
    assert (y.sum(0) >= 1).all() and (y >= 0).all()  # every expert still held somewhere


def test_nothing_changes_when_no_replica_is_over_the_limit():
    rng = np.random.default_rng(7)
    demand = _domains(rng, 4, 32)
    x = select_replicas(demand, 12)
    limit = replica_loads(demand, x).max()
    np.testing.assert_array_equal(spread_heavy_experts(demand, x, limit), x)


def test_a_copy_goes_where_its_expert_gains_the_most_local_pairs():
    # Expert 0 is heavy and held on node 0 only; node 2 wants it most among the others, and each node has a
    # spare second copy (expert 1 on node 1, expert 2 on node 2) that costs no local pairs to give up.
    demand = np.array([[50.0, 1.0, 1.0, 1.0], [5.0, 1.0, 1.0, 1.0], [20.0, 1.0, 1.0, 1.0]])
    x = np.array([[1, 1, 0, 1], [0, 2, 1, 0], [0, 1, 2, 0]])
    y = spread_heavy_experts(demand, x, limit=60.0, max_copies=1)
    assert y[2, 0] == 1 and y[2, 2] == 1  # node 2's spare copy of expert 2 made room
    np.testing.assert_array_equal(np.delete(y, 2, 0), np.delete(x, 2, 0))


def test_a_non_positive_limit_is_refused():
    with pytest.raises(ValueError, match="limit"):
        spread_heavy_experts(np.ones((2, 4)), np.ones((2, 4), dtype=np.int64), 0.0)


def test_the_first_start_is_closer_to_the_cap_and_the_cap_is_still_met():
    rng = np.random.default_rng(11)
    N, G, S, E = 8, 4, 2, 32
    demand = _domains(rng, N, E)
    starts = list(locality.sketch_starts(demand, G, S, 1.10))
    assert len(starts) == 2  # with more copies first, then without
    worst = [float(max_over_mean(rank_loads(s[None], demand[None]))[0]) for s in starts]
    assert worst[0] < worst[1]
    assert locality.place_layer(demand, G, S, 1.10).met_cap


def test_one_start_where_no_replica_is_too_heavy():
    # many slots per GPU: every replica light enough, so the placement is the one without this pass
    rng = np.random.default_rng(12)
    demand = _domains(rng, 2, 32)
    assert len(list(locality.sketch_starts(demand, 4, 8, 1.10))) == 1


def test_the_search_falls_back_to_the_start_without_copies(monkeypatch):
    # When the search misses the cap from the first start, the second is searched, and the placement is
    # the first to meet the cap.
    rng = np.random.default_rng(11)
    N, G, S, E = 8, 4, 2, 32
    demand = _domains(rng, N, E)
    starts = list(locality.sketch_starts(demand, G, S, 1.10))
    searched = []
    real = locality.enforce_cap

    def first_fails(demand, slots, gpus, target, **kw):
        searched.append(slots.copy())
        return slots if len(searched) == 1 else real(demand, slots, gpus, target, **kw)

    monkeypatch.setattr(locality, "enforce_cap", first_fails)
    layer = locality.place_layer(demand, G, S, 1.10)
    assert len(searched) == 2 and all(np.array_equal(a, b) for a, b in zip(searched, starts))
    assert layer.met_cap
