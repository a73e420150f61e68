"""The step's expert routing, produced once and handed to every subscriber.

Who needs the routing of a micro-batch: the expert-load counters behind /metrics, the trace
recorder, the plan's grouper (a request's expert signature from its prefill). Each used to copy the
step's top-k tensors to the host on its own. Here the runner's per-layer top-k is packed and copied
to the host in ONE transfer per micro-batch, and each subscriber reads the same host arrays. The
model records routing at all only while someone is subscribed.

Shape legend: T batch tokens, L MoE layers (the model's order), K experts per token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch

from locus.engine.model.forward_batch import SequenceSpan
from locus.engine.grouping import ScheduledSeq
from locus.engine.runner import RunResult


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

    def publish(self, result: RunResult, items: list[ScheduledSeq]) -> None:
        if not self._subscribers or not result.routing:
            return
        step = self.capture(result, items)
        for subscriber in list(self._subscribers):
            subscriber(step)

    def capture(self, result: RunResult, items: list[ScheduledSeq]) -> StepRouting:
        ids = torch.stack([result.routing[layer].ids for layer in self.layers], dim=1)  # [T, L, K]
        weights = torch.stack([result.routing[layer].weights for layer in self.layers], dim=1)
        # ids and weights travel together as one float32 tensor: expert ids are exact in float32
        host = torch.cat([ids.to(torch.float32), weights.to(torch.float32)], dim=2).cpu().numpy()
        K = ids.shape[2]
        return StepRouting(host[:, :, :K].astype(np.int16), host[:, :, K:].astype(np.float16), items,
                           result.batch.row_ranges())
