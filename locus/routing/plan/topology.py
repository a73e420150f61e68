"""The cluster shape a placement plan is laid out on: nodes x GPUs per node, expert slots per GPU.

Ranks are numbered node-major: rank r lives on node `r // gpus_per_node` (so a node's ranks are one
contiguous block, which the dispatch tables rely on). Every rank has `slots_per_gpu` expert slots per
MoE layer; `slots_per_gpu * ranks >= num_experts`, and slots beyond that hold replicas.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from locus.errors import LocusError

_SHAPE = re.compile(r"^\s*(\d+)\s*[xX]\s*(\d+)\s*$")


@dataclass(frozen=True)
class Topology:
    nodes: int
    gpus_per_node: int
    slots_per_gpu: int

    def __post_init__(self) -> None:
        for name in ("nodes", "gpus_per_node", "slots_per_gpu"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise LocusError(f"topology: {name} must be a positive integer, got {value!r}")

    @property
    def ranks(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def total_slots(self) -> int:
        return self.ranks * self.slots_per_gpu

    def node_of(self, rank: int) -> int:
        if not 0 <= rank < self.ranks:
            raise LocusError(f"rank {rank} is outside topology {self} ({self.ranks} ranks)")
        return rank // self.gpus_per_node

    def rank_nodes(self) -> np.ndarray:
        """Node of every rank, [ranks] int64."""
        return np.arange(self.ranks, dtype=np.int64) // self.gpus_per_node

    def check_fits(self, num_experts: int) -> None:
        """Raise unless every one of `num_experts` experts can have at least one slot."""
        if self.total_slots < num_experts:
            need = -(-num_experts // self.ranks)
            raise LocusError(
                f"topology {self} has {self.total_slots} expert slots per layer, fewer than the "
                f"{num_experts} experts; use at least {need} slots per GPU"
            )

    def to_dict(self) -> dict:
        return {"nodes": self.nodes, "gpus_per_node": self.gpus_per_node, "slots_per_gpu": self.slots_per_gpu}

    def __str__(self) -> str:
        return f"{self.nodes}x{self.gpus_per_node} ({self.slots_per_gpu} slots/GPU)"


def parse_topology(text: str, num_experts: int, slots: int | None = None) -> Topology:
    """Topology from "NxG" (nodes x GPUs per node).

    Without `slots`, each GPU gets the fewest slots that hold every expert once
    (ceil(num_experts / ranks)); pass more to leave room for replicas.
    """
    match = _SHAPE.match(text or "")
    if not match:
        raise LocusError(f"topology {text!r} is not of the form NODESxGPUS, e.g. 2x8")
    nodes, gpus = int(match.group(1)), int(match.group(2))
    if nodes < 1 or gpus < 1:
        raise LocusError(f"topology {text!r}: nodes and GPUs per node must be at least 1")
    if slots is None:
        slots = -(-num_experts // (nodes * gpus))
    topology = Topology(nodes, gpus, slots)
    topology.check_fits(num_experts)
    return topology
