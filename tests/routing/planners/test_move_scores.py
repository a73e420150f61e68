"""The cap search's moves scored on the ranks they touch (move_scores.py) against the moves applied."""

import numpy as np
import pytest

from locus.routing.planners import slot_search
from locus.routing.planners.move_scores import ExpertState, overload_change
from locus.routing.planners.slot_search import contributions, copies_per_rank, local_pairs


def _layout(rng, nodes, gpus, slots_per_gpu, experts):
    R = nodes * gpus
    flat = np.concatenate([np.arange(experts), rng.integers(0, experts, R * slots_per_gpu - experts)])
    rng.shuffle(flat)
    # a hot expert with many copies, as at few slots per GPU
    flat[rng.choice(R * slots_per_gpu, size=R * slots_per_gpu // 3, replace=False)[experts:]] = 0
    slots = flat.reshape(R, slots_per_gpu)
    return slots, rng.gamma(0.5, 10.0, (nodes, experts))


def _figures(slots, demand, gpus, target):
    """Overload (sum over ranks above target) and local pairs of a layout, computed from scratch."""
    E = demand.shape[1]
    dT, hT = np.ascontiguousarray(demand.T), np.ascontiguousarray(copies_per_rank(slots, E).T)
    loads = contributions(dT, hT, gpus).sum(0)
    return np.maximum(loads - target, 0.0).sum(), local_pairs(dT, hT, gpus).sum()


def _state(slots, demand, gpus):
    E = demand.shape[1]
    dT = np.ascontiguousarray(demand.T)
    h = copies_per_rank(slots, E)
    contrib = contributions(dT, np.ascontiguousarray(h.T), gpus)
    return ExpertState.of(dT, np.ascontiguousarray(h.T), gpus), contrib, contrib.sum(0), h


@pytest.mark.parametrize("seed", range(6))
def test_scores_equal_the_moves_applied(seed):
    """Every kind of move (swap, spread, shed) on random layouts: the overload removed and the local pairs
    gained, summed over the touched ranks only, equal the figures of the layout after the move."""
    rng = np.random.default_rng(seed)
    N, G, S, E = 3, 4, 3, 14
    slots, demand = _layout(rng, N, G, S, E)
    R = N * G
    state, contrib, loads, h = _state(slots, demand, G)
    target = 0.95 * loads.mean()
    before, local_before = _figures(slots, demand, G, target)
    total = h.sum(0)
    moves, expected = [], []
    for _ in range(60):
        w, r2 = rng.choice(R, 2, replace=False)
        i, k = rng.integers(S), rng.integers(S)
        a, other = slots[w, i], slots[r2, k]
        kind = rng.integers(3)
        after = slots.copy()
        if kind == 0 and a != other:  # swap
            after[w, i], after[r2, k] = other, a
            moves.append((a, w, r2, other, r2, w))
        elif kind == 1 and a != other and total[other] >= 2:  # spread: r2's copy of other becomes a copy of a
            after[r2, k] = a
            moves.append((a, -1, r2, other, r2, -1))
        elif kind == 2 and total[a] >= 2:  # shed: w's copy of a becomes a copy of f
            f = int(rng.integers(E))
            if f == a:
                continue
            after[w, i] = f
            moves.append((a, w, -1, f, -1, w))
        else:
            continue
        over, local = _figures(after, demand, G, target)
        expected.append((before - over, local - local_before))
    cols = [np.array(c) for c in zip(*moves)]
    reduced, gain = overload_change(state, loads, contrib, target, *cols)
    np.testing.assert_allclose(reduced, [e[0] for e in expected], rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(gain, [e[1] for e in expected], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("seed", range(4))
def test_touched_search_step_finds_the_dense_steps_best(seed):
    """A search step scored on the touched ranks takes a move exactly as good as the dense scores' best
    (equal moves may differ only where two tie)."""
    rng = np.random.default_rng(100 + seed)
    N, G, S, E = 4, 4, 2, 20
    slots, demand = _layout(rng, N, G, S, E)
    state, contrib, loads, h = _state(slots, demand, G)
    target = 1.02 * loads.mean()
    eps = 1e-6 * loads.mean()
    dT = np.ascontiguousarray(demand.T)
    ones = np.ones((E, N, N))  # the dense path under an even pull: the same load model
    excess = np.maximum(loads - target, 0.0).sum()
    assert excess > eps
    dense = slot_search._best_move(dT, h, contrib, loads, slots, G, target, excess, eps, ones)
    touched = slot_search._best_move_touched(dT, h, contrib, loads, slots, G, target, eps)
    assert dense is not None and touched is not None

    def score(move):
        after = slots.copy()
        for r, k, e in move:
            after[r, k] = e
        over, local = _figures(after, demand, G, target)
        lost = max(_figures(slots, demand, G, target)[1] - local, 0.0)
        return (excess - over) / (lost + eps)

    assert score(touched) == pytest.approx(score(dense), rel=1e-9)


@pytest.mark.parametrize("seed", range(4))
def test_refreshed_state_equals_the_state_built_afresh(seed):
    """ExpertState.refreshed after random moves (the hot expert gaining and losing copies, so the holders'
    width changes too) holds exactly the figures ExpertState.of computes on the new copies."""
    rng = np.random.default_rng(200 + seed)
    N, G, S, E = 3, 4, 3, 14
    slots, demand = _layout(rng, N, G, S, E)
    R = N * G
    dT = np.ascontiguousarray(demand.T)
    hT = np.ascontiguousarray(copies_per_rank(slots, E).T)
    state = ExpertState.of(dT, hT, G)
    widths = {state.holders.shape[1]}
    for _ in range(40):
        r, k = int(rng.integers(R)), int(rng.integers(S))
        old, new = int(slots[r, k]), int(rng.choice([0, rng.integers(E)]))
        if old == new or hT[old].sum() < 2:
            continue
        slots[r, k] = new
        hT[old, r] -= 1
        hT[new, r] += 1
        state = state.refreshed(np.unique([old, new]))
        widths.add(state.holders.shape[1])
        fresh = ExpertState.of(dT, hT.copy(), G)
        for name in ("x", "with_e", "remote", "total", "holders", "holding"):
            np.testing.assert_array_equal(getattr(state, name), getattr(fresh, name), err_msg=name)
    assert len(widths) > 1
