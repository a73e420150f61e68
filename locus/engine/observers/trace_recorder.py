"""Records every token's expert routing while the engine serves, as a `locus-trace` directory.

For each sequence it keeps, per absolute position, the top-k expert ids and weights of every MoE
layer, as the runner saw them (prefill, chunked prefill and decode alike). A finished sequence
becomes one trace request: its prompt rows, then one row per generated token that went through the
model (the last sampled token never does). Choices of an `n > 1` request are separate trace requests
(`id#index`) sharing the prompt rows. The writer streams finished requests to disk, so a long
recording never sits in memory.

While recording, prefix-cache reuse is off: a reused block's tokens would not go through the model,
and the trace needs every token's routing.

Under expert parallelism the placement may change while serving (a live re-plan): the recorder then
notes the placement epoch of every row (`epochs.npy`) and keeps each epoch's plan with the trace
(`plans/epoch-<e>.json`), so the replay of the trace costs every row under the plan it ran under.

Shape legend: P positions so far, L MoE layers, K experts per token.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from locus.engine.model.config import ModelConfig
from locus.engine.observers.routing_tap import StepRouting
from locus.engine.sequence import Sequence
from locus.traces.format import TraceMeta
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
    requests: int
    tokens: int
    dropped: int  # sequences still in flight when the recording was dumped


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
    max_bytes: int | None = None  # disk budget: past it the recording stops taking requests (logged)
    written_bytes: int = 0

    def __post_init__(self) -> None:
        c = self.config
        meta = TraceMeta(model=self.model_name, num_experts=c.num_local_experts, top_k=c.num_experts_per_tok,
                         moe_layers=tuple(c.moe_layers), hidden_size=c.hidden_size, dtype_bytes=self.dtype_bytes,
                         source="locus-engine")
        self._writer = TraceWriter(self.path, meta, with_weights=True, with_epochs=self.placement is not None)
        self._layers = tuple(c.moe_layers)
        self._epochs_seen: set[int] = set()

    # --- engine hooks ---------------------------------------------------------------------------
    def observe(self, step: StepRouting) -> None:
        """A routing-tap subscriber: file each sequence's rows at their positions."""
        epoch = self._current_epoch()
        for item, (span, lo, hi) in zip(step.items, step.rows):
            trace = self._trace_of(item.seq, span.start)
            if trace is not None:
                trace.put(span.start, step.ids[lo:hi], step.weights[lo:hi], epoch)

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

    def finish(self, seq: Sequence) -> None:
        trace = self._active.pop(seq.seq_id, None)
        if trace is None or seq.finish_reason == "abort":
            return
        rows = seq.num_tokens - 1  # the last sampled token was never fed to the model
        ids, weights = trace.ids[:rows], trace.weights[:rows]
        if rows <= 0 or (ids[:, 0, 0] < 0).any():
            return  # incomplete (cannot happen with prefix reuse off; kept as a guard)
        epochs = trace.epochs[:rows] if self.placement is not None else None
        size = ids.nbytes + weights.nbytes + (0 if epochs is None else epochs.nbytes) + len(trace.request_id) + len(trace.domain) + 64
        if self.max_bytes is not None and self.written_bytes + size > self.max_bytes:
            if self.accepting:
                log.warning("trace %s: the next request would pass the %d-byte budget (--trace-max-bytes); "
                            "the recording takes no more requests", self.path, self.max_bytes)
            self.accepting = False
            self._active.clear()
            return
        self.written_bytes += size
        self._writer.add_request(trace.request_id, trace.domain, trace.prompt_tokens, ids, weights, epochs)
        self.requests += 1
        self.tokens += rows

    # --- control --------------------------------------------------------------------------------
    def dump(self) -> RecordingSummary:
        """Close the trace (atomically renamed into place); sequences still in flight are dropped."""
        dropped = len(self._active)
        self._active.clear()
        self._writer.close()
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
