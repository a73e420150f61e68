"""Rank 0's side of an expert-parallel server, an engine backend (locus/engine/core/backend.py): AsyncEngine
hands it adds and aborts, and calls `step` from its thread; each step is one lockstep iteration of
every rank (worker.py).

Requests are assigned to a rank at admission and stay there (their KV cache lives there):
- `balanced` (no plan, or a plan without a grouping): the rank with the fewest tokens in flight
  (prompt plus n * max_tokens of its unfinished requests; a request without max_tokens is charged
  what it may really run to, the context limit), ties to the lowest rank;
- `grouper` (a plan with a grouping): the plan's micro-batch grouper admits it, by domain tag to the
  domain's nodes in the plan's proportions, then the least-loaded rank of the node within the
  attention cap (locus/routing/grouping/grouper.py); an untagged request by its prompt's predicted
  node cost where the plan has a predictor. With --ep-moves, once a request's prefill has run, its
  rank reports its prefill signature and the grouper may move it to a rank whose node its decode
  costs fewer inter-node bytes (when that saves more than its KV cache costs to send): a MoveOut to
  the source and a MoveIn to the target in one iteration (migrate.py; docs/planner.md).

Per rank, rank 0 keeps one record (`RankRecord`): what its last report said (engine counters,
exchange counters in all and per epoch, step times, expert memory, its placement move), the tokens
charged to it, and the rank it was started as (its identity: a regroup renumbers ranks, never
identities). A lost rank's record is kept as its last report left it: what it counted stays in every
total, so no counter of /ep/stats or /metrics runs backwards after a regroup. Per unfinished request
one record (`AdmittedRequest`): its rank (a moving request's is its target's), charge, prompt,
parameters, the grouper that admitted it and what it has streamed. The expert load of every rank is
kept summed (what /metrics shows). The grouper that admits is derived from the placement state
(placement_state.py): the plan whose grouping admits requests.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field, replace

import numpy as np

from locus.engine.core.engine_core import EngineStats, ValidatedRequest
from locus.engine.ep.counters import ExchangeCounters, StepTimes
from locus.engine.ep.ranks.messages import Add, Commands, Move, unpack_output
from locus.engine.ep.ranks.worker import RankWorker, failure_cause
from locus.engine.ep.placement_move import MoveStats
from locus.engine.core.outputs import RequestOutput
from locus.engine.sampling.sampler import SamplingParams
from locus.engine.core.sequence import RequestMetrics, Resumed
from locus.errors import LocusError
from locus.routing.grouping.grouper import Grouper
from locus.routing.grouping.live import serving_grouper
from locus.traces.admissions import AdmissionLog

log = logging.getLogger("locus.engine")
# EngineStats fields that say how things stand now (the others count since start-up)
GAUGES = frozenset({"num_running", "num_waiting", "kv_usage", "num_free_blocks", "num_blocks"})


class SummedExpertLoad:
    """Every rank's expert load, summed: rank 0's own counter plus the increments the others report."""

    def __init__(self, own, world: int):
        self.own = own
        self.moe_layers, self.num_experts = own.moe_layers, own.num_experts
        self._others = np.zeros((len(self.moe_layers), self.num_experts), dtype=np.int64)
        self._lock = threading.Lock()

    def add(self, index: np.ndarray, count: np.ndarray) -> None:
        with self._lock:
            np.add.at(self._others.reshape(-1), index, count)

    def totals(self) -> np.ndarray:
        with self._lock:
            return self.own.totals() + self._others

    def snapshot(self) -> dict[int, list[int]]:
        totals = self.totals()
        return {layer: totals[i].tolist() for i, layer in enumerate(self.moe_layers)}


@dataclass
class RankRecord:
    """What rank 0 knows of one rank: its last report, and the tokens its unfinished requests are charged.
    A regroup renumbers the records with their ranks."""

    identity: int = 0  # the rank it was started as (what /metrics labels its counters with)
    stats: EngineStats | None = None  # None: not heard from yet
    counters: ExchangeCounters = field(default_factory=ExchangeCounters)
    times: StepTimes = field(default_factory=StepTimes)
    expert_bytes: int = 0
    epochs: dict[int, ExchangeCounters] = field(default_factory=dict)  # counters per placement epoch
    move: MoveStats | None = None  # what its placement moves filled so far
    in_flight: int = 0  # tokens charged to it
    report_seq: int = 0  # number of the last report taken (a report resent after a regroup has an old one)


@dataclass
class AdmittedRequest:
    """Rank 0's record of an unfinished request: where it runs and what resuming it elsewhere takes."""

    rank: int | None  # while it moves after its prefill: the target's; None: lost with its rank, not yet re-admitted
    charge: int  # tokens charged to its rank (charge_of)
    prompt: list[int]
    params: SamplingParams
    domain: str | None
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    grouper: Grouper | None = None  # the grouper that admitted it: told when it ends, offered its prefill
    delivered: Resumed = field(default_factory=lambda: Resumed([], []))  # elastic EP: what it streamed so far


