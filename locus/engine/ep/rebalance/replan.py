"""Live re-planning, rank 0's side: when to re-plan, from what, and whether the result is worth moving.

    idle --(every N steps / seconds, or POST /ep/replan)--> collecting: every rank sends its routing window
    collecting --(every window in)--> planning: a thread writes the windows as a trace, runs the plan's own
        planner on the same topology and slot count, aligns the result to the current plan (placement_move.py), and
        replays the window under both (`locus replay --assign recorded`, in process)
    planning --(decided)--> moving: a Replan command to every rank (or idle, if not worth it)
    moving --(the last layer switched)--> idle

Worth it: the replay's inter-node bytes per token saved, times the tokens expected before the next
re-plan (the window's rate), must exceed the bytes the move sends (expert weights of every changed
slot, from a holder on the same node where there is one). A forced re-plan (POST /ep/replan with
force) moves even when it is not. Both figures are logged and returned.

Planning runs off the step loop: serving never waits on it.
"""

from __future__ import annotations

import logging
import tempfile
import threading
import time
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from pathlib import Path

from locus.engine.ep.placement_move import align, move_bytes
from locus.engine.ep.routing_window import WindowTokens, write_window_trace
from locus.errors import LocusError
from locus.traces.format import TraceMeta

log = logging.getLogger("locus.engine")


class ReplanBusy(LocusError):
    """A re-plan was asked for while another is being made or moved."""


class ReplanAborted(LocusError):
    """The ranks regrouped (a rank was lost) while a re-plan was being made: it was for another
    membership, so it was discarded and nothing moved."""


MIN_REPLAN_SECONDS = 1.0  # --replan-every below this would re-plan back to back (each takes a window and a plan)


@dataclass
class Replan:
    """Move to `plan` (a placement plan as a JSON object, aligned to the current one), `layers_per_step`
    MoE layers an iteration, starting in the iteration this command arrives (every rank alike)."""

    plan: dict
    layers_per_step: int
    base: int = 0  # the digest of the placement it was made from and aligned to (invariant.py)


@dataclass
class ReplanDecision:
    applied: bool
    reason: str
    planner: str
    window_tokens: int
    old_inter_node_per_token: float  # the window replayed under the current plan
    new_inter_node_per_token: float  # ... under the new one
    expected_tokens: float  # tokens until the next re-plan, at the window's rate
    predicted_saving_bytes: float  # (old - new) * expected_tokens
    move_bytes: int  # expert weights the move sends (intra- and inter-node)
    move_inter_node_bytes: int
    moved_slots: int
    plan_seconds: float
    epoch: int | None = None  # the first epoch of the new placement, when applied

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class ReplanSchedule:
    """--replan-every: every `steps` iterations that ran a step, or every `seconds`; None: on request only."""

    steps: int | None = None
    seconds: float | None = None

    @classmethod
    def parse(cls, text: str | None) -> "ReplanSchedule":
        if text is None:
            return cls()
        value = text.strip().lower()
        try:
            if value.endswith("steps"):
                steps = int(value.removesuffix("steps"))
                if steps < 1:
                    raise ValueError
                return cls(steps=steps)
            seconds = float(value.removesuffix("s"))
            if not seconds > 0 or seconds == float("inf"):
                raise ValueError
        except ValueError:
            raise LocusError(f"--replan-every {text!r}: give seconds (e.g. 60 or 60s) or a step count (e.g. 500steps)") from None
        if seconds < MIN_REPLAN_SECONDS:
            raise LocusError(f"--replan-every {text!r}: at least {MIN_REPLAN_SECONDS:g} s between re-plans (each collects "
                             "every rank's window and runs the planner); use a step count for a finer schedule")
        return cls(seconds=seconds)

    @property
    def active(self) -> bool:
        return self.steps is not None or self.seconds is not None


