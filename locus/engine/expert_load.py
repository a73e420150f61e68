"""Running count of the (token, slot) pairs routed to each expert of each MoE layer.

Fed by the engine after every micro-batch; read by /metrics (and by anyone who wants to see the
skew that the planner exploits) without touching the engine thread's tensors.
"""

from __future__ import annotations

import threading

import torch

from locus.engine.grouping import ScheduledSeq
from locus.engine.runner import RunResult


class ExpertLoadCounter:
    def __init__(self, moe_layers: tuple[int, ...], num_experts: int):
        self.moe_layers, self.num_experts = tuple(moe_layers), num_experts
        self._row = {layer: i for i, layer in enumerate(self.moe_layers)}
        self._counts = torch.zeros(len(self.moe_layers), num_experts, dtype=torch.long)
        self._lock = threading.Lock()

    def __call__(self, result: RunResult, items: list[ScheduledSeq]) -> None:
        if not result.routing:
            return
        rows = []
        for layer, topk in result.routing.items():
            rows.append(torch.bincount(topk.ids.reshape(-1).cpu(), minlength=self.num_experts))
        with self._lock:
            for layer, counts in zip(result.routing, rows):
                self._counts[self._row[layer]] += counts

    def snapshot(self) -> dict[int, list[int]]:
        """layer index -> tokens routed to each expert so far."""
        with self._lock:
            return {layer: self._counts[i].tolist() for i, layer in enumerate(self.moe_layers)}
