"""Records every token's expert routing while the engine serves, as a `locus-trace` directory.

For each sequence it keeps, per absolute position, the top-k expert ids and weights of every MoE
layer, as the runner saw them (prefill, chunked prefill and decode alike). A finished sequence
becomes one trace request: its prompt rows, then one row per generated token that went through the
model (the last sampled token never does). An aborted sequence (its client went away) becomes one
too, marked `aborted`, with the rows that ran before the abort (a cut prefill's fewer than its
prompt): the engine routed them, and an expert-parallel server's exchanges counted them. Choices of an
`n > 1` request are separate trace requests (`id#index`) sharing the prompt rows. The writer streams
finished requests to disk, so a long recording never sits in memory.

While recording, prefix-cache reuse is off: a reused block's tokens would not go through the model,
and the trace needs every token's routing.

Under expert parallelism the placement may change while serving (a live re-plan): the recorder then
notes the placement epoch of every row (`epochs.npy`) and keeps each epoch's plan with the trace
(`plans/epoch-<e>.json`), so the replay of the trace costs every row under the plan it ran under.

Recording never fails serving. A write the disk refuses (full, quota, I/O error) or any other fault
of the recorder stops the recording (state "failed", with the reason) and keeps, as a finished trace,
the requests written before it (each request is flushed to the files as it finishes); the requests
being served go on untouched. A byte budget (`max_bytes`, counted exactly) stops the recording from
taking requests before it would pass it (state "stopped", reason "budget").

Shape legend: P positions so far, L MoE layers, K experts per token.
"""

from __future__ import annotations

import errno
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from locus.engine.model.config import ModelConfig
from locus.engine.observers.routing_tap import StepRouting
from locus.engine.requests.sequence import Sequence
from locus.errors import LocusError
from locus.traces.format import TraceFormatError, TraceMeta
from locus.traces.writer import TraceWriter

log = logging.getLogger("locus.engine")


@dataclass
class _SeqTrace:
    request_id: str
    domain: str
    prompt_tokens: int
    ids: np.ndarray  # [capacity, L, K] int16, -1 = not yet seen
    weights: np.ndarray  # [capacity, L, K] float16
    epochs: np.ndarray  # [capacity] int32: the placement epoch each row ran under

    def put(self, start: int, ids: np.ndarray, weights: np.ndarray, epoch: int) -> None:
        end = start + len(ids)
        if end > len(self.ids):  # grow geometrically
            grow = max(end, 2 * len(self.ids))
            self.ids = np.concatenate([self.ids, np.full((grow - len(self.ids), *self.ids.shape[1:]), -1, np.int16)])
            self.weights = np.concatenate([self.weights, np.zeros((grow - len(self.weights), *self.weights.shape[1:]), np.float16)])
            self.epochs = np.concatenate([self.epochs, np.zeros(grow - len(self.epochs), np.int32)])
        self.ids[start:end] = ids
        self.weights[start:end] = weights
        self.epochs[start:end] = epoch


@dataclass
class RecordingSummary:
    path: str
    requests: int  # written into the trace (after a failure: those kept)
    tokens: int
    dropped: int  # sequences still in flight when the recording was dumped
    status: str = "written"  # or "failed": the recording stopped on an error; `kept` says if a trace is there
    reason: str | None = None
    kept: bool = True


MIN_TRACE_BYTES = 1024  # an empty trace (meta.json and the .npy headers) fits in this


class RecordingStorageError(LocusError):
    """The trace could not even be started on disk (a full disk, a read-only directory)."""