class Replanner:
    """Owned by EPDriver (rank 0's engine thread); the HTTP thread only calls `request`."""

    def __init__(self, driver, meta: TraceMeta, schedule: ReplanSchedule, layers_per_step: int = 1,
                 expert_bytes: int = 0):
        self.driver, self.meta, self.schedule = driver, meta, schedule
        self.layers_per_step = layers_per_step
        self.expert_bytes = expert_bytes  # one expert's weights (gate_up + down), as the ranks hold them
        self.state = "idle"
        self._lock = threading.Lock()
        self._pending: list[Future] = []  # callers waiting for the decision
        self._force = False
        self._windows: dict[int, WindowTokens] = {}
        self._planning: Future | None = None
        self._running: Future | None = None  # the last planning thread's result (a discarded one included)
        self._steps_since = 0
        self._last = time.monotonic()
        self._tokens_at_last = 0
        self._tokens_at_due = 0  # tokens run when the schedule last fired: an idle period re-plans nothing
        self._planned_from = 0  # the digest of the placement the re-plan under way is made from
        self.decisions: list[ReplanDecision] = []
        self._closed = False

    # --- the HTTP thread --------------------------------------------------------------------------
    def request(self, force: bool) -> Future:
        """Start a re-plan now; the future gets the ReplanDecision. ReplanBusy while one is under way."""
        with self._lock:
            if self.state != "idle" or self.driver.runtime.move is not None:
                raise ReplanBusy(f"a re-plan is already {self.state if self.state != 'idle' else 'moving'}")
            future: Future = Future()
            self._pending.append(future)
            self._force = force
            self.state = "requested"
        return future

    # --- the engine thread (EPDriver.step) --------------------------------------------------------
    def before_iteration(self, stepped: bool) -> None:
        """Trigger by schedule; ask the ranks for their windows when a re-plan starts."""
        with self._lock:
            if stepped:
                self._steps_since += 1
            if self.state == "idle" and self._due():
                ran = self.driver.tokens_run()
                if ran == self._tokens_at_due:  # nothing ran since: no window to plan from, nothing to say
                    self._reset_clock()
                    return
                self._tokens_at_due = ran
                self.state, self._force = "requested", False
            if self.state == "requested":
                self.state = "collecting"
                self._windows = {0: self.driver.worker.window_tokens()}
                for rank in range(1, self.driver.world):
                    self.driver.command(rank).send_window = True

    def take_window(self, rank: int, window: WindowTokens) -> None:
        with self._lock:
            if self.state != "collecting":
                return
            self._windows[rank] = window
            if len(self._windows) == self.driver.world:
                self.state = "planning"
                windows, force = dict(self._windows), self._force
                current = self.driver.runtime.placement.plan
                self._planned_from = self.driver.runtime.placement.digest
                self._planning = self._running = Future()
                threading.Thread(target=self._plan, args=(windows, current, force, self._planning),
                                 name="locus-replan", daemon=True).start()

    def after_iteration(self) -> None:
        """Hand a decided re-plan to every rank; notice when a move is over."""
        with self._lock:
            if self.state == "planning" and self._planning is not None and self._planning.done():
                decision, target = self._finish_planning()
                if decision is not None and decision.applied and self._planned_from != self.driver.runtime.placement.digest:
                    self._discard("the placement changed while the re-plan was being made")  # never sent
                    return
                if decision is not None and decision.applied:
                    for rank in range(self.driver.world):
                        self.driver.command(rank).replan = Replan(target.to_dict(), self.layers_per_step,
                                                                  self._planned_from)
                    decision.epoch = self.driver.runtime.placement.epoch + 1
                    self.driver.adopt_grouping(target)
                    self.state = "moving"
                else:
                    self.state = "idle"
                if decision is not None:
                    self._settle(decision)
            elif self.state == "moving" and self.driver.runtime.move is None and not self.driver.has_replan_queued():
                self.state = "idle"
                self._reset_clock()

    def membership_changed(self) -> None:
        """The ranks regrouped after a loss (EPDriver.recover): a re-plan being collected or made was for
        the old membership and is discarded (its windows and decision with it); a move under way died
        with the old group. Nothing of it reaches the survivors."""
        with self._lock:
            if self.state in ("requested", "collecting", "planning"):
                self._discard("a rank was lost while it was being made; the survivors' placement stands")
            elif self.state == "moving":
                self.state = "idle"
                self._reset_clock()

    def _discard(self, why: str) -> None:
        log.warning("re-plan discarded, nothing moved: %s", why)
        self._planning, self._windows, self.state = None, {}, "idle"
        for waiting in self._pending:
            waiting.set_exception(ReplanAborted(f"re-plan discarded, nothing moved: {why}"))
        self._pending.clear()
        self._reset_clock()

    def close(self) -> None:
        """At shutdown: let the planning thread finish its files (briefly), then remove them."""
        self._closed = True
        planning = self._running
        if planning is not None:
            try:
                planning.exception(timeout=5)
            except Exception:  # noqa: BLE001 - still running: its directory goes anyway
                pass

    # --- helpers ----------------------------------------------------------------------------------
    def _due(self) -> bool:
        s = self.schedule
        if s.steps is not None and self._steps_since >= s.steps:
            return True
        return s.seconds is not None and time.monotonic() - self._last >= s.seconds

    def _reset_clock(self) -> None:
        self._steps_since, self._last = 0, time.monotonic()

    def _finish_planning(self):
        future, self._planning = self._planning, None
        try:
            return future.result()
        except Exception as exc:  # noqa: BLE001 - a failed plan fails the request, never the server
            if isinstance(exc, LocusError):  # an expected refusal (an empty window, a plan that does not fit)
                log.warning("re-plan not made, the placement stays: %s", exc)
            else:
                log.exception("re-plan failed; the placement stays")
            for waiting in self._pending:
                waiting.set_exception(exc)
            self._pending.clear()
            self._reset_clock()
            return None, None

    def _settle(self, decision: ReplanDecision) -> None:
        self.decisions.append(decision)
        log.info("re-plan (%s): %s; window %d tokens, inter-node B/token %.1f -> %.1f, predicted saving %.0f B over "
                 "%.0f tokens, move %d B (%d slots)", decision.planner, decision.reason, decision.window_tokens,
                 decision.old_inter_node_per_token, decision.new_inter_node_per_token,
                 decision.predicted_saving_bytes, decision.expected_tokens, decision.move_bytes, decision.moved_slots)
        for waiting in self._pending:
            waiting.set_result(decision)
        self._pending.clear()
        if not decision.applied:
            self._reset_clock()

    def _plan(self, windows: dict[int, WindowTokens], current, force: bool, out: Future) -> None:
        try:
            out.set_result(self._decide(windows, current, force))
        except BaseException as exc:  # noqa: BLE001
            out.set_exception(exc)

    def _decide(self, windows: dict[int, WindowTokens], current, force: bool):
        with tempfile.TemporaryDirectory(prefix="locus-replan-") as workdir:  # removed whatever happens
            if self._closed:
                raise LocusError("the server is stopping")
            return self._decide_in(Path(workdir), windows, current, force)

    def _decide_in(self, workdir: Path, windows: dict[int, WindowTokens], current, force: bool):
        from locus.routing.dispatch_rule import resolve_rule
        from locus.routing.planners.planner import PlanOptions, make_plan
        from locus.routing.replay.assignment import assign_recorded
        from locus.routing.replay.simulator import replay
        from locus.traces.reader import TraceReader

        start = time.perf_counter()
        path = workdir / "window"
        tokens = write_window_trace(path, self.meta, windows)
        if tokens == 0:
            raise LocusError("the routing window is empty: nothing to re-plan from yet")
        reader = TraceReader(path)
        planner = str(current.provenance.get("planner", "round_robin"))
        # keep the running rule; plan in this process (workers=1): forking the serving process would take the
        # cores its ranks serve on
        result = make_plan(planner, reader, current.topology, (0, len(reader.requests)),
                           PlanOptions(dispatch=resolve_rule(current), workers=1), trace="live window")
        target = align(current, result.plan)
        check_target(current, target)
        # each plan with the assignment it serves by: its own grouper (what rank 0 admits with after
        # the switch), or where it has none, the ranks the window's requests ran on
        recorded = assign_recorded(reader.requests, current.topology.ranks)
        runtime = self.driver.runtime  # the rows' bytes in the formats they travel in
        formats = dict(dispatch_format=runtime.dispatch_format, combine_format=runtime.combine_format)
        before = replay(reader, current, current.topology, assignment_of(current, reader, recorded), **formats)
        after = replay(reader, target, target.topology, assignment_of(target, reader, recorded), **formats)
        old_bpt, new_bpt = before.inter_node_bytes / tokens, after.inter_node_bytes / tokens
        expected = self._expected_tokens(tokens)
        slots, intra, inter = move_bytes(current, target, self.expert_bytes)
        saving = (old_bpt - new_bpt) * expected
        worth = saving > intra + inter
        reason = ("no slot changes" if slots == 0 else "forced" if force else
                  "predicted saving exceeds the move" if worth else "predicted saving does not pay for the move")
        decision = ReplanDecision(applied=slots > 0 and (worth or force), reason=reason, planner=planner,
                                  window_tokens=tokens, old_inter_node_per_token=old_bpt,
                                  new_inter_node_per_token=new_bpt, expected_tokens=expected,
                                  predicted_saving_bytes=saving, move_bytes=intra + inter, move_inter_node_bytes=inter,
                                  moved_slots=slots, plan_seconds=time.perf_counter() - start)
        return decision, target

    def _expected_tokens(self, window_tokens: int) -> float:
        """Tokens the servers will run before the next re-plan, at the rate they ran lately."""
        s, total = self.schedule, self.driver.tokens_run()
        ran, self._tokens_at_last = total - self._tokens_at_last, total
        if s.steps is not None:
            return ran / max(self._steps_since, 1) * s.steps
        if s.seconds is not None:
            return ran / max(time.monotonic() - self._last, 1e-6) * s.seconds
        return float(window_tokens)  # on request only: amortised over one window's worth of tokens


