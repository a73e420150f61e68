"""One rank of an expert-parallel server (nano-vllm's ModelRunner per rank): its slice of the model,
its engine, its EP runtime and the control plane, built by one function for rank 0 and every other
rank, and one iteration that every rank runs in lockstep.

An iteration, on every rank (`RankWorker._iterate`'s phases, each taking what the one before gave):
    1. `_announce`: rank 0 applies its own commands (requests it keeps, aborts of them); every rank
       makes its header;
    2. `_exchange`: the control exchange (control.py): headers from everyone, then rank 0's commands
       to each rank and each rank's report of its previous step to rank 0;
    3. `_take_in`: each rank applies the commands addressed to it (rank 0 decodes the reports);
    4. `_ready`, `_step`: the placements agree, the request moves run, and if any rank has work, every
       rank runs `EngineCore.step()`: the same number of forwards, each entering every MoE layer's
       exchange (runtime.py), with the transport the headers chose;
    5. `_pack_report`: a rank other than 0 packs its report for the next iteration's exchange; rank 0
       has its own outputs at once.
So a request on rank r reports its tokens at the start of the next iteration: one control exchange
later than rank 0's own, not one step later, since the next iteration starts as soon as a step ends.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import torch.distributed as dist

from locus.engine.core.engine_core import EngineConfig, EngineCore
from locus.engine.ep.ranks.control import Agreement, ControlPlane, Header
from locus.engine.ep.ranks.elastic import ElasticOptions, expert_reader, lost_peer, regroup
from locus.engine.ep.counters import StepTimes
from locus.engine.ep.invariant import PlacementDisagreement
from locus.engine.ep.ranks.launch import EPSetup, load_rank, rank_trace_path
from locus.engine.ep.ranks.migrate import RequestMover, drop
from locus.engine.observers.prefill_signatures import PrefillSignatures
from locus.engine.ep.ranks.messages import Commands, Report, decode, encode, pack_output, unpack_reports
from locus.engine.ep.ranks.outbox import ReportOutbox
from locus.engine.ep.ranks.parking import ParkedAdds
from locus.engine.ep.placement_move import MoveStats, PlacementMove
from locus.engine.ep.runtime import EPRuntime
from locus.engine.ep.routing_window import RoutingWindow
from locus.engine.core.outputs import CompletionOutput, RequestOutput
from locus.engine.requests.sequence import RequestMetrics
from locus.errors import LocusError, forget_frames
from locus.routing.plan.placement import plan_from_dict

log = logging.getLogger("locus.engine")
FAILURE_KEY = "failure"  # the first rank whose step raised writes its reason here (the launch's store, signed)


@dataclass
class Iteration:
    """What one iteration gave this rank."""

    stop: bool
    stepped: bool = False  # every rank ran a step
    outputs: list[RequestOutput] = field(default_factory=list)  # this rank's own (rank 0 delivers them)
    errors: list[tuple[str, str]] = field(default_factory=list)  # this rank's refused adds
    reports: dict[int, list[Report]] = field(default_factory=dict)  # rank 0: the others' reports, oldest first
    transport: str = ""
    prefills: list = field(default_factory=list)  # rank 0: its own prefill signatures completed (Report.prefills)
    moved: list = field(default_factory=list)  # rank 0: its own moves out (Report.moved)


class RankWorker:
    def __init__(self, core: EngineCore, runtime: EPRuntime, control: ControlPlane, expert_bytes: int = 0,
                 window_tokens: int = 0):
        self.core, self.runtime, self.control = core, runtime, control
        self.rank, self.world = control.rank, control.world
        # Elastic EP (elastic.py): who this process is across regroupings, the current members (their
        # identities, in rank order), the generation, and how to read expert weights it lacks.
        self.identity, self.members, self.generation = self.rank, list(range(self.world)), 0
        self.elastic = None  # elastic.ElasticOptions under --ep-elastic
        self.expert_bytes = expert_bytes
        self.times: StepTimes = runtime.times
        self.outbox = ReportOutbox()  # this rank's reports to rank 0 (ranks other than 0)
        # What a failed iteration must not lose (elastic EP): outputs/errors gathered before the failure
        # (and the last report sent: the outbox keeps it)
        self._carry: tuple[list, list] = ([], [])
        self._unread: dict[int, Report] = {}  # rank 0: the reports that arrived in a failed iteration
        self._load_sent: np.ndarray | None = None
        config = core.config
        self.step_budget = max(config.max_num_batched_tokens, config.max_num_seqs)
        # Live re-planning: every rank keeps the routing of its last `window_tokens` tokens.
        self.window: RoutingWindow | None = None
        if window_tokens > 0:
            mc = core.model.config
            self.window = RoutingWindow(window_tokens, len(mc.moe_layers), mc.num_experts_per_tok)
            core.routing.subscribe(self.window)
        self._send_window = False
        self.last_move: MoveStats | None = None
        self._moved = False
        self.parked = ParkedAdds(core.grammars.compile)  # adds waiting for their grammar to compile
        # Moves after prefill (--ep-moves, migrate.py): this rank's prefill signatures for rank 0's grouper
        self.signatures: PrefillSignatures | None = None
        self.mover = RequestMover(self)
        self._moved_out: list[tuple[str, int]] = []
        self._missed_aborts: list[str] = []
        self._iterations = 0

    def enable_moves(self) -> None:
        """Report every request's prefill signature, for rank 0's grouper to move requests by."""
        if self.signatures is None:
            mc = self.core.model.config
            self.signatures = PrefillSignatures(len(mc.moe_layers), mc.num_local_experts)
            self.core.routing.subscribe(self.signatures)

    # --- the iteration --------------------------------------------------------------------------
    def iterate(self, commands: dict[int, Commands] | None = None, stop: bool = False) -> Iteration:
        """One lockstep iteration. Rank 0 passes the commands for every rank (its own included);
        the other ranks pass nothing."""
        outputs, errors = self._carry  # filled in place: what a failing iteration gathered stays here
        self._carry = ([], [])
        received: dict[int, list[Report]] = {}  # (rank 0) filled in place as well
        try:
            return self._iterate(commands or {}, stop, outputs, errors, received)
        except BaseException:
            self._carry = (outputs, errors)
            self._unread = received
            raise

    def take_unread_reports(self) -> dict[int, list[Report]]:
        """Rank 0: the reports that arrived in an iteration that then failed, by the rank (old numbering)
        that sent them. The others' outputs in them reached no one: a lost rank never sends them again,
        and a survivor whose step succeeded sends its next report instead (rank 0's driver reads them
        while it recovers)."""
        unread, self._unread = self._unread, {}
        return unread

    def _iterate(self, commands: dict[int, Commands], stop: bool, outputs: list[RequestOutput],
                 errors: list[tuple[str, str]], received: dict[int, list[Report]]) -> Iteration:
        """The iteration's phases (the module docstring's steps), each taking what the one before gave."""
        start = time.perf_counter()
        self._iterations += 1
        header, outgoing = self._announce(commands, stop, outputs, errors)
        agreement, incoming, control_s = self._exchange(header, outgoing)
        mine = self._take_in(incoming, commands, outputs, errors, received)
        it = Iteration(stop=agreement.stop, errors=errors, reports=received if self.rank == 0 else {})
        if not it.stop:
            capacity = self._ready(agreement, mine, outputs)
            transport = self._step(capacity, outputs)
            it.stepped, it.transport = transport is not None, transport or ""
            self._count_times(it.stepped, time.perf_counter() - start, control_s)
        it.outputs = outputs
        if not it.stop:
            self._pack_report(it)
        return it

    def _announce(self, commands: dict[int, Commands], stop: bool, outputs: list[RequestOutput],
                  errors: list[tuple[str, str]]) -> tuple[Header, dict[int, bytes]]:
        """Steps 1 and 2's first half: this rank's header and what it sends (rank 0: its commands to
        each rank, after applying its own; another rank: its report). Every rank first adds the requests
        whose grammar has compiled and advances a placement move: the placement the header names (its
        digest, invariant.py) is the one this iteration's step routes by."""
        self._unpark(errors)
        self._advance_move()
        digest = self.runtime.served_digest()
        core = self.core
        if self.rank != 0:
            report = self.outbox.payload()
            return Header(core.has_unfinished(), core.pending_tokens(), len(report), digest=digest), \
                ({0: report} if report else {})
        outputs += self._apply(commands.get(0, Commands()), errors)
        outgoing = {r: encode(c) for r, c in commands.items() if r != 0 and c}
        header = Header(core.has_unfinished(), core.pending_tokens(), 0, stop,
                        tuple(len(outgoing.get(r, b"")) for r in range(self.world)),
                        tuple(incoming_tokens(commands[r], r) if r in commands else 0 for r in range(self.world)),
                        digest)
        return header, outgoing

    def _exchange(self, header: Header, outgoing: dict[int, bytes]) -> tuple[Agreement, dict[int, bytes], float]:
        """Step 2: the control exchange; returns what every rank agreed, what came in, and the seconds it
        took. A report sent is kept until the next one (resent after a regroup: it may not have arrived)."""
        before = self.control.seconds
        agreement, incoming = self.control.exchange(header, outgoing)
        self.outbox.exchanged()
        return agreement, incoming, self.control.seconds - before

    def _take_in(self, incoming: dict[int, bytes], commands: dict[int, Commands], outputs: list[RequestOutput],
                 errors: list[tuple[str, str]], received: dict[int, list[Report]]) -> Commands | None:
        """Step 3: rank 0 decodes the others' reports (into `received`, which a failed iteration keeps);
        another rank applies the commands addressed to it. Returns this rank's commands (rank 0's own
        were applied before its header)."""
        if self.rank == 0:
            received.update((r, unpack_reports(data)) for r, data in incoming.items())
            return commands.get(0)
        if 0 not in incoming:
            return None
        mine = decode(incoming[0])
        outputs += self._apply(mine, errors)
        return mine

    def _ready(self, agreement: Agreement, mine: Commands | None, outputs: list[RequestOutput]) -> int | None:
        """Before the step: the ranks agree on the placement (else none of them steps: every rank read the
        same headers), this iteration's request moves run (a moved request skips no step), and an abort
        that came with its request's move applies. Returns the step's token capacity; None: no rank has
        work."""
        problem = agreement.disagreement()
        if problem is not None:
            raise PlacementDisagreement(f"the ranks disagree on the expert placement ({problem}); no rank may answer")
        if mine is not None and (mine.moves_out or mine.moves_in):
            self._moved_out += self.mover.run(mine.moves_out, mine.moves_in, self._iterations)
        # after this iteration's moves: every rank got past the previous iteration, and a move it held
        # that a regroup sent again (in the first iteration after it) has just been resent
        self.mover.settle(self._iterations)
        for request_id in self._missed_aborts:
            out = self.core.abort(request_id)
            if out is not None:
                outputs.append(out)
        self._missed_aborts = []
        return agreement.capacity(self.step_budget) if agreement.any_work else None

    def _step(self, capacity: int | None, outputs: list[RequestOutput]) -> str | None:
        """Step 4: if any rank has work, every rank runs `EngineCore.step()` (the same number of forwards,
        each entering every MoE layer's exchange). Returns the transport it ran with; None: no step."""
        if capacity is None:
            return None
        transport = self.runtime.begin_step(capacity)
        outputs += self.core.step()
        self.runtime.end_step()
        return transport

    def _count_times(self, stepped: bool, seconds: float, control_s: float) -> None:
        if stepped:
            self.times.steps += 1
            self.times.step_s += seconds
            self.times.control_s += control_s
        self.times.exchange_s = self.runtime.counters().exchange_s

    def _pack_report(self, it: Iteration) -> None:
        """Step 5: rank 0 keeps its own prefill signatures and moves out; another rank packs its report
        for the next iteration's exchange when it has anything to say."""
        moved, self._moved = self._moved, False
        prefills = self.signatures.drain(self.core.requests) if self.signatures is not None else []
        moved_out, self._moved_out = self._moved_out, []
        if self.rank == 0:
            it.prefills, it.moved = prefills, moved_out
        elif it.stepped or it.outputs or it.errors or self._send_window or moved or prefills or moved_out:
            self.outbox.put(self.report(it.outputs, it.errors, prefills, moved_out))

    def report(self, outputs: list[RequestOutput], errors: list[tuple[str, str]], prefills: list | None = None,
               moved_out: list | None = None) -> Report:
        window = None
        if self._send_window:
            window, self._send_window = self.window_tokens(), False
        return Report([pack_output(o) for o in outputs], errors, self.core.stats(), self.runtime.counters(),
                      self.times, self.expert_bytes, self._load_increment(), self.runtime.counters_by_epoch(),
                      window, self.last_move, 0, prefills or [], moved_out or [])

    def window_tokens(self):
        if self.window is None:
            raise LocusError("live re-planning is off on this rank (no routing window)")
        return self.window.tokens()

    def _advance_move(self) -> None:
        move = self.runtime.advance_move()
        if move is not None:
            self.last_move, self._moved = move.stats, True

    def _apply(self, commands: Commands, errors: list[tuple[str, str]]) -> list[RequestOutput]:
        outputs = []
        if commands.send_window:
            self._send_window = True
        if commands.replan is not None:
            if commands.replan.base != self.runtime.placement.digest:
                # made for a placement this rank no longer holds (every rank holds the same one and so
                # refuses alike); rank 0's re-planner discards such decisions before sending them
                log.error("rank %d: refused a re-plan made for another placement (the ranks regrouped since)", self.rank)
            else:
                target = plan_from_dict(commands.replan.plan)
                self.runtime.state.begin_move(PlacementMove(target, commands.replan.layers_per_step))
        for request_id in commands.drops:  # before the adds: a dropped request may be resumed here
            drop(self.core, request_id)
            self.parked.pop(request_id)
        for add in commands.adds:
            if add.retry and (add.request_id in self.core.requests or add.request_id in self.parked):
                continue
            so = add.params.structured
            if so is not None and not self.core.grammars.is_compiled(so):
                self.parked.park(add)  # its grammar compiles in a thread; the add waits, the lockstep does not
                continue
            self._add(add, errors)
        self._unpark(errors)
        for request_id in commands.aborts:
            parked = self.parked.pop(request_id)
            if parked is not None:  # aborted before it ever ran here
                outputs.append(aborted_output(parked))
                continue
            out = self.core.abort(request_id)
            if out is not None:
                outputs.append(out)
            elif any(m.request_id == request_id for m in commands.moves_in):
                self._missed_aborts.append(request_id)  # it arrives after the exchange
        return outputs

    def _add(self, add, errors: list[tuple[str, str]]) -> None:
        try:
            self.core.admit(add.request_id, add.request, add.domain, add.resumed)  # validated on rank 0
        except LocusError as exc:
            errors.append((add.request_id, str(exc)))

    def _unpark(self, errors: list[tuple[str, str]]) -> None:
        """Add the parked requests whose grammar has compiled (a failure is that request's error)."""
        for add, failure in self.parked.ready():
            if failure is not None:
                errors.append((add.request_id, str(failure)))
            else:
                self._add(add, errors)

    def _load_increment(self) -> tuple[np.ndarray, np.ndarray] | None:
        """Expert-load counts since the last report, sparse (a decode step touches few experts)."""
        load = self.core.expert_load
        if load is None:
            return None
        now = load.totals()
        before = self._load_sent if self._load_sent is not None else np.zeros_like(now)
        self._load_sent = now
        delta = (now - before).ravel()
        index = np.flatnonzero(delta)
        return index.astype(np.int32), delta[index]

    # --- elastic EP ------------------------------------------------------------------------------
    def regroup(self) -> dict[int, int]:
        """After a failed collective: regroup with the survivors (elastic.py); {old rank: new rank}."""
        if self.elastic is None:
            raise LocusError("this rank is not elastic (--ep-elastic)")
        mapping = regroup(self)
        if self.rank != 0:
            self.outbox.after_regroup()
        return mapping

    # --- a rank other than 0 --------------------------------------------------------------------
    def serve(self) -> None:
        """Iterate until rank 0 says stop (a failed collective raises); then write this rank's part
        of a recorded trace and tell rank 0 it is done."""
        while True:
            try:
                if self.iterate().stop:
                    break
                continue
            except Exception as exc:  # a peer died or hung: elastic ranks regroup, the others leave
                if self.elastic is None or not lost_peer(exc):  # a fault of this rank's own: no regroup repairs it
                    raise
                log.error("rank %d: a collective failed (%s); regrouping with the survivors", self.rank, exc)
                forget_frames(exc)
            # outside the handler: the failure's frames (and the old groups they hold) are gone
            self.regroup()
        if self.core.recorder is not None:
            self.core.dump_recording()
        dist.barrier(group=self.control.group)


