"""The step's expert routing, produced once and handed to every subscriber.

Who needs the routing of a micro-batch: the expert-load counters behind /metrics, the trace
recorder, the plan's grouper (a request's expert signature from its prefill). Rather than each
copying the step's top-k tensors to the host, the runner's per-layer top-k is packed on the device
(`pack`) and comes back with the step's one readback (host_transfer.Readback), and each subscriber
reads the same host arrays (`publish`). The model records routing at all only while someone is
subscribed.

Rows of sequences that finished after their step was launched (the overlapped schedule's discarded
step, core/launched_step.py; an abort) are not published: subscribers see the tokens a client gets, as a
serial engine's subscribers do.

Shape legend: T batch tokens, L MoE layers (the model's order), K experts per token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from locus.engine.model.forward_batch import ForwardBatch, SequenceSpan
from locus.engine.requests.sequence import ScheduledSeq
from locus.engine.runner.model_runner import RunResult


@dataclass
class StepRouting:
    ids: np.ndarray  # [T, L, K] int16 global expert ids (-1 = none)
    weights: np.ndarray  # [T, L, K] float16 router weights
    items: list[ScheduledSeq]  # the micro-batch, in row order
    rows: list[tuple[SequenceSpan, int, int]]  # per item: its span, first row, end row


Subscriber = Callable[[StepRouting], None]


class RoutingTap:
    def __init__(self, moe_layers: tuple[int, ...]):
        self.layers = tuple(moe_layers)
        self._subscribers: list[Subscriber] = []

    @property
    def active(self) -> bool:
        """Whether the next forward must record routing."""
        return bool(self._subscribers) and bool(self.layers)

    def subscribe(self, subscriber: Subscriber) -> None:
        if subscriber not in self._subscribers:
            self._subscribers.append(subscriber)

    def unsubscribe(self, subscriber: Subscriber) -> None:
        if subscriber in self._subscribers:
            self._subscribers.remove(subscriber)

    def pack(self, result: RunResult) -> torch.Tensor:
        """[T, L, 2K] float32 on the device: every token's expert ids, then their weights (ids are exact
        in float32), one tensor so that the readback moves it in one piece."""
        ids = torch.stack([result.routing[layer].ids for layer in self.layers], dim=1)  # [T, L, K]
        weights = torch.stack([result.routing[layer].weights for layer in self.layers], dim=1)
        return torch.cat([ids.to(torch.float32), weights.to(torch.float32)], dim=2)

    def publish(self, packed: np.ndarray, items: list[ScheduledSeq], batch: ForwardBatch) -> None:
        """Hand one micro-batch's routing (`pack`'s array, on the host) to every subscriber."""
        if not self._subscribers:
            return
        step = self.capture(packed, items, batch)
        for subscriber in list(self._subscribers):
            subscriber(step)

    def capture(self, packed: np.ndarray, items: list[ScheduledSeq], batch: ForwardBatch) -> StepRouting:
        """The subscribers' view of one micro-batch: its live sequences' rows."""
        rows = batch.row_ranges()
        live = [i for i, item in enumerate(items) if not item.seq.is_finished]
        if len(live) < len(items):
            keep = np.concatenate([np.arange(rows[i][1], rows[i][2]) for i in live]) if live else np.zeros(0, np.int64)
            packed, items = packed[keep], [items[i] for i in live]
            starts = np.cumsum([0] + [rows[i][2] - rows[i][1] for i in live])
            rows = [(rows[i][0], int(lo), int(hi)) for i, lo, hi in zip(live, starts[:-1], starts[1:])]
        K = packed.shape[2] // 2
        return StepRouting(packed[:, :, :K].astype(np.int16), packed[:, :, K:].astype(np.float16), items, rows)