def assignment_of(plan, reader, recorded):
    """The requests' ranks under `plan`: its grouper's choices, simulated over the window, when it has one."""
    from locus.routing.grouping.live import serving_grouper
    from locus.routing.grouping.simulation import simulate_grouper

    grouper = serving_grouper(plan)
    if grouper is None:
        return recorded
    return simulate_grouper(grouper, reader, 0, len(reader.requests))


def check_target(current, target) -> None:
    """Refuse, before anything moves, a plan the ranks could not serve: one that leaves an expert of a
    layer with no slot (a token routed there would have nowhere to go) or changes the layers or shape."""
    from locus.routing.plan.placement import PlanError, validate

    try:
        if target.topology != current.topology:
            raise PlanError(f"its topology {target.topology} is not the serving one, {current.topology}")
        validate(target, current.num_experts, list(current.moe_layers))
    except PlanError as exc:
        raise LocusError(f"re-plan refused, the placement stays: {exc}") from None


def attach_replanner(driver, schedule: ReplanSchedule, layers_per_step: int = 1, model_name: str = "locus") -> Replanner:
    """Give rank 0's driver a re-planner (the ranks must keep routing windows: build_worker's
    window_tokens). The windows are written as traces of this model; one expert's bytes as the ranks hold
    it (narrow experts: elements and scales) price a move."""
    import torch

    from locus.engine.model.expert_rows import expert_nbytes

    mc = driver.core.model.config
    dtype_bytes = torch.empty((), dtype=driver.core.model.dtype).element_size()
    meta = TraceMeta(model=model_name, num_experts=mc.num_local_experts, top_k=mc.num_experts_per_tok,
                     moe_layers=tuple(mc.moe_layers), hidden_size=mc.hidden_size, dtype_bytes=dtype_bytes,
                     source="locus-replan-window")
    layer = driver.runtime.layers[0]
    expert_bytes = sum(expert_nbytes(p) for p in (layer.gate_up_proj, layer.down_proj))
    driver.replanner = Replanner(driver, meta, schedule, layers_per_step, expert_bytes)
    return driver.replanner
