"""What a rank's expert-parallel runtime counts: bytes by tier and direction, tokens, expert load,
collectives, and where a step's time went.

Payload bytes follow docs/design.md (sends of one row's payload, dispatch and combine each, counted by
the sending rank: H * dtype_bytes in the model's dtype, H + ceil(H/32) in an MX format, docs/formats.md); routing metadata (slot ids and weights) is counted apart; wire bytes are what
the collectives really put on the network, padding and packed metadata included (never payload).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

TIERS = ("inter_node", "intra_node")
DIRECTIONS = ("dispatch", "combine")


@dataclass
class ExchangeCounters:
    inter_node_dispatch: int = 0
    inter_node_combine: int = 0
    intra_node_dispatch: int = 0
    intra_node_combine: int = 0
    metadata: int = 0
    wire_inter_node_dispatch: int = 0
    wire_inter_node_combine: int = 0
    wire_intra_node_dispatch: int = 0
    wire_intra_node_combine: int = 0
    token_layers: int = 0  # (token, MoE layer) pairs that entered an exchange on this rank (own rows)
    expert_pairs: int = 0  # (row, slot) pairs this rank's experts computed: its expert load, summed over layers
    collectives: int = 0  # exchange collectives this rank issued
    exchange_s: float = 0.0  # wall time inside the exchanges, less the local expert compute
    expert_s: float = 0.0  # wall time of the local expert compute (on CUDA: launch time, no sync is forced)
    # requests moved out after their prefill (docs/planner.md): the KV payload sent, by where the target is
    migration_inter_node: int = 0
    migration_intra_node: int = 0
    migrations: int = 0

    @property
    def inter_node(self) -> int:
        return self.inter_node_dispatch + self.inter_node_combine

    @property
    def intra_node(self) -> int:
        return self.intra_node_dispatch + self.intra_node_combine

    @property
    def wire(self) -> int:
        return sum(getattr(self, f"wire_{t}_{d}") for t in TIERS for d in DIRECTIONS)

    def add(self, other: "ExchangeCounters") -> "ExchangeCounters":
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        return self

    @classmethod
    def total(cls, parts) -> "ExchangeCounters":
        out = cls()
        for part in parts:
            out.add(part)
        return out


class DeviceTally:
    """Counts that live on the device until read: the fixed-capacity exchange never syncs the host to
    count (on CUDA that would stall the stream). Adding is a list append, no tensor op; `drain` sums
    each name's values in one op and reads them once."""

    NAMES = ("inter_node_bytes", "intra_node_bytes", "inter_node_combine_bytes", "intra_node_combine_bytes",
             "expert_pairs", "metadata_bytes")

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = device
        self.pending: dict[str, list] = {name: [] for name in self.NAMES}

    def add(self, name: str, value: torch.Tensor | int) -> None:
        self.pending[name].append(value)

    def mark(self) -> dict[str, int]:
        """Where each name's values stand now (rewind goes back here)."""
        return {name: len(values) for name, values in self.pending.items()}

    def rewind(self, mark: dict[str, int]) -> None:
        """Drop what was added since `mark` (no drain in between)."""
        for name, values in self.pending.items():
            del values[mark[name]:]

    def drain(self) -> dict[str, int]:
        """The counts since the last drain, then zero."""
        counts = {}
        for name, values in self.pending.items():
            counts[name] = int(torch.stack([torch.as_tensor(v, device=self.device) for v in values]).sum()) if values else 0
            values.clear()
        return counts


@dataclass
class StepTimes:
    """Seconds one rank spent in the iterations where it ran a step."""

    steps: int = 0
    step_s: float = 0.0  # wall time of those iterations, control exchange to report
    control_s: float = 0.0  # in control collectives (gloo): commands, work agreement, reports
    exchange_s: float = 0.0  # in the MoE exchanges, less the local expert compute

    @property
    def compute_s(self) -> float:
        return max(self.step_s - self.control_s - self.exchange_s, 0.0)