@dataclass
class TraceRecorder:
    config: ModelConfig
    path: Path
    model_name: str
    dtype_bytes: int = 2  # bytes of one hidden-state element as served (what an exchange moves per value)
    accepting: bool = True  # False after stop: sequences already recorded still finish
    _writer: TraceWriter | None = None
    _active: dict[int, _SeqTrace] = field(default_factory=dict)
    requests: int = 0
    tokens: int = 0
    # Under expert parallelism: the current placement's epoch and plan (anything with to_dict()), per step.
    placement: Callable[[], tuple[int, object]] | None = None
    max_bytes: int | None = None  # disk budget: the recording stops taking requests before it would pass it
    on_failure: Callable[["TraceRecorder"], None] | None = None  # told once, when the recording fails
    stop_reason: str | None = None  # why it takes no more requests: "requested", "budget", or an error's code
    failure: str | None = None  # the error that stopped it, as a sentence (state "failed")
    kept: bool = False  # after a failure: whether the requests written before it are in place as a trace

    def __post_init__(self) -> None:
        c = self.config
        # what the paged cache holds per token, every layer: K and V heads, or the family's own rows (a
        # DeepSeek layer's latent and rotated key); the cache is in the served dtype
        (key_rows, key_width), (value_rows, value_width) = c.kv_cache_dims()
        kv_bytes = c.num_hidden_layers * (key_rows * key_width + value_rows * value_width) * self.dtype_bytes
        meta = TraceMeta(model=self.model_name, num_experts=c.num_local_experts, top_k=c.num_experts_per_tok,
                         moe_layers=tuple(c.moe_layers), hidden_size=c.hidden_size, dtype_bytes=self.dtype_bytes,
                         source="locus-engine", vocab_size=c.vocab_size, kv_bytes_per_token=kv_bytes,
                         **_expert_groups(c))
        try:
            self._writer = TraceWriter(self.path, meta, with_weights=True, with_epochs=self.placement is not None,
                                       with_tokens=True)
        except TraceFormatError:  # its message holds the full path, which a client must not see
            raise LocusError(f"a trace named {self.path.name!r} already exists") from None
        except OSError as exc:
            raise RecordingStorageError(f"the trace {self.path.name!r} cannot be started: {_describe(exc)}") from None
        self._layers = tuple(c.moe_layers)
        self._epochs_seen: set[int] = set()

    @property
    def state(self) -> str:
        """"recording", "stopped" (takes no new requests: asked to, or its budget) or "failed"."""
        return "failed" if self.failure is not None else "recording" if self.accepting else "stopped"

    @property
    def written_bytes(self) -> int:
        return self._writer.nbytes

    def stop(self) -> None:
        if self.accepting:
            self.accepting, self.stop_reason = False, "requested"

    # --- engine hooks ---------------------------------------------------------------------------
    def observe(self, step: StepRouting) -> None:
        """A routing-tap subscriber: file each sequence's rows at their positions."""
        if self.failure is not None:
            return
        try:
            epoch = self._current_epoch()
            for item, (span, lo, hi) in zip(step.items, step.rows):
                trace = self._trace_of(item.seq, span.start)
                if trace is not None:
                    trace.put(span.start, step.ids[lo:hi], step.weights[lo:hi], epoch)
        except Exception as exc:  # noqa: BLE001 - the recorder's fault never fails the step
            self._fail(exc)

    def _current_epoch(self) -> int:
        if self.placement is None:
            return 0
        epoch, plan = self.placement()
        if epoch not in self._epochs_seen:  # keep each epoch's plan with the trace
            self._writer.add_plan(epoch, plan.to_dict())
            self._epochs_seen.add(epoch)
        return epoch

    def fork(self, parent: Sequence, child: Sequence) -> None:
        src = self._active.get(parent.seq_id)
        if src is not None:
            self._active[child.seq_id] = _SeqTrace(self._request_id(child), src.domain, src.prompt_tokens,
                                                   src.ids.copy(), src.weights.copy(), src.epochs.copy())

    def hand_over(self, seq: Sequence) -> _SeqTrace | None:
        """A sequence leaving this engine unfinished (moved to another rank): its rows so far, for the
        recorder there (`adopt`), which writes the request when it finishes."""
        return self._active.pop(seq.seq_id, None)

    def adopt(self, seq: Sequence, trace: _SeqTrace) -> None:
        """Go on recording a sequence another engine's recorder handed over (its rows so far)."""
        if self.failure is None:
            self._active[seq.seq_id] = trace

    def finish(self, seq: Sequence) -> None:
        trace = self._active.pop(seq.seq_id, None)
        if trace is None or self.failure is not None:
            return
        # An aborted sequence is kept too, with the rows seen before the abort (a cut prefill's fewer than
        # its prompt): they went through the model, and through an expert-parallel server's exchanges,
        # which counted them, so a replay of the trace must count them as well.
        aborted = seq.finish_reason == "abort"
        # (finished: every token but the last sampled one, which was never fed to the model)
        rows = ran_rows(trace.ids, seq.num_tokens) if aborted else seq.num_tokens - 1
        ids, weights = trace.ids[:rows], trace.weights[:rows]
        if rows <= 0 or (ids[:, 0, 0] < 0).any():
            return  # incomplete (cannot happen with prefix reuse off; kept as a guard)
        epochs = trace.epochs[:rows] if self.placement is not None else None
        prompt_tokens = min(trace.prompt_tokens, rows)
        size = self._writer.request_bytes(trace.request_id, trace.domain, prompt_tokens, rows, aborted)
        if self.max_bytes is not None and self._writer.nbytes + size > self.max_bytes:
            if self.accepting or self.stop_reason != "budget":
                log.warning("trace %s: the next request would pass the %d-byte budget (--trace-max-bytes); "
                            "the recording takes no more requests", self.path, self.max_bytes)
            self.accepting, self.stop_reason = False, "budget"
            self._active.clear()
            return
        try:
            tokens = np.asarray(seq.token_slice(0, rows), dtype=np.int32)  # the token each row fed the model
            self._writer.add_request(trace.request_id, trace.domain, prompt_tokens, ids, weights, epochs, tokens,
                                     aborted=aborted)
            self._writer.flush()  # on disk now, or refused now: a later failure keeps this request
        except Exception as exc:  # noqa: BLE001 - a full disk stops the recording, never the request
            self._fail(exc)
            return
        self.requests += 1
        self.tokens += rows

    def _fail(self, exc: Exception) -> None:
        """Stop for good: drop what is in flight, keep what was flushed, tell the engine once."""
        if self.failure is not None:
            return
        self.failure = _describe(exc)
        self.stop_reason = errno.errorcode.get(exc.errno, "EIO") if isinstance(exc, OSError) and exc.errno \
            else "error"
        self.accepting = False
        self._active.clear()
        if isinstance(exc, OSError):
            log.error("trace %s: %s; the recording stopped (requests go on)", self.path, self.failure)
        else:
            log.error("trace %s: the recorder failed; the recording stopped (requests go on)", self.path, exc_info=exc)
        self.kept = self._writer.salvage()
        self.requests, self.tokens = self._writer.num_requests, self._writer.num_tokens
        if self.kept:
            log.warning("trace %s: the %d requests written before the failure are kept", self.path, self.requests)
        if self.on_failure is not None:
            self.on_failure(self)

    # --- control --------------------------------------------------------------------------------
    def dump(self) -> RecordingSummary:
        """Close the trace (atomically renamed into place); sequences still in flight are dropped. A
        failed recording reports its reason and what was kept."""
        dropped = len(self._active)
        self._active.clear()
        if self.failure is None:
            try:
                self._writer.flush()
                self._writer.close()
            except Exception as exc:  # noqa: BLE001 - reported in the summary, as a failure while recording is
                self._fail(exc)
        if self.failure is not None:
            return RecordingSummary(str(self.path), self.requests, self.tokens, dropped, "failed", self.failure, self.kept)
        return RecordingSummary(str(self.path), self.requests, self.tokens, dropped)

    def abandon(self) -> None:
        """Discard the recording (nothing is left on disk)."""
        self._active.clear()
        self._writer.abort()

    def _trace_of(self, seq: Sequence, start: int) -> _SeqTrace | None:
        """The sequence's trace; a new one only for a sequence seen from its first token on."""
        trace = self._active.get(seq.seq_id)
        if trace is None and self.accepting and start == 0 and not seq.output_ids:
            L, K = len(self._layers), self.config.num_experts_per_tok
            cap = max(seq.num_tokens + 16, 64)
            trace = _SeqTrace(self._request_id(seq), seq.request.domain or "", len(seq.prompt_ids),
                              np.full((cap, L, K), -1, np.int16), np.zeros((cap, L, K), np.float16),
                              np.zeros(cap, np.int32))
            self._active[seq.seq_id] = trace
        return trace

    @staticmethod
    def _request_id(seq: Sequence) -> str:
        rid = seq.request.request_id
        return rid if seq.request.params.n == 1 else f"{rid}#{seq.index}"


def _expert_groups(config) -> dict:
    """The trace's n_group / topk_group for a group-limited router (DeepSeek's config keeps n_group 1 for
    one that is not), so the replay and planner know the nodes a token can reach; nothing otherwise."""
    n_group = getattr(config, "n_group", 1)
    return {"n_group": n_group, "topk_group": config.topk_group} if n_group > 1 else {}


def ran_rows(ids: np.ndarray, limit: int) -> int:
    """How many leading rows of a sequence's trace (`ids` [capacity, L, K], -1 = not seen) were seen,
    at most `limit`: an aborted sequence's rows that ran (rows of a step it was aborted during are
    never published)."""
    seen = ids[:limit, 0, 0] >= 0
    return int(limit if seen.all() else np.argmin(seen))


def _describe(exc: BaseException) -> str:
    """An error as the sentence /traces/* and the log show: "No space left on device (ENOSPC)"."""
    if isinstance(exc, OSError) and exc.errno:
        return f"{exc.strerror or exc} ({errno.errorcode.get(exc.errno, exc.errno)})"
    return f"{type(exc).__name__}: {exc}"
