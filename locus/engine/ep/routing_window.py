"""The live routing window a re-plan is made from: each rank keeps the routing of the last W tokens
it ran (a routing-tap subscriber), with each token's request, domain and position.

On a re-plan rank 0 asks every rank for its window (the next report carries it), joins them and
writes them as a small locus-trace: one trace request per (rank, request) seen in the window, its trace
tokens in position order, `prompt_tokens` those that were prompt. That is what the plan's own planner
plans from, and what the replay that predicts the saving replays.

Shape legend: W window tokens, L MoE layers, K experts per token.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from locus.engine.observers.routing_tap import StepRouting
from locus.traces.format import RequestRecord, TraceMeta
from locus.traces.writer import TraceWriter


@dataclass
class WindowTokens:
    """A rank's window, oldest first (what a report carries): W trace tokens."""

    request_ids: list[str]  # [W]
    domains: list[str]  # [W]
    positions: np.ndarray  # [W] int64: the token's position in its request
    prompt: np.ndarray  # [W] bool: a prompt token (prefill)
    ids: np.ndarray  # [W, L, K] int16

    def __len__(self) -> int:
        return len(self.request_ids)


class RoutingWindow:
    def __init__(self, tokens: int, num_layers: int, top_k: int):
        self.capacity = int(tokens)
        self.ids = np.full((self.capacity, num_layers, top_k), -1, dtype=np.int16)
        self.positions = np.zeros(self.capacity, dtype=np.int64)
        self.prompt = np.zeros(self.capacity, dtype=bool)
        self.request_ids: list[str] = [""] * self.capacity
        self.domains: list[str] = [""] * self.capacity
        self.written = 0  # tokens seen so far; slot = written % capacity

    def __call__(self, step: StepRouting) -> None:
        """A routing-tap subscriber: keep each token of the micro-batch, overwriting the oldest."""
        for item, (span, lo, hi) in zip(step.items, step.rows):
            seq = item.seq
            request = seq.request
            key = request.request_id if request.params.n == 1 else f"{request.request_id}#{seq.index}"
            skip = max(0, hi - lo - self.capacity)  # only the last `capacity` tokens can stay
            lo, n = lo + skip, hi - lo - skip
            slots = (self.written + np.arange(n)) % self.capacity
            positions = span.start + skip + np.arange(n)
            self.ids[slots] = step.ids[lo:hi]
            self.positions[slots] = positions
            self.prompt[slots] = positions < len(seq.prompt_ids)
            for slot in slots.tolist():
                self.request_ids[slot] = key
                self.domains[slot] = request.domain or ""
            self.written += n

    def tokens(self) -> WindowTokens:
        n = min(self.written, self.capacity)
        start = self.written % self.capacity if self.written > self.capacity else 0
        order = (start + np.arange(n)) % self.capacity
        return WindowTokens([self.request_ids[i] for i in order], [self.domains[i] for i in order],
                          self.positions[order].copy(), self.prompt[order].copy(), self.ids[order].copy())


def write_window_trace(path: Path, meta: TraceMeta, windows: dict[int, WindowTokens]) -> int:
    """The windows of every rank as one trace (requests carry the rank they ran on); returns its tokens."""
    writer = TraceWriter(path, meta, overwrite=True)
    tokens = 0
    try:
        for rank, window in sorted(windows.items()):
            if not len(window):
                continue
            keys = np.array(window.request_ids)
            for request_id in dict.fromkeys(window.request_ids):  # first-seen order
                index = np.flatnonzero(keys == request_id)  # its window tokens
                index = index[np.argsort(window.positions[index], kind="stable")]
                prompt = int(window.prompt[index].sum())
                record = RequestRecord(f"{request_id}@{rank}", window.domains[index[0]], prompt, len(index), rank=rank)
                writer.add_requests([record], window.ids[index])
                tokens += len(index)
        writer.close()
    except BaseException:
        writer.abort()
        raise
    return tokens
