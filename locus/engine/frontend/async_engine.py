"""The engine for the server: one background thread runs an engine backend; asyncio callers stream results.

The backend (core/backend.py) is this process's `EngineCore`, or rank 0's driver of an expert-parallel
server; the loop is the same for both. The asyncio loop never runs a forward pass. Callers post commands (add, abort) to a queue; the
engine thread applies them between steps, runs `step()`, and hands each request's outputs to that
request's sink with `call_soon_threadsafe`. A caller that stops listening (client gone, task
cancelled) aborts its request, which frees its KV blocks at the next step boundary.

Admission is decided synchronously by `admit` (queue room) for a request `validate` passed (the
engine's one check of a request, EngineCore.validate; `add` does both), before a caller sends any
response byte, and exactly: requests admitted but not yet seen by the engine thread are counted
under the same lock as the snapshot of the engine's waiting queue. Nothing after `validate` checks the
request again.

What a caller may read of the engine is one interface of named snapshots (health.py): `info`,
`stats()`, `health()`, `recording()`, the expert load, and under expert parallelism each rank's
figures and /ep/stats; the recording and a re-plan are asked for through methods, never through the
engine's parts.

Failure policy (as vLLM's): an error the engine can pin on one request (see EngineCore.step) fails
that request only. Any other exception in the engine thread is fatal: it is logged with its
traceback, every caller gets EngineDeadError, `healthy` turns False, and `on_dead` (the server's
exit hook) is called, so that a supervisor sees the process end instead of a live process with a
dead engine.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

from locus.engine.core.backend import EngineBackend, LocalBackend
from locus.engine.core.engine_core import EngineCore, EngineStats, ValidatedRequest
from locus.engine.core.outputs import RequestOutput
from locus.engine.ep.ranks.health import RankSnapshot, ep_view_of
from locus.engine.frontend.request_stream import OutputSink, RequestStream, put_all
from locus.engine.frontend.health import EngineHealth, EngineInfo, RecordingState, recording_state
from locus.engine.observers.trace_recorder import RecordingSummary
from locus.engine.sampling.sampler import SamplingParams
from locus.errors import LocusError, forget_frames

log = logging.getLogger("locus.engine")

BURST_WAIT_CAP = 20  # the burst wait ends after this many quiet periods, however many requests still come


class EngineDeadError(RuntimeError):
    """The engine thread crashed; the server reports unhealthy."""


class QueueFullError(LocusError):
    """Too many requests waiting; retry later."""


class ShuttingDownError(QueueFullError):
    """The server is stopping; the request was not (or not completely) served. Retry elsewhere."""


@dataclass
class _Add:
    request_id: str
    request: ValidatedRequest
    domain: str | None
    sink: OutputSink
    loop: asyncio.AbstractEventLoop


@dataclass
class _Abort:
    request_id: str


@dataclass
class _FailAll:
    error: BaseException  # every request in the engine ends with this error


@dataclass
class _Call:
    fn: object  # callable(EngineCore) -> result, run in the engine thread between steps
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop


class AsyncEngine:
    def __init__(self, backend: EngineBackend | EngineCore, max_waiting: int | None = None,
                 on_dead: Callable[[BaseException], None] | None = None,
                 on_finished: Callable[[RequestOutput], None] | None = None,
                 burst_wait_s: float = 0.0):
        # an EngineCore is served as this process's engine; rank 0 of an expert-parallel server
        # passes its driver (build.py's build_engine makes either)
        self.backend = LocalBackend(backend) if isinstance(backend, EngineCore) else backend
        self.core = self.backend.core
        self._ep = ep_view_of(self.backend)  # rank 0's driver under expert parallelism, else None
        self.max_waiting = max_waiting
        # An idle engine that gets a request first waits until none has arrived for this long (at
        # most BURST_WAIT_CAP times as long), so that a burst is prefilled in one step (0: no wait).
        self.burst_wait_s = burst_wait_s
        self.on_dead = on_dead  # called once, from the engine thread, after a fatal engine error
        # called from the engine thread with every request's last output: finished, aborted (its
        # reader may be gone) or failed; the server's request counters and latency histograms
        self.on_finished = on_finished
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        # Admission count: _Add commands posted but not yet applied by the engine thread. It and
        # the stats snapshot change together under this lock, so no request is counted twice or never.
        self._admission = threading.Lock()
        self._unapplied_adds = 0
        self._wake = threading.Event()
        self._sinks: dict[str, tuple[OutputSink, asyncio.AbstractEventLoop]] = {}
        self._ids = itertools.count()
        self._stats = self.backend.stats()
        self._error: BaseException | None = None
        self._stopping = threading.Event()
        self._admitting = True
        self._thread = threading.Thread(target=self._loop, name="locus-engine", daemon=True)

    # --- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop_admitting(self) -> None:
        self._admitting = False

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stopping.set()
        self.backend.interrupt()  # a regroup under way (elastic EP) gives up rather than hold the exit
        self._wake.set()
        self._thread.join(timeout)
        if self._ep is not None:
            self._ep.close()

    @property
    def failed(self) -> bool:
        """The engine died of an error (as opposed to having been shut down)."""
        return self._error is not None

    @property
    def error(self) -> BaseException | None:
        """What the engine died of (None while it runs, or after a clean shutdown)."""
        return self._error

    @property
    def healthy(self) -> bool:
        return self._error is None and self._thread.is_alive()

    # --- what callers read: snapshots, safe from any thread (health.py) ---------------------------
    def stats(self) -> EngineStats:
        """Counters as of the end of the last step (a snapshot; safe from any thread)."""
        return self._stats

    @functools.cached_property
    def info(self) -> EngineInfo:
        """What stays fixed while the engine serves: tokenizer, context limit, vocabulary, KV pool, constraint compiler."""
        return EngineInfo.of(self.core)

    def health(self) -> EngineHealth:
        return EngineHealth(self.healthy, self._error, self._ep.health() if self._ep is not None else None)

    def recording(self) -> RecordingState:
        """The trace recording as it stands now (its counts move while requests run)."""
        return recording_state(self.core)

    def expert_load(self) -> dict[int, list[int]] | None:
        """(token, slot) pairs routed to each expert so far, per MoE layer (every rank's under expert
        parallelism); None when not counted."""
        load = self.backend.expert_load
        return None if load is None else load.snapshot()

    def ep_ranks(self) -> list[RankSnapshot]:
        """Under expert parallelism, every rank's figures as of its last report (lost ranks' last); else none."""
        return self._ep.ranks() if self._ep is not None else []

    def ep_stats(self) -> dict | None:
        """GET /ep/stats' document; None without expert parallelism."""
        return self._ep.stats() if self._ep is not None else None

    def admission_log(self) -> dict | None:
        """Under expert parallelism with a recording, rank 0's admission log (the ranks' trace parts are
        merged in its order); else None."""
        return self._ep.admissions() if self._ep is not None else None

    # --- asked of the engine --------------------------------------------------------------------
    async def start_recording(self, path: str | Path, model_name: str, max_bytes: int | None) -> None:
        await self._call(lambda core: core.start_recording(path, model_name, max_bytes))

    async def stop_recording(self) -> RecordingState:
        """Record no new requests; the recording as it stands after."""
        def stop(core: EngineCore) -> RecordingState:
            core.stop_recording()
            return recording_state(core)

        return await self._call(stop)

    async def recording_between_steps(self) -> RecordingState:
        """The recording as the engine thread sees it between two steps (counts of whole steps)."""
        return await self._call(recording_state)

    async def dump_recording(self) -> RecordingSummary:
        """Write the trace and end the recording."""
        return await self._call(lambda core: core.dump_recording())

    def request_replan(self, force: bool) -> Future:
        """Under expert parallelism with live re-planning (`health().ep.replanning`), re-plan now: the
        future holds the decision (replan.py raises ReplanBusy while one is under way)."""
        future = self._ep.request_replan(force)
        self._wake.set()  # the re-planner runs between the engine's iterations
        return future

    # --- requests -------------------------------------------------------------------------------
    def validate(self, prompt_ids: list[int], params: SamplingParams) -> ValidatedRequest:
        """The engine's one check of a request (EngineCore.validate): InvalidParameter / LocusError, or
        the request as `admit` takes it. Safe on the event loop for a constraint already compiled."""
        return self.core.validate(prompt_ids, params)

    def add(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
            domain: str | None = None, final_only: bool = False) -> RequestStream:
        """Validate and admit a request now (or raise EngineDeadError, QueueFullError, InvalidParameter)
        and return the stream of its outputs. Call from the event loop that will read the stream."""
        return self.admit(self.validate(prompt_ids, params), request_id, domain, final_only)

    def admit(self, request: ValidatedRequest, request_id: str | None = None, domain: str | None = None,
              final_only: bool = False) -> RequestStream:
        """Admit a validated request now (or raise EngineDeadError, QueueFullError) and return the stream of
        its outputs. Call from the event loop that will read the stream."""
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self._sinks:
            raise LocusError(f"request id {request_id!r} is already in use")
        loop = asyncio.get_running_loop()
        sink = OutputSink(final_only)
        with self._admission:
            self._check_admission(1)
            self._unapplied_adds += 1
            self._sinks[request_id] = (sink, loop)
            self._commands.put(_Add(request_id, request, domain, sink, loop))
        self._wake.set()
        return RequestStream(self, request_id, sink)

    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
                       domain: str | None = None, final_only: bool = False) -> AsyncIterator[RequestOutput]:
        """Admit the request and stream its incremental outputs; the last one has `finished` True.
        A caller that falls behind gets its backlog as one merged output (see merge_outputs). With
        `final_only`, only the finished output comes (the event loop is not woken per step)."""
        stream = self.add(prompt_ids, params, request_id, domain, final_only)
        async with stream:
            async for out in stream:
                yield out

    def check_admission(self, count: int = 1) -> None:
        """Raise EngineDeadError / QueueFullError if `count` new requests cannot be taken now."""
        with self._admission:
            self._check_admission(count)

    def _check_admission(self, count: int) -> None:
        if self._error is not None or not self._thread.is_alive():
            raise EngineDeadError("the engine is not running")
        if not self._admitting:
            raise ShuttingDownError("the server is shutting down")
        if self.max_waiting is not None and self._stats.num_waiting + self._unapplied_adds + count > self.max_waiting:
            raise QueueFullError(f"too many requests waiting ({self.max_waiting}); retry later")

    def fail_all(self, error: BaseException) -> None:
        """End every request in the engine with `error`: its reader gets the error now, from this thread
        (the engine thread may be busy for long: inside an elastic regroup, say); the engine drops the
        requests at its next step boundary. Under elastic EP a regroup under way gives up."""
        for request_id in list(self._sinks):
            self._deliver(request_id, error)
        self.backend.interrupt()
        self._commands.put(_FailAll(error))
        self._wake.set()

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))
        self._wake.set()

    def close_stream(self, request_id: str, abort: bool) -> None:
        """A request's reader is done with it (RequestStream.aclose): stop delivering to its sink, and
        abort the request if it was left before its last output."""
        if abort:
            self.abort(request_id)
        self._sinks.pop(request_id, None)

    async def _call(self, fn):
        """Run fn(core) in the engine thread between two steps and return its result (or raise its error)."""
        if not self.healthy:
            raise EngineDeadError("the engine is not running")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._commands.put(_Call(fn, future, loop))
        self._wake.set()
        return await future

    # --- the engine thread ----------------------------------------------------------------------
    def _loop(self) -> None:
        """Apply the queued commands, step, hand the outputs over, wait as long as the backend
        allows (an idle engine: until a command comes; rank 0 of several: a heartbeat inside
        --ep-timeout, since the other ranks wait for it in a collective). A failed step ends the
        engine, unless the backend survives it (elastic EP: the survivors regroup)."""
        backend = self.backend
        idle = True
        while True:
            try:
                while not self._stopping.is_set():
                    adds = self._apply_commands()
                    if idle and self.burst_wait_s > 0 and backend.has_unfinished():
                        adds += self._gather_burst()
                    outputs = backend.step()
                    self._deliver_refused()
                    self._publish_stats(adds)  # the added requests are in the backend's counts now
                    self._deliver_step(outputs)
                    idle = not backend.has_unfinished()
                    wait = backend.wait_s()
                    if wait > 0:
                        self._wake.wait(wait)
                        self._wake.clear()
                # on shutdown, whoever is still waiting gets an aborted final output
                for out in backend.close():
                    self._deliver(out.request_id, out)
                return
            except BaseException as exc:  # not pinned on one request (a rank died, a collective timed out)
                failure = exc
                if not (isinstance(exc, Exception) and not self._stopping.is_set() and backend.recoverable(exc)):
                    self._die(backend.explain(exc))
                    return
                log.error("a collective failed (%s); regrouping with the surviving ranks", exc)
                forget_frames(exc)
            # outside the handler, so that the failure's frames (holding the old groups) are gone
            if not backend.recover(failure):
                self._die(backend.explain(failure))
                return
            self._deliver_refused()  # requests that could not be resumed

    def _gather_burst(self) -> int:
        """The first step after an idle spell waits for the rest of a burst of arrivals: until no
        request has come for `burst_wait_s`, or BURST_WAIT_CAP x that in all. Without the wait, a
        burst of N requests onto an idle engine is prefilled as 1, then N - 1 one step later, and
        that lone first step runs while the event loop is still taking the others in (docs/serving.md
        has the measurement). Costs a lone request at most `burst_wait_s` of TTFT. Like the queue
        delay of a dynamic batcher (Triton's max_queue_delay), but only when nothing is running.
        Returns the adds it applied."""
        adds = 0
        deadline = time.monotonic() + BURST_WAIT_CAP * self.burst_wait_s
        while not self._stopping.is_set():
            left = deadline - time.monotonic()
            if left <= 0:
                break
            self._wake.clear()
            if not self._wake.wait(min(self.burst_wait_s, left)):
                break  # quiet: the burst is in
            adds += self._apply_commands()
        return adds

    def _deliver_refused(self) -> None:
        for request_id, message in self.backend.take_refused():
            self._deliver(request_id, LocusError(message))

    def _die(self, exc: BaseException) -> None:
        self._error = exc
        log.critical("engine failed; every request in flight gets an error", exc_info=exc)
        err = EngineDeadError(f"engine step failed: {type(exc).__name__}: {exc}")
        for request_id in list(self._sinks):
            self._deliver(request_id, err)
        while True:  # a call waiting for the engine thread (a trace dump at shutdown, say) gets the error too
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, _Call):
                cmd.loop.call_soon_threadsafe(_settle, cmd.future, None, err)
        if self.on_dead is not None:
            self.on_dead(exc)

    def _publish_stats(self, applied_adds: int) -> None:
        with self._admission:
            self._stats = self.backend.stats()
            self._unapplied_adds -= applied_adds

    def _apply_commands(self) -> int:
        """Apply the queued commands; the number of adds among them (counted as admitted but not
        applied until the next stats snapshot)."""
        backend = self.backend
        adds = 0
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, _Add):
                adds += 1
                try:  # validated before admission; under expert parallelism the driver picks the rank
                    backend.add(cmd.request_id, cmd.request, cmd.domain)
                except LocusError as exc:
                    self._deliver(cmd.request_id, exc)
            elif isinstance(cmd, _Abort):
                out = backend.abort(cmd.request_id)  # None: its rank aborts it, the output comes back
                if out is not None:
                    self._note_finished(out)
                    self._deliver(cmd.request_id, out)
            elif isinstance(cmd, _FailAll):
                for request_id in list(self._sinks):
                    self._deliver(request_id, cmd.error)
                for request_id in backend.requests():
                    out = backend.abort(request_id)
                    if out is not None:
                        self._note_finished(out)
            elif isinstance(cmd, _Call):
                # a call sees the engine between whole steps: the step in flight (overlapped) finishes first
                self._deliver_step(self.core.drain())
                try:
                    result, error = cmd.fn(self.core), None
                except Exception as exc:  # noqa: BLE001 - handed to the caller
                    result, error = None, exc
                cmd.loop.call_soon_threadsafe(_settle, cmd.future, result, error)
        return adds

    def _deliver_step(self, outputs: list[RequestOutput]) -> None:
        """Hand a step's outputs over with one wake-up per event loop, not one per request: at 32+
        streams, per-request wake-ups cost the loop (which shares the CPU with the forward) more
        than the outputs themselves."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            if out.finished:
                self._note_finished(out)
            target = self._sinks.get(out.request_id)
            if target is None:
                continue
            if target[0].final_only and not out.finished and out.error is None:
                continue  # its reader needs only the finished output, which holds everything: no wake-up
            # a failed request's reader gets its error instead of the output
            by_loop.setdefault(target[1], []).append((target[0], out.error or out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(put_all, items)
            except RuntimeError:  # the caller's loop is closed
                pass

    def _note_finished(self, out: RequestOutput) -> None:
        if self.on_finished is not None:
            try:
                self.on_finished(out)
            except Exception:  # noqa: BLE001 - a counter must never take the engine down
                log.exception("on_finished hook failed")

    def _deliver(self, request_id: str, item) -> None:
        target = self._sinks.get(request_id)
        if target is None:
            return
        sink, loop = target
        try:
            loop.call_soon_threadsafe(sink.put, item)
        except RuntimeError:  # the caller's loop is closed
            pass


def _settle(future: asyncio.Future, result, error) -> None:
    if future.cancelled():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
