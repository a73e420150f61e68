"""The cap search's bounded step (slot_search._bounded_move): candidates are scored exactly only while their
bound can still beat the best found; the move is the one scoring every candidate gives."""

import numpy as np
import pytest

from locus.routing.planners import slot_search
from locus.routing.planners.expected_load import rank_loads
from locus.routing.planners.locality import place_layer, sketch_layer
from locus.routing.planners.move_scores import ExpertState, overload_change, touched_ranks
from locus.routing.planners.slot_search import contributions, copies_per_rank, local_pairs
from locus.traces.metrics import max_over_mean


def _skewed_layer(rng, nodes, gpus, slots_per_gpu, experts):
    """Node demand with a few hot experts, as the presets have: what makes the sketch start over the cap."""
    popularity = rng.pareto(1.2, experts) + 0.05
    demand = rng.gamma(2.0, 1.0, (nodes, experts)) * popularity[None, :] * 10
    return demand, sketch_layer(demand, gpus, slots_per_gpu, 1.10)


def _state(slots, demand, gpus):
    E = demand.shape[1]
    dT = np.ascontiguousarray(demand.T)
    h = copies_per_rank(slots, E)
    contrib = contributions(dT, np.ascontiguousarray(h.T), gpus)
    return dT, h, contrib, contrib.sum(0)


def _figures(slots, demand, gpus, target):
    dT, h, contrib, loads = _state(slots, demand, gpus)
    return np.maximum(loads - target, 0.0).sum(), local_pairs(dT, np.ascontiguousarray(h.T), gpus).sum(), loads


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("batch", [1, 7, 256, 100_000])
def test_the_bounded_move_is_the_move_every_candidate_scored_gives(seed, batch):
    """Scoring only the candidates whose bound can still win takes the same move as scoring all of them
    (_best_move_touched), whatever the batch; and the move removes the overload it was scored with (the
    layout after it, scored from scratch)."""
    rng = np.random.default_rng(seed)
    N, G, S, E = 16, 8, 2, 128
    demand, slots = _skewed_layer(rng, N, G, S, E)
    dT, h, contrib, loads = _state(slots, demand, G)
    target = 1.10 * loads.mean()
    eps = 1e-6 * loads.mean()
    before = np.maximum(loads - target, 0.0).sum()
    assert before > eps  # the sketch starts over the cap
    every = slot_search._best_move_touched(dT, h, contrib, loads, slots, G, target, eps)
    bounded = slot_search._bounded_move(dT, h, contrib, loads, slots, G, target, eps, batch)
    assert bounded is not None and bounded == every
    after = slots.copy()
    for r, k, e in bounded:
        after[r, k] = e
    assert _figures(after, demand, G, target)[0] < before - eps


@pytest.mark.parametrize("seed", range(3))
def test_the_bound_is_never_below_the_overload_a_move_removes(seed):
    """And the local pairs that go with it are the exact scores' own."""
    rng = np.random.default_rng(10 + seed)
    N, G, S, E = 16, 8, 2, 128
    demand, slots = _skewed_layer(rng, N, G, S, E)
    dT, h, contrib, loads = _state(slots, demand, G)
    target = 1.05 * loads.mean()
    c = slot_search._candidates(h, slots, np.argsort(-loads)[:4])
    state = ExpertState.of(dT, np.ascontiguousarray(h.T), G)
    reduced, gain = overload_change(state, loads, contrib, target, *c.moves())
    bound, gain_bound = slot_search.bounds(state, c, np.maximum(loads - target, 0.0), contrib)
    np.testing.assert_allclose(gain_bound, gain, rtol=1e-12, atol=1e-9)
    assert (reduced <= bound * (1 + 1e-12) + 1e-9).all()
    assert (reduced > 0).any()


def test_a_move_changes_no_load_outside_its_touched_ranks():
    rng = np.random.default_rng(20)
    N, G, S, E = 16, 8, 2, 128
    demand, slots = _skewed_layer(rng, N, G, S, E)
    dT, h, contrib, loads = _state(slots, demand, G)
    c = slot_search._candidates(h, slots, np.array([int(np.argmax(loads))]))
    state = ExpertState.of(dT, np.ascontiguousarray(h.T), G)
    touched = touched_ranks(state, c.p, c.get_p, c.q, c.get_q)
    for k in rng.choice(len(c.owner), 40, replace=False):
        move = slot_search._moves_of((0.0, slot_search.KINDS[c.kind[k]], int(c.i[k]), int(c.j[k])), int(c.owner[k]),
                                     slots)
        after = slots.copy()
        for r, s, e in move:
            after[r, s] = e
        new = _state(after, demand, G)[3]
        outside = np.setdiff1d(np.arange(N * G), touched[k])
        np.testing.assert_allclose(new[outside], loads[outside], rtol=1e-12)


@pytest.mark.parametrize("seed", [31, 37])
def test_layers_placed_with_bounded_steps_meet_their_cap(seed):
    """At 128 ranks with 2 slots per GPU (the bounded step's regime: the sketch far over the cap), the
    search brings the layer under the cap. (Of seeds 30 to 37 these two are the ones the search meets,
    before and after the bounded step: the others stay over 1.10 either way.)"""
    rng = np.random.default_rng(seed)
    N, G, S, E = 16, 8, 2, 128
    demand, slots = _skewed_layer(rng, N, G, S, E)
    start = float(max_over_mean(rank_loads(slots[None], demand[None]))[0])
    assert start > 1.2
    layer = place_layer(demand, G, S, cap=1.10)
    assert layer.met_cap and layer.imbalance <= 1.10
    assert (np.bincount(layer.slots.ravel(), minlength=E) >= 1).all()
