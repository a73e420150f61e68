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
(placement_state.py): the plan whose grouping admits requests. After a lost rank (`--ep-elastic`),
recovery.py regroups the ranks and puts these records in the survivors' numbering.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field, replace

import numpy as np

from locus.engine.core.engine_core import EngineStats, ValidatedRequest
from locus.engine.ep.counters import ExchangeCounters, StepTimes
from locus.engine.ep.ranks.messages import Add, Commands, Move, Report, unpack_output
from locus.engine.ep.ranks.recovery import Recovery
from locus.engine.ep.ranks.worker import Iteration, RankWorker, failure_cause
from locus.engine.ep.placement_move import MoveStats
from locus.engine.core.outputs import RequestOutput
from locus.engine.sampling.sampler import SamplingParams
from locus.engine.requests.sequence import RequestMetrics, Resumed
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
        self.admitted: dict[str, AdmittedRequest] = {}  # the unfinished requests
        self.pending: dict[int, Commands] = {}  # rank -> commands of the next iteration
        self.expert_load = SummedExpertLoad(self.core.expert_load, self.world) if self.core.expert_load is not None else None
        self.errors: list[tuple[str, str]] = []  # refused adds, for AsyncEngine to deliver
        self.last_stepped = False  # the last iteration ran a step: the others have reports to send
        self.replanner = None  # replan.Replanner, when live re-planning is on
        self.recovery = Recovery(self)  # elastic EP: surviving a lost rank
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
            rank = self.least_loaded()
        self.admitted[request_id] = AdmittedRequest(rank, charge, list(prompt_ids), params, domain, grouper=grouper)
        self.ranks[rank].in_flight += charge
        if self.admissions is not None:
            self.admissions.admit(request_id, charge)
        self.pending.setdefault(rank, Commands()).adds.append(Add(request_id, list(prompt_ids), params, domain))
        return rank

    def abort(self, request_id: str) -> None:
        request = self.admitted.get(request_id)
        if request is not None:
            self.pending.setdefault(request.rank, Commands()).aborts.append(request_id)

    def requests(self) -> list[str]:
        """The unfinished requests, on any rank."""
        return list(self.admitted)

    def rank_of(self, request_id: str) -> int | None:
        """The rank an unfinished request runs on (a moving one's target); None when it is not unfinished."""
        request = self.admitted.get(request_id)
        return None if request is None else request.rank

    def has_unfinished(self) -> bool:
        return bool(self.admitted) or bool(self.pending) or self.last_stepped

    def least_loaded(self) -> int:
        """Balanced admission: the rank with the fewest tokens in flight, ties to the lowest."""
        return min(range(self.world), key=lambda r: (self.ranks[r].in_flight, r))

    def wait_s(self) -> float:
        """How long rank 0's loop may wait before the next iteration: none while anything runs or a
        placement moves, a little while a re-plan is being computed, else a heartbeat."""
        if self.last_stepped or self.pending or self.runtime.move is not None:
            return 0.0
        if self.admitted:  # requests in flight, but no rank stepped (a rank compiling a grammar, say): poll
            return 0.005
        if self.replanner is not None and self.replanner.state != "idle":
            return 0.02
        return self.heartbeat_s

    def step(self) -> list[RequestOutput]:
        """One iteration of every rank; the outputs of all of them (the others': their previous step's)."""
        commands = self._take_commands()
        it = self.worker.iterate(commands)
        return self._outputs_of(it)

    def _take_commands(self) -> dict[int, Commands]:
        """The commands of the iteration about to run: those queued (adds, aborts, moves) and the
        re-planner's."""
        if self.replanner is not None:
            self.replanner.before_iteration(self.last_stepped)
        commands, self.pending = self.pending, {}
        self.recovery.sending(commands)
        return commands

    def _outputs_of(self, it: Iteration) -> list[RequestOutput]:
        """The iteration's outputs to stream, with the books kept: what a regroup read from a failed
        iteration, then the other ranks' (their previous step's: a request moved to rank 0 this
        iteration has its source's last tokens in a report and its next ones in rank 0's own outputs),
        then rank 0's own; finished requests released, the moves' and prefills' word acted on."""
        resumed, recovered = self.recovery.iteration_ran()
        self.last_stepped = it.stepped
        own = self.ranks[0]
        # (a copy of the step times: the worker updates its own field by field, and a reader in another
        # thread must never see a split that a later update takes back)
        own.stats, own.times, own.counters = self.core.stats(), replace(self.worker.times), self.runtime.counters()
        own.epochs, own.move = self.runtime.counters_by_epoch(), self.worker.last_move
        self._refused(it.errors)
        outputs, prefills, moved = self.read_reports(it.reports, resumed)
        for out in it.outputs:  # (a request that moves away may be resumed from what it streamed)
            request = self.admitted.get(out.request_id)
            if request is not None:
                self.recovery.note(request, out)
        outputs += it.outputs
        self.settle(outputs, [(0, m) for m in it.moved] + moved)
        for rank, (request_id, index, count) in [(0, p) for p in it.prefills] + prefills:
            self._observe(request_id, index, count)
        if self.replanner is not None:
            self.replanner.after_iteration()
        return recovered + outputs

    def read_reports(self, reports: dict[int, list[Report]],
                     resumed: set[str]) -> tuple[list[RequestOutput], list, list]:
        """Take the other ranks' reports (each rank's oldest first) into their records; returns their
        outputs (a request's streamed tokens noted under elastic EP), prefill signatures and moves out,
        each by rank. A report read already (resent after a regroup) gives nothing; `resumed`: requests
        a regroup resumed from what they had streamed, whose tokens in these reports (made before it)
        are not theirs any more."""
        now = time.monotonic()
        outputs, prefills, moved = [], [], []
        for rank, report in ((rank, report) for rank, listed in sorted(reports.items()) for report in listed):
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
                request = self.admitted.get(packed[0])
                if request is None or packed[0] in resumed:
                    continue  # (resumed: made before the regroup that resumed it from what it had streamed)
                out = unpack_output(packed, request.prompt, request.metrics, now)
                self.recovery.note(request, out)
                outputs.append(out)
        return outputs, prefills, moved

    def settle(self, outputs: list[RequestOutput], moved: list) -> None:
        """Release the requests `outputs` finish; take each move's word from its source (`moved`:
        (rank, (request id, KV positions sent or -1)))."""
        for out in outputs:
            if out.finished:
                self._release(out.request_id)
        for rank, (request_id, tokens) in moved:
            self._moved(request_id, tokens)

    # --- moves after prefill (--ep-moves) -------------------------------------------------------------
    def _observe(self, request_id: str, index, count) -> None:
        """A request's prefill has run: offer its signature to the grouper that admitted it, and move it
        where that grouper says (the replay offers it at the same point of the admission log)."""
        request = self.admitted.get(request_id)
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
        request = self.admitted.get(request_id)
        if request is None or request.rank == target:
            return
        source, params = request.rank, request.params
        if params.n != 1 or params.structured is not None:
            raise LocusError(f"request {request_id!r} cannot move: it has n > 1 or an output grammar")
        self._move_number += 1
        number = self._move_number
        self.pending.setdefault(source, Commands()).moves_out.append(Move(request_id, target, number))
        self.pending.setdefault(target, Commands()).moves_in.append(
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
        if request_id in self.admitted:  # neither finished nor aborted there: it cannot be anywhere
            log.error("request %s was not on its rank when it was to move", request_id)
            self._refused([(request_id, "the request was lost while moving between expert-parallel ranks")])

    # --- elastic EP: a lost rank (recovery.py) --------------------------------------------------------
    @property
    def can_recover(self) -> bool:
        return self.recovery.enabled

    @property
    def recovering(self) -> bool:
        """The survivors of a lost rank are regrouping."""
        return self.recovery.recovering

    @property
    def recoveries(self) -> list[dict]:
        """What each recovery did."""
        return self.recovery.records

    def recoverable(self, exc: BaseException) -> bool:
        return self.recovery.recoverable(exc)

    def recover(self, exc: BaseException) -> bool:
        """A collective failed: regroup with the survivors and resume the lost ranks' requests from their
        prompt and what they streamed (recovery.py). False when not elastic, or when it fails."""
        return self.recovery.recover()

    def renumber_ranks(self, mapping: dict[int, int], lost: list[int]) -> None:
        """A regroup: the survivors' records in their new rank order, the lost ranks' kept as their last
        report left them (swapped as one: see `roster`)."""
        ranks, gone = self.roster
        self.roster = ([ranks[r] for r in sorted(mapping, key=mapping.get)], gone + [ranks[r] for r in lost])
        self.ranks[0].expert_bytes = self.worker.expert_bytes

    # --- what the re-planner asks of the driver -------------------------------------------------------
    def command(self, rank: int) -> Commands:
        """The commands going to `rank` in the next iteration (to add to)."""
        return self.pending.setdefault(rank, Commands())

    def has_replan_queued(self) -> bool:
        return any(c.replan is not None for c in self.pending.values())

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
        self.recovery.stopping.set()

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
            self.refuse(request_id, message)

    def refuse(self, request_id: str, message: str) -> None:
        """End an unfinished request with an error (AsyncEngine delivers it)."""
        self._release(request_id)
        self.errors.append((request_id, message))

    def _release(self, request_id: str) -> None:
        request = self.admitted.pop(request_id, None)
        if self.admissions is not None:
            self.admissions.release(request_id)
        if request is not None:
            if request.rank is not None:
                self.ranks[request.rank].in_flight -= request.charge
            if request.grouper is not None:
                request.grouper.finish(request_id)

