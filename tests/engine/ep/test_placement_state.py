"""The placement's lifecycle has one owner (locus/engine/ep/placement_state.py): a move begins, advances
one epoch per group of MoE layers and ends; a regroup after a lost rank is a new epoch that drops the
move and the grouping; each ended epoch keeps the counters it ran with."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from locus.engine.ep.counters import ExchangeCounters
from locus.engine.ep.placement import ExpertPlacement
from locus.engine.ep.placement_state import PlacementState
from locus.routing.plan.topology import Topology
from locus.routing.planners.baselines import round_robin

TOPOLOGY = Topology(1, 2, 2)
LAYERS = (0, 1, 2)


def plan_of(shift: int = 0, grouping: dict | None = None):
    plan = round_robin(4, LAYERS, TOPOLOGY)
    return replace(plan, slots=(plan.slots + shift) % 4, grouping=grouping)


class FakeRuntime:
    """What a move and the state read of the runtime: the lanes' counters, drained on each switch."""

    def __init__(self):
        self.counted = 0

    def take_lane_counters(self) -> ExchangeCounters:
        self.counted += 1
        return ExchangeCounters(inter_node_dispatch=self.counted)


class FakeMove:
    """Switches one MoE layer an advance, to the target's slots."""

    def __init__(self, state: PlacementState, target):
        self.state, self.target, self.done = state, target, 0

    @property
    def finished(self) -> bool:
        return self.done >= len(self.target.moe_layers)

    def advance(self, runtime):
        slots = np.array(self.state.current.plan.slots, copy=True)
        slots[self.done] = self.target.slots[self.done]
        self.done += 1
        return replace(self.target, slots=slots)


def test_a_move_advances_one_epoch_per_step_keeps_each_epochs_counters_and_ends():
    state = PlacementState(ExpertPlacement.build(plan_of(), 0))
    runtime, target = FakeRuntime(), plan_of(1)
    move = FakeMove(state, target)
    state.begin_move(move)
    with pytest.raises(RuntimeError, match="still in progress"):
        state.begin_move(FakeMove(state, target))
    epochs = []
    while state.move is not None:
        assert state.advance_move(runtime) is move
        epochs.append(state.epoch)
    assert epochs == [1, 2, 3] and move.finished
    assert np.array_equal(state.current.plan.slots, target.slots)
    assert state.advance_move(runtime) is None  # nothing in flight: nothing changes
    got = state.counters_by_epoch(ExchangeCounters(inter_node_dispatch=100))
    assert {e: c.inter_node_dispatch for e, c in got.items()} == {0: 1, 1: 2, 2: 3, 3: 100}
    assert state.closed_total().inter_node_dispatch == 6


def test_a_regroup_is_a_new_epoch_that_drops_the_move_and_the_grouping():
    grouped = plan_of(grouping={"kind": "test"})
    state = PlacementState(ExpertPlacement.build(grouped, 1))
    assert state.grouping_plan is grouped
    state.begin_move(FakeMove(state, plan_of(1)))
    survivors = round_robin(4, LAYERS, Topology(1, 1, 4))
    state.regroup(survivors, 0, 3, ExchangeCounters(intra_node_combine=7))  # epoch 3: the survivors' highest + 1
    assert state.move is None and state.grouping_plan is None
    assert state.epoch == 3 and state.current.rank == 0 and state.current.plan is survivors
    assert state.counters_by_epoch(ExchangeCounters())[0].intra_node_combine == 7
    state.adopt_grouping(plan_of(grouping={"kind": "test"}))  # balanced admission stays balanced
    assert state.grouping_plan is None


def test_admission_follows_a_new_grouping_only_where_it_followed_one():
    grouped = plan_of(grouping={"kind": "a"})
    state = PlacementState(ExpertPlacement.build(grouped, 0))
    state.adopt_grouping(plan_of(1))  # the target has no grouping: the old one stays
    assert state.grouping_plan is grouped
    newer = plan_of(1, grouping={"kind": "b"})
    state.adopt_grouping(newer)
    assert state.grouping_plan is newer
    balanced = PlacementState(ExpertPlacement.build(plan_of(), 0))
    balanced.adopt_grouping(newer)
    assert balanced.grouping_plan is None