class EPDriver:
    def __init__(self, worker: RankWorker):
        self.worker = worker
        self.core, self.runtime = worker.core, worker.runtime
        self.moves = worker.signatures is not None  # --ep-moves: the ranks report prefill signatures
        self._grouper_plan, self._grouper = None, None  # the grouper built for the state's grouping plan
        grouper = self.grouper  # built now: a plan whose predictor does not fit the model is refused at start-up
        if self.moves and grouper is None:
            raise LocusError("--ep-moves: requests move where the plan's grouper says; the plan has no grouping "
                             "(make it with locus plan --planner locality)")
        self._move_number = 0
        self.moved_requests = 0  # moves commanded (the source may have had the request finish first)
        # (the serving ranks' records in rank order, the lost ranks' as their last report left them):
        # swapped as one by a regroup, so a reader in another thread (/metrics) never sees a lost rank
        # counted twice, or not at all
        self.roster: tuple[list[RankRecord], list[RankRecord]] = ([RankRecord(i) for i in worker.members], [])
        self.ranks[0].expert_bytes = worker.expert_bytes
        self._requests: dict[str, AdmittedRequest] = {}  # the unfinished ones
        self._pending: dict[int, Commands] = {}  # rank -> commands of the next iteration
        self.expert_load = SummedExpertLoad(self.core.expert_load, self.world) if self.core.expert_load is not None else None
        self.errors: list[tuple[str, str]] = []  # refused adds, for AsyncEngine to deliver
        self.last_stepped = False  # the last iteration ran a step: the others have reports to send
        self.replanner = None  # replan.Replanner, when live re-planning is on
        # Requests a regroup resumed from what they had streamed (a lost rank's, or a move's whose
        # target was lost). The survivors' reports read in the first iteration after it were made
        # before it: a move's source may report tokens of such a request that it will run again where
        # it resumes, so that iteration drops them (step)
        self._resumed_in_regroup: set[str] = set()
        self._last_commands: dict[int, Commands] = {}
        self._recovered: list[RequestOutput] = []  # read from a failed iteration's reports, out with the next step's
        self.recovering = False
        self.recoveries: list[dict] = []  # what each regrouping did
        self.stopping = threading.Event()  # the server is stopping: a regroup under way gives up
        if worker.elastic is not None:
            worker.elastic.cancelled = self.stopping.is_set
        # Recording: the order of admissions and releases, which the replay's grouper runs through again
        self.admissions = AdmissionLog() if self.core.recorder is not None else None

    @property
    def world(self) -> int:
        """The ranks serving now (fewer after a regroup)."""
        return len(self.ranks)

    @property
    def ranks(self) -> list[RankRecord]:
        """The serving ranks' records, in rank order."""
        return self.roster[0]

    @property
    def lost(self) -> list[RankRecord]:
        """The lost ranks' records, as their last report left them."""
        return self.roster[1]

    @property
    def records(self) -> list[RankRecord]:
        """Every rank that served: the serving ones in rank order, then the lost ones (what they counted
        is part of every total)."""
        ranks, lost = self.roster
        return ranks + lost

    @property
    def grouper(self) -> Grouper | None:
        """The grouper new requests are admitted with: the one of the placement state's grouping plan
        (None: balanced). A re-plan's grouping replaces it; a regroup drops it."""
        plan = self.runtime.state.grouping_plan
        if plan is not self._grouper_plan:
            self._grouper = serving_grouper(plan, self.core.model.config, self.moves) if plan is not None else None
            self._grouper_plan = plan
        return self._grouper

    @property
    def heartbeat_s(self) -> float:
        """How long rank 0 may stay idle: well inside the collective timeout the others wait under."""
        return min(5.0, self.runtime.groups.timeout.total_seconds() / 4)

    def explain(self, exc: BaseException) -> BaseException:
        """The error to fail the server with: the failed rank's own reason when it wrote one."""
        cause = failure_cause()
        if cause is None:
            return exc
        return RuntimeError(f"{cause} (rank 0: {type(exc).__name__}: {exc})")

    @property
    def assignment(self) -> str:
        return "balanced" if self.runtime.state.grouping_plan is None else "grouper"  # (any thread: builds nothing)

    def charge_of(self, prompt_ids: list[int], params: SamplingParams) -> int:
        """The tokens a request may run to: its prompt plus n times its output bound."""
        bound = params.max_tokens
        if bound is None:  # what the engine will let it generate (EngineCore.add_request)
            bound = max(0, min(self.core.max_model_len, self.core.pool_tokens) - len(prompt_ids))
        return len(prompt_ids) + bound * params.n

    def add(self, request_id: str, request: ValidatedRequest, domain: str | None) -> int:
        prompt_ids, params = request.prompt_ids, request.params  # validated on admission; each rank's add checks its own pool
        charge = self.charge_of(prompt_ids, params)
        grouper = self.grouper
        if grouper is not None:
            rank = grouper.admit(request_id, domain, charge, prompt_tokens=len(prompt_ids), streams=params.n,
                                 prompt_ids=prompt_ids)
        else:
            rank = self._least_loaded()
        self._requests[request_id] = AdmittedRequest(rank, charge, list(prompt_ids), params, domain, grouper=grouper)
        self.ranks[rank].in_flight += charge
        if self.admissions is not None:
            self.admissions.admit(request_id, charge)
        self._pending.setdefault(rank, Commands()).adds.append(Add(request_id, list(prompt_ids), params, domain))
        return rank

    def abort(self, request_id: str) -> None:
        request = self._requests.get(request_id)
        if request is not None:
            self._pending.setdefault(request.rank, Commands()).aborts.append(request_id)

    def requests(self) -> list[str]:
        """The unfinished requests, on any rank."""
        return list(self._requests)

    def rank_of(self, request_id: str) -> int | None:
        """The rank an unfinished request runs on (a moving one's target); None when it is not unfinished."""
        request = self._requests.get(request_id)
        return None if request is None else request.rank

    def has_unfinished(self) -> bool:
        return bool(self._requests) or bool(self._pending) or self.last_stepped

    def _least_loaded(self) -> int:
        """Balanced admission: the rank with the fewest tokens in flight, ties to the lowest."""
        return min(range(self.world), key=lambda r: (self.ranks[r].in_flight, r))

    def wait_s(self) -> float:
        """How long rank 0's loop may wait before the next iteration: none while anything runs or a
        placement moves, a little while a re-plan is being computed, else a heartbeat."""
        if self.last_stepped or self._pending or self.runtime.move is not None:
            return 0.0
        if self._requests:  # requests in flight, but no rank stepped (a rank compiling a grammar, say): poll
            return 0.005
        if self.replanner is not None and self.replanner.state != "idle":
            return 0.02
        return self.heartbeat_s

    def step(self) -> list[RequestOutput]:
        """One iteration of every rank; the outputs of all of them (the others': their previous step's)."""
        if self.replanner is not None:
            self.replanner.before_iteration(self.last_stepped)
        commands, self._pending = self._pending, {}
        self._last_commands = commands  # elastic EP: resent to survivors if this iteration fails
        it = self.worker.iterate(commands)
        resumed, self._resumed_in_regroup = self._resumed_in_regroup, set()
        self.last_stepped = it.stepped
        # the other ranks' (their previous step's) first: a request moved to rank 0 this iteration has
        # its source's last tokens in a report and its next ones in rank 0's own outputs. Before them,
        # what a regroup read from the iteration that failed (released there already).
        recovered, self._recovered = self._recovered, []
        own = self.ranks[0]
        # (a copy of the step times: the worker updates its own field by field, and a reader in another
        # thread must never see a split that a later update takes back)
        own.stats, own.times, own.counters = self.core.stats(), replace(self.worker.times), self.runtime.counters()
        own.epochs, own.move = self.runtime.counters_by_epoch(), self.worker.last_move
        self._refused(it.errors)
        outputs, prefills, moved = self._read_reports(it.reports, resumed)
        prefills, moved = [(0, p) for p in it.prefills] + prefills, [(0, m) for m in it.moved] + moved
        if self.worker.elastic is not None:  # rank 0's own too: a request that moves away may be resumed
            for out in it.outputs:
                request = self._requests.get(out.request_id)
                if request is not None:
                    note_delivered(request, out)
        outputs += it.outputs
        for out in outputs:
            if out.finished:
                self._release(out.request_id)
        for rank, (request_id, tokens) in moved:
            self._moved(request_id, tokens)
        for rank, (request_id, index, count) in prefills:
            self._observe(request_id, index, count)
        if self.replanner is not None:
            self.replanner.after_iteration()
        return recovered + outputs

    def _read_reports(self, reports: dict, resumed: set[str]) -> tuple[list[RequestOutput], list, list]:
        """Take the other ranks' reports into their records; returns their outputs (a request's streamed
        tokens noted under elastic EP), prefill signatures and moves out, each by rank. A report read
        already (resent after a regroup) gives nothing; `resumed`: requests a regroup resumed from what
        they had streamed, whose tokens in these reports (made before it) are not theirs any more."""
        now = time.monotonic()
        outputs, prefills, moved = [], [], []
        for rank, report in sorted(reports.items()):
            record = self.ranks[rank]
            record.stats, record.counters, record.times = report.stats, report.counters, report.times
            record.epochs, record.move, record.expert_bytes = report.epochs, report.move, report.expert_bytes
            if report.seq <= record.report_seq:
                continue  # resent after a regroup, and it had arrived: its outputs are out already
            record.report_seq = report.seq
            if report.window is not None and self.replanner is not None:
                self.replanner.take_window(rank, report.window)
            if report.load is not None and self.expert_load is not None:
                self.expert_load.add(*report.load)
            self._refused(report.errors)
            prefills += [(rank, p) for p in report.prefills]
            moved += [(rank, m) for m in report.moved if m[0] not in resumed]
            for packed in report.outputs:
                request = self._requests.get(packed[0])
                if request is None or packed[0] in resumed:
                    continue  # (resumed: made before the regroup that resumed it from what it had streamed)
                out = unpack_output(packed, request.prompt, request.metrics, now)
                if self.worker.elastic is not None:
                    note_delivered(request, out)
                outputs.append(out)
        return outputs, prefills, moved

    # --- moves after prefill (--ep-moves) -------------------------------------------------------------
    def _observe(self, request_id: str, index, count) -> None:
        """A request's prefill has run: offer its signature to the grouper that admitted it, and move it
        where that grouper says (the replay offers it at the same point of the admission log)."""
        request = self._requests.get(request_id)
        if request is None:
            return
        grouper, params = request.grouper, request.params
        if grouper is None or request_id not in grouper.live or params.n != 1 or params.structured is not None:
            return  # (a request with n > 1 or a grammar never moves)
        if self.admissions is not None:
            self.admissions.observe(request_id)
        signature = self.worker.signatures.dense(index, count) if self.worker.signatures is not None else None
        if signature is None:
            return
        remaining = min(max(request.charge - len(request.prompt), 0),
                        grouper.spec.expected_decode_tokens)
        target = grouper.observe_prefill(request_id, signature=signature, remaining_tokens=remaining)
        if target is not None:
            self.move(request_id, target)

    def move(self, request_id: str, target: int) -> None:
        """Move a running request to rank `target` in the next iteration: its KV cache and sampler
        state go from its rank to `target` before that iteration's step (migrate.py). The grouper's
        books are the caller's (observe_prefill has moved it there already)."""
        request = self._requests.get(request_id)
        if request is None or request.rank == target:
            return
        source, params = request.rank, request.params
        if params.n != 1 or params.structured is not None:
            raise LocusError(f"request {request_id!r} cannot move: it has n > 1 or an output grammar")
        self._move_number += 1
        number = self._move_number
        self._pending.setdefault(source, Commands()).moves_out.append(Move(request_id, target, number))
        self._pending.setdefault(target, Commands()).moves_in.append(
            Move(request_id, source, number, tokens=request.charge))
        request.rank = target
        self.ranks[source].in_flight -= request.charge
        self.ranks[target].in_flight += request.charge
        self.moved_requests += 1
        if self.admissions is not None:
            self.admissions.moved(request_id, source, target)

    def _moved(self, request_id: str, tokens: int) -> None:
        """The source's word on a move: the KV positions it sent, or -1: it no longer had the request."""
        if tokens >= 0:
            if self.admissions is not None:
                self.admissions.moved_tokens(request_id, tokens)
            return
        if request_id in self._requests:  # neither finished nor aborted there: it cannot be anywhere
            log.error("request %s was not on its rank when it was to move", request_id)
            self._refused([(request_id, "the request was lost while moving between expert-parallel ranks")])

    # --- elastic EP: a lost rank ----------------------------------------------------------------------
    @property
    def can_recover(self) -> bool:
        return self.worker.elastic is not None

    def recoverable(self, exc: BaseException) -> bool:
        """Whether a regroup may survive `exc`: a lost or hung peer, never a fault of rank 0's own or a
        disagreement between the ranks (elastic.lost_peer)."""
        from locus.engine.ep.ranks.elastic import lost_peer

        return self.can_recover and lost_peer(exc)

    def recover(self, exc: BaseException) -> bool:
        """A collective failed: regroup with the survivors (elastic.py) and re-admit the lost ranks'
        requests from their prompt and what they streamed. False when not elastic, or when it fails."""
        if self.worker.elastic is None:
            return False
        started, old_world = time.monotonic(), self.world
        self.recovering = True
        try:
            mapping = self.worker.regroup()
        except Exception as error:  # noqa: BLE001 - no way on: the caller fails the server
            if isinstance(error, LocusError):
                log.error("regrouping after a lost rank failed: %s", error)
            else:
                log.exception("regrouping after a lost rank failed")
            return False
        finally:
            self.recovering = False
        # the survivors' plan has no grouping (the placement state regrouped): balanced from now on, and
        # no grouper of the old plan is told about requests any more
        for request in self._requests.values():
            request.grouper = None
        self._read_failed_iteration()
        lost = [r for r in range(old_world) if r not in mapping]
        ranks, gone = self.roster
        self.roster = ([ranks[r] for r in sorted(mapping, key=mapping.get)],  # old ranks, in new rank order
                       gone + [ranks[r] for r in lost])
        self.ranks[0].expert_bytes = self.worker.expert_bytes
        # A re-plan was made for the old membership: the re-planner discards it, and no command of it
        # (a window request, a move) reaches the survivors, queued or resent.
        if self.replanner is not None:
            self.replanner.membership_changed()
        self._pending = {mapping[r]: replace(c, send_window=False, replan=None)
                         for r, c in self._pending.items() if r in mapping}
        for r, c in self._last_commands.items():  # the failed iteration's: a survivor may not have them
            if r != 0 and r in mapping:
                resend = self._pending.setdefault(mapping[r], Commands())
                resend.adds[:0] = [replace(a, retry=True) for a in c.adds if self.rank_of(a.request_id) == r]
                resend.aborts[:0] = c.aborts
        self._resume_moves(mapping)
        self._last_commands = {}
        # the survivors' requests keep their rank (renumbered) and charge it; then each lost rank's
        # request goes to the least-loaded survivor, counted in the survivors' numbering
        lost_requests = []
        for r in self.ranks:
            r.in_flight = 0
        for request_id, request in self._requests.items():
            if request.rank in mapping:
                request.rank = mapping[request.rank]
                self.ranks[request.rank].in_flight += request.charge
            else:
                request.rank = None  # charged to no survivor until re-admitted
                lost_requests.append(request_id)
        readmitted, failed = 0, 0
        for request_id in lost_requests:
            if self._readmit(request_id):
                readmitted += 1
            else:
                failed += 1
        record = {"lost_ranks": lost, "survivors": self.world, "readmitted": readmitted, "failed": failed,
                  "seconds": time.monotonic() - started, "epoch": self.runtime.placement.epoch,
                  "topology": str(self.runtime.placement.plan.topology)}
        self.recoveries.append(record)
        log.warning("recovered from the loss of rank(s) %s in %.2f s: %d requests re-admitted, %d failed",
                    lost, record["seconds"], readmitted, failed)
        return True

    def _read_failed_iteration(self) -> None:
        """Read the reports that reached rank 0 in the iteration that failed, in the old numbering, before
        anything is resumed. Their tokens reach no one otherwise: a lost rank never sends its report
        again (and a request it moved out in that iteration goes on where it went, from past those
        tokens), and a survivor whose own step of that iteration ran sends its next report instead. A
        resumed request then resumes from every token it streamed. The outputs go out with the next
        step's (finished requests released now: none of them is resumed); the prefill signatures are
        dropped with the grouper they were for."""
        outputs, _, moved = self._read_reports(self.worker.take_unread_reports(), self._resumed_in_regroup)
        for out in outputs:
            if out.finished:
                self._release(out.request_id)
        for rank, (request_id, tokens) in moved:
            self._moved(request_id, tokens)
        self._recovered += outputs

    def _resume_moves(self, mapping: dict[int, int]) -> None:
        """The failed iteration's moves: with both ranks alive, sent again (the target ignores a request it
        holds already, the source resends what it sent); with the source lost, the target is told to
        resume the request from what it streamed unless it holds it; with the target lost, the source
        forgets it (the loop after this resumes it on a survivor, as any lost rank's request)."""
        for source, c in self._last_commands.items():
            for m in c.moves_out:
                target, request = m.peer, self._requests.get(m.request_id)
                if request is None or request.rank != target:
                    continue  # finished since
                if source in mapping and target in mapping:
                    self.command(mapping[source]).moves_out.insert(0, replace(m, peer=mapping[target], retry=True))
                    self.command(mapping[target]).moves_in.insert(0, Move(m.request_id, mapping[source], m.number,
                                                                          True, request.charge))
                elif target in mapping:
                    self.command(mapping[target]).adds.insert(0, resumed_add(m.request_id, request, retry=True))
                    self._resumed_in_regroup.add(m.request_id)
                elif source in mapping:
                    self.command(mapping[source]).drops.append(m.request_id)

    def _readmit(self, request_id: str) -> bool:
        """Re-add a lost rank's request on a survivor with what it streamed (preemption by recompute,
        across ranks): the survivor recomputes prompt + streamed tokens and the stream goes on."""
        request = self._requests[request_id]
        params = request.params
        if params.n != 1:
            self.errors.append((request_id, f"its rank was lost and a request with n = {params.n} cannot be resumed"))
            self._release(request_id)
            return False
        if params.max_tokens is not None and len(request.delivered.token_ids) >= params.max_tokens:
            self.errors.append((request_id, "its rank was lost after its last token, before its final output"))
            self._release(request_id)
            return False
        request.rank = self._least_loaded()
        self.ranks[request.rank].in_flight += request.charge
        self.command(request.rank).adds.append(resumed_add(request_id, request))
        self._resumed_in_regroup.add(request_id)
        return True

    # --- what the re-planner asks of the driver -------------------------------------------------------
    def command(self, rank: int) -> Commands:
        """The commands going to `rank` in the next iteration (to add to)."""
        return self._pending.setdefault(rank, Commands())

    def has_replan_queued(self) -> bool:
        return any(c.replan is not None for c in self._pending.values())

    def adopt_grouping(self, plan) -> None:
        """New admissions follow the new plan's grouping (the placement state's rule); requests already
        admitted finish where they run, and the grouper that admitted them is told when they end."""
        self.runtime.state.adopt_grouping(plan)
        self.grouper  # built now, as at start-up

    def tokens_run(self) -> int:
        """Tokens every rank (lost ones included) has run through the MoE layers so far."""
        return sum(self.tokens_of(record) for record in self.records)

    def epoch_totals(self) -> list[dict]:
        """Per placement epoch, summed over every rank that ran in it (lost ones included, so an epoch's
        figure stays as it was once it has ended): bytes (docs/design.md's) and tokens."""
        layers = max(1, len(self.runtime.layers))
        records = self.records
        epochs = sorted({e for record in records for e in record.epochs})
        out = []
        for epoch in epochs:
            parts = [record.epochs[epoch] for record in records if epoch in record.epochs]
            out.append({"epoch": epoch, "inter_node_bytes": sum(c.inter_node for c in parts),
                        "intra_node_bytes": sum(c.intra_node for c in parts),
                        "tokens": sum(c.token_layers for c in parts) // layers})
        return out

    def close(self) -> list[RequestOutput]:
        """The server stops: every rank leaves its loop (their requests end with them)."""
        self.stop()
        return []

    def interrupt(self) -> None:
        """A regroup under way gives up (the server stops, or every request fails)."""
        self.stopping.set()

    def take_refused(self) -> list[tuple[str, str]]:
        """(request id, why) of the adds a rank refused, and of the requests a lost rank took with it."""
        refused, self.errors = self.errors, []
        return refused

    def stop(self) -> None:
        """Tell every other rank to leave its loop (the stop flag of a last iteration), and wait until
        each has finished its own shutdown work (writing its part of a recorded trace)."""
        import torch.distributed as dist

        self.worker.iterate(stop=True)
        dist.barrier(group=self.worker.control.group)

    def tokens_of(self, record: RankRecord) -> int:
        """Tokens the rank of `record` ran through the MoE layers (its exchange counts each token once per
        layer)."""
        return record.counters.token_layers // max(1, len(self.runtime.layers))

    def stats(self) -> EngineStats:
        """Counters summed over ranks (a rank not heard from yet counts as empty). A lost rank's counters
        stay in the sums (they must never run backwards); its gauges do not (it holds nothing now)."""
        ranks, lost = self.roster
        known = [r.stats for r in ranks if r.stats is not None] or [self.core.stats()]
        gone = [r.stats for r in lost if r.stats is not None]
        summed = {name: sum(getattr(s, name) for s in known) for name in EngineStats.__dataclass_fields__}
        for name in summed.keys() - GAUGES:
            summed[name] += sum(getattr(s, name) for s in gone)
        summed["kv_usage"] = 1.0 - summed["num_free_blocks"] / max(1, summed["num_blocks"])
        return EngineStats(**summed)

    def _refused(self, errors: list[tuple[str, str]]) -> None:
        for request_id, message in errors:
            self._release(request_id)
            self.errors.append((request_id, message))

    def _release(self, request_id: str) -> None:
        request = self._requests.pop(request_id, None)
        if self.admissions is not None:
            self.admissions.release(request_id)
        if request is not None:
            if request.rank is not None:
                self.ranks[request.rank].in_flight -= request.charge
            if request.grouper is not None:
                request.grouper.finish(request_id)


def note_delivered(request: AdmittedRequest, out: RequestOutput) -> None:
    """Keep what a request has streamed: if its rank dies, a survivor resumes it from there."""
    c = out.outputs[0]
    request.delivered.token_ids += c.delta_token_ids
    request.delivered.logprobs += c.delta_logprobs or []


def resumed_add(request_id: str, request: AdmittedRequest, retry: bool = False) -> Add:
    """The add that resumes `request` on a survivor from its prompt and what it streamed (preemption by
    recompute, across ranks); the add owns its copy of what was streamed."""
    resumed = Resumed(list(request.delivered.token_ids), list(request.delivered.logprobs))
    return Add(request_id, request.prompt, request.params, request.domain, resumed, retry=retry)
