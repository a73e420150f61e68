"""What every expert-parallel layer of one model shares, and how a step's forwards run in lockstep.

`EPRuntime` holds the placement's state (placement_state.py: the placement the layers read at call
time, swapped as one object; its epoch; a move in flight; the counters of ended epochs), one
exchange per lane, the positions of the forward each lane is running (the dispatch rule's tie-break),
and the step's transport. It is also the engine's `Lockstep`: every rank runs the same number of
forwards in every step that any rank has work (`forwards_per_step`, fixed by configuration, so no
collective agrees on it), and a forward with no tokens of this rank's own still takes part in every
MoE layer's exchange (`idle`), because other ranks' tokens may come here to be computed.

With `--ep-overlap` there are two lanes: a step's tokens are split into two micro-batches, and lane 1
runs its micro-batch in a second thread while lane 0 runs the other; each lane has its own process
groups, so one lane's attention and local experts run while the other's dispatch or combine is on
the wire (SGLang's two-batch overlap, DeepSeek's dual micro-batch), and the collectives of a lane are
issued in the same order on every rank.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

import torch

from locus.engine.ep.counters import ExchangeCounters, StepTimes
from locus.engine.ep.exchange import TwoTierExchange
from locus.engine.ep.groups import Groups
from locus.engine.ep.invariant import BROKEN, wrong_slots
from locus.engine.ep.placement import ExpertPlacement
from locus.engine.ep.placement_state import PlacementState
from locus.engine.ep.transport import TRANSPORTS
from locus.kernels.formats import PAYLOAD_FORMATS

log = logging.getLogger("locus.engine")
R = TypeVar("R")
MODES = ("exact", "fixed")


class EPRuntime:
    def __init__(self, groups: Groups, placement: ExpertPlacement, mode: str = "exact",
                 max_tokens_per_rank: int = 256, device: torch.device | str = "cpu",
                 dispatch_format: str = "model", combine_format: str = "model"):
        if mode not in MODES:
            raise ValueError(f"unknown exchange mode {mode!r}; choose one of {', '.join(MODES)}")
        for what, fmt in (("dispatch", dispatch_format), ("combine", combine_format)):
            if fmt not in PAYLOAD_FORMATS:
                raise ValueError(f"unknown {what} format {fmt!r}; choose one of {', '.join(PAYLOAD_FORMATS)}")
        self.groups, self.mode = groups, mode
        self.state = PlacementState(placement)  # the only writer of the placement, its epoch, a move
        self.loop_nice = groups.loop_nice  # kept for the groups of a regroup (elastic.py)
        self.max_tokens_per_rank = max_tokens_per_rank
        self.dispatch_format, self.combine_format = dispatch_format, combine_format  # payload.py
        self.transports = {name: cls() for name, cls in TRANSPORTS.items()}
        self.lanes = self._lanes(groups, device)
        # What lanes a regroup dropped had counted in the current epoch (it closes with the regroup),
        # and each lane's mark at the start of the step under way (None between steps): a step that
        # fails half-way is rewound to it, so a regroup keeps every completed step's counts, no more.
        self._dropped = ExchangeCounters()
        self._step_marks: list | None = None
        self.layers: list = []  # the ExpertParallelMoE layers, in forward order (set by apply_expert_parallel)
        self.capacity = 0  # the step's largest token count on any rank (the fixed transport's block size)
        self.times = StepTimes()
        self.memory = None  # what this rank's expert weights take (set at start-up)
        self.fingerprints = None  # [L, E] every expert's reference fingerprint (invariant.py), set at start-up
        self.weights_ok = True  # every slot holds its expert's weights (checked after each placement change)
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="locus-ep-lane") if len(self.lanes) > 1 else None

    # --- per step -------------------------------------------------------------------------------
    @property
    def overlap(self) -> bool:
        return len(self.lanes) > 1

    @property
    def forwards_per_step(self) -> int:
        return len(self.lanes)

    def begin_step(self, capacity: int) -> str:
        """Choose the step's transport from the largest token count any rank may run (every rank
        computes the same choice from the same control header). Returns its name."""
        name = "fixed" if self.mode == "fixed" and 0 < capacity <= self.max_tokens_per_rank else "exact"
        self.capacity = capacity
        for lane in self.lanes:
            lane.transport = self.transports[name]
        self._step_marks = [lane.mark() for lane in self.lanes]
        return name

    def end_step(self) -> None:
        """The step's forwards all ran: what they counted stays, whatever fails next."""
        self._step_marks = None

    # --- the engine's Lockstep ------------------------------------------------------------------
    def run_forwards(self, micro_batches: list, forward: Callable[[list], R]) -> list[R]:
        """Run this rank's micro-batches as the step's forwards, idling where it has fewer than
        `forwards_per_step`; with overlap, lane 1's forward runs in the second thread."""
        if len(micro_batches) > self.forwards_per_step:
            raise RuntimeError(f"{len(micro_batches)} micro-batches; expert parallelism runs {self.forwards_per_step} a step")
        if not self.overlap:
            results = [forward(mb) for mb in micro_batches]
            for _ in range(self.forwards_per_step - len(micro_batches)):
                self.idle(0)
            return results
        work = list(micro_batches) + [None] * (self.forwards_per_step - len(micro_batches))
        second = self._pool.submit(self._on_lane, 1, work[1], forward)
        try:
            first = self._on_lane(0, work[0], forward)
        finally:
            other = second.result()  # joins lane 1 even when lane 0 raised (its collectives fail too)
        return [r for r in (first, other) if r is not None]

    def _on_lane(self, lane: int, items, forward):
        self._local.lane = lane
        if items is None:
            self.idle(lane)
            return None
        return forward(items)

    def idle(self, lane: int = 0) -> None:
        """A forward with no tokens: every MoE layer's exchange, in order, with empty tensors."""
        self._local.lane = lane
        for layer in self.layers:
            layer.exchange_nothing()

    @property
    def placement(self) -> ExpertPlacement:
        """The placement the layers read now (a new object at every epoch)."""
        return self.state.current

    @property
    def move(self):
        """A placement move in flight (placement_move.py), advanced by the worker before each step."""
        return self.state.move

    def advance_move(self):
        """Switch the next MoE layers of a move in flight (every rank, in the same iteration, before its
        header), then check that this rank's slots of them hold their experts. Returns the move (None:
        none in flight)."""
        move = self.state.advance_move(self)
        if move is not None:
            self.check_weights(move.last_switched)
        return move

    def placement_now(self):
        """The current placement's epoch and plan (what a trace recorder keeps per trace token)."""
        placement = self.placement
        return placement.epoch, placement.plan

    # --- what the layers read -------------------------------------------------------------------
    def lane(self) -> TwoTierExchange:
        return self.lanes[getattr(self._local, "lane", 0)]

    @property
    def positions(self) -> torch.Tensor | None:
        return getattr(self._local, "positions", None)

    @positions.setter
    def positions(self, value: torch.Tensor | None) -> None:
        self._local.positions = value

    @property
    def padded(self) -> bool:
        """Whether the lane's forward is a padded decode batch (tokens at position -1 are padding)."""
        return getattr(self._local, "padded", False)

    @padded.setter
    def padded(self, value: bool) -> None:
        self._local.padded = value

    def served_digest(self) -> int:
        """What this rank's control header says it will step under (invariant.py)."""
        return self.placement.digest if self.weights_ok else BROKEN

    def check_weights(self, moe_indices=None) -> None:
        """After a placement change: do this rank's slots of the MoE layers at `moe_indices` (default all)
        hold their experts?"""
        wrong = wrong_slots(self, moe_indices)
        if wrong:
            log.error("rank %d: slots of (MoE index, expert) %s do not hold their expert's weights after a placement "
                      "change; this rank will not step", self.groups.rank if self.groups else -1, wrong[:8])
            self.weights_ok = False

    def take_lane_counters(self) -> ExchangeCounters:
        """What the lanes counted since the last call (the epoch that ends), their counters reset."""
        total = self._lanes_total()
        for lane in self.lanes:
            lane.counters = ExchangeCounters()
        self._dropped = ExchangeCounters()
        return total

    def drop_lanes(self) -> None:
        """A regroup leaves the old process groups, and with them the lanes; what the lanes counted is
        kept for the epoch that the regroup closes (counters never run backwards), less a step that
        failed half-way (run again after the regroup, and counted then)."""
        if self._step_marks is not None:
            for lane, mark in zip(self.lanes, self._step_marks):
                lane.rewind(mark)
            self._step_marks = None
        self._dropped = self._lanes_total()
        self.lanes = []

    def regroup(self, groups: Groups, plan, rank: int, epoch: int, device: torch.device | str = "cpu") -> None:
        """After a lost rank: the survivors' process groups (new lanes), and their plan with this rank's
        number in it under `epoch` (the placement state's new epoch; a move under way died with the old
        group)."""
        self.state.regroup(plan, rank, epoch, self.take_lane_counters())
        self.groups = groups
        self.lanes = self._lanes(groups, device)
        # What lanes a regroup dropped had counted in the current epoch (it closes with the regroup),
        # and each lane's mark at the start of the step under way (None between steps): a step that
        # fails half-way is rewound to it, so a regroup keeps every completed step's counts, no more.
        self._dropped = ExchangeCounters()
        self._step_marks: list | None = None

    def _lanes(self, groups: Groups, device: torch.device | str) -> list[TwoTierExchange]:
        return [TwoTierExchange(groups, lane, self.transports["exact"], device, self.dispatch_format, self.combine_format)
                for lane in groups.lanes]

    # --- counters -------------------------------------------------------------------------------
    def _lanes_total(self) -> ExchangeCounters:
        """What the current epoch has counted so far: its lanes', and those of lanes a regroup dropped."""
        return ExchangeCounters.total([self._dropped, *(lane.drain() for lane in self.lanes)])

    def counters(self) -> ExchangeCounters:
        """Every lane's counters over every epoch, summed (device-side counts read now)."""
        return ExchangeCounters.total([self.state.closed_total(), self._lanes_total()])

    def counters_by_epoch(self) -> dict[int, ExchangeCounters]:
        """The counters of each placement epoch this rank ran."""
        return self.state.counters_by_epoch(self._lanes_total())

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False)