def build_worker(setup: EPSetup, model: str | None, engine_config: EngineConfig, *, dtype: str | None = None,
                 device: str | None = None, moe_backend: str = "auto", seed: int = 0,
                 record_trace: str | None = None, model_name: str = "locus", window_tokens: int = 0,
                 quantize_experts: str | None = None):
    """This rank's worker (any rank): its model slice joined to the process group with the plan
    applied (its experts in `quantize_experts` when set), its engine in lockstep, its part of a
    recorded trace. Returns (worker, loaded model)."""
    loaded, runtime = load_rank(setup, model, dtype, device, moe_backend, seed, quantize_experts)
    if setup.overlap:
        engine_config = _with_micro_batches(engine_config, runtime.forwards_per_step)
    core = EngineCore(loaded.model, loaded.tokenizer, engine_config)
    core.lockstep = runtime
    if record_trace:  # every rank records its own requests; rank 0 merges the parts at shutdown
        core.start_recording(rank_trace_path(record_trace, setup.rank), model_name)
    control = ControlPlane(runtime.groups.control, setup.rank, setup.world)
    held = runtime.memory.held_bytes if runtime.memory is not None else 0
    worker = RankWorker(core, runtime, control, held, window_tokens or (setup.replan_window if setup.replanning else 0))
    if setup.moves:
        worker.enable_moves()
    if setup.elastic:
        worker.elastic = ElasticOptions(setup.rendezvous, dist.get_backend(),
                                        expert_reader(model, dtype, device, moe_backend, seed, quantize_experts),
                                        setup.max_slots or loaded.model.config.num_local_experts,
                                        lanes=len(runtime.lanes), is_alive=setup.is_alive)
    return worker, loaded


