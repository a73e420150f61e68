"""Running count of the (token, slot) pairs routed to each expert of each MoE layer.

Fed by the engine after every micro-batch; read by /metrics (and by anyone who wants to see the
skew that the planner exploits) without touching the engine thread's tensors.
"""

from __future__ import annotations

import threading

import numpy as np

from locus.engine.observers.routing_tap import StepRouting
from locus.traces.counts import count_expert_ids


class ExpertLoadCounter:
    def __init__(self, moe_layers: tuple[int, ...], num_experts: int):
        self.moe_layers, self.num_experts = tuple(moe_layers), num_experts
        self._counts = np.zeros((len(self.moe_layers), num_experts), dtype=np.int64)
        self._lock = threading.Lock()

    def __call__(self, step: StepRouting) -> None:
        """A routing-tap subscriber: add the micro-batch's (token, slot) pairs per layer and expert."""
        counts = count_expert_ids(step.ids, self.num_experts)  # [L, E]
        with self._lock:
            self._counts += counts

    def totals(self) -> np.ndarray:
        """[L, E] a copy of the counts so far."""
        with self._lock:
            return self._counts.copy()

    def snapshot(self) -> dict[int, list[int]]:
        """layer index -> tokens routed to each expert so far."""
        with self._lock:
            return {layer: self._counts[i].tolist() for i, layer in enumerate(self.moe_layers)}
