"""The placement's lifecycle on one rank, owned by one object: the current `ExpertPlacement` (which the
layers read at call time), its epoch, a move in flight, the exchange counters of the epochs that
ended, and, on rank 0, the plan whose grouping admits requests.

Its methods are the only writers: `begin_move` (a live re-plan's target arrives), `advance_move`
(the next MoE layers switch: a new epoch), `regroup` (the survivors' placement after a lost rank: a
new epoch; a move under way died with the old group), `adopt_grouping` (rank 0 admits new requests
under a re-plan's grouping). Everything else reads (docs/design.md, "Expert-parallel serving").
"""

from __future__ import annotations

from typing import Protocol

from locus.engine.ep.counters import ExchangeCounters
from locus.engine.ep.placement import ExpertPlacement
from locus.routing.plan.placement import PlacementPlan


class Move(Protocol):
    """A move to a target placement (placement_move.py's PlacementMove)."""

    target: PlacementPlan

    @property
    def finished(self) -> bool: ...

    def advance(self, runtime) -> PlacementPlan:
        """Fill the slots of the next MoE layers; the plan with them switched."""


class PlacementState:
    def __init__(self, placement: ExpertPlacement):
        self._current = placement
        self._move: Move | None = None
        self._closed: dict[int, ExchangeCounters] = {}  # epoch -> counters, for the epochs that ended
        # rank 0: the plan whose grouping admits requests (None: balanced admission)
        self._grouping_plan: PlacementPlan | None = placement.plan if placement.plan.grouping else None

    # --- reading --------------------------------------------------------------------------------
    @property
    def current(self) -> ExpertPlacement:
        return self._current

    @property
    def epoch(self) -> int:
        return self._current.epoch

    @property
    def move(self) -> Move | None:
        return self._move

    @property
    def grouping_plan(self) -> PlacementPlan | None:
        return self._grouping_plan

    def counters_by_epoch(self, running: ExchangeCounters) -> dict[int, ExchangeCounters]:
        """The counters of every epoch this rank ran; `running` is what the current one counted so far."""
        out = dict(self._closed)
        out[self.epoch] = ExchangeCounters.total([out.get(self.epoch, ExchangeCounters()), running])
        return out

    def closed_total(self) -> ExchangeCounters:
        """The counters of every epoch that ended, summed."""
        return ExchangeCounters.total(self._closed.values())

    # --- writing --------------------------------------------------------------------------------
    def begin_move(self, move: Move) -> None:
        if self._move is not None:  # rank 0 never sends a re-plan during a move: a bug if it does
            raise RuntimeError("a re-plan arrived while a placement move was still in progress")
        self._move = move

    def advance_move(self, runtime) -> Move | None:
        """Switch the move's next MoE layers (every rank in the same iteration): a new epoch. Returns the
        move advanced (None when none is in flight); it is dropped once finished."""
        move = self._move
        if move is None:
            return None
        plan = move.advance(runtime)
        self._switch(plan, self._current.rank, self._current.epoch + 1, runtime.take_lane_counters())
        if move.finished:
            self._move = None
        return move

    def regroup(self, plan: PlacementPlan, rank: int, epoch: int, counted: ExchangeCounters) -> None:
        """The survivors' plan, this rank's new number in it and the epoch the survivors agreed on. A move
        under way died with the old group, and the survivors' plan has no grouping: admission is
        balanced from now on."""
        self._switch(plan, rank, epoch, counted)
        self._move = None
        self._grouping_plan = None

    def adopt_grouping(self, plan: PlacementPlan) -> None:
        """New admissions follow `plan`'s grouping (a re-plan's target), when admission follows a grouping
        at all and `plan` has one; requests already admitted finish where they run."""
        if self._grouping_plan is not None and plan.grouping:
            self._grouping_plan = plan

    def _switch(self, plan: PlacementPlan, rank: int, epoch: int, counted: ExchangeCounters) -> None:
        """Make `plan` the placement the layers read from the next forward on, under `epoch`; `counted`
        (the lanes' counters, drained) belongs to the epoch that ends."""
        old = self._current
        self._closed[old.epoch] = ExchangeCounters.total([self._closed.get(old.epoch, ExchangeCounters()), counted])
        self._current = ExpertPlacement.build(plan, rank, epoch, old.start.device)