def _with_micro_batches(config: EngineConfig, n: int) -> EngineConfig:
    from dataclasses import replace

    if config.compile_decode:
        raise LocusError("--ep-overlap runs two micro-batches at once in two threads; decode graphs (--compile) "
                         "run over one set of static input buffers and cannot: choose one")
    return replace(config, num_micro_batches=n)


def incoming_tokens(commands: Commands, rank: int) -> int:
    """The most tokens `commands` add to `rank`'s next step (rank 0 applied its adds before its header:
    its pending tokens count them; its moves in arrive after it)."""
    if rank == 0:
        return sum(m.tokens for m in commands.moves_in)
    return commands.prompt_tokens


def aborted_output(add) -> RequestOutput:
    """The final output of a request aborted before it was added here (its grammar was compiling)."""
    outs = [CompletionOutput(index=i, text="", token_ids=[], delta_text="", delta_token_ids=[], finish_reason="abort")
            for i in range(add.params.n)]
    return RequestOutput(add.request_id, add.prompt_ids, outs, True, RequestMetrics())


def report_failure(rank: int, exc: BaseException) -> None:
    """A rank whose step raised writes why into the rendezvous store before it leaves (its exit then
    closes its connections, so every peer's next collective with it fails at once); rank 0 reads it
    to say which rank failed and why. Best effort: the store may be gone too."""
    from locus.engine.ep.ranks.rendezvous import current

    try:
        current().set(FAILURE_KEY, f"rank {rank} failed: {type(exc).__name__}: {exc}")
    except Exception:  # noqa: BLE001
        pass


def failure_cause() -> str | None:
    """What the failed rank wrote (report_failure), if any."""
    from locus.engine.ep.ranks.rendezvous import current

    try:
        store = current()
        if store.check(FAILURE_KEY):
            return store.get_verified(FAILURE_KEY).decode()
    except Exception:  # noqa: BLE001 - gone, or not signed by a rank of this launch
        pass
    return None
