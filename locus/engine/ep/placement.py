"""Where the experts are, as one object: the plan, its dispatch table, this rank's slots, an epoch.

Every expert-parallel layer reads `runtime.placement` when it is called, so a new placement (a live
re-plan, or a re-plan onto the ranks that survive a failure) is swapped in as one assignment between
two steps; the epoch names which placement a step ran under (docs/design.md, "Expert-parallel serving").

The dispatch rule is the one of locus/routing/dispatch_rule.py. For a source rank s its `position`
part is a lookup: the chosen tier of expert e is one run `start[l, s, e] .. + count[l, s, e]` of the
rank-sorted replica list, and a token at position p takes entry `start + p % count`. `route` does that
lookup with tensors on the model's device (no host sync); the node-aware rule's set cover, needed only
where an expert has replicas on two or more remote nodes, runs on the host through the shared
function itself. tests/engine/ep/test_expert_placement.py checks both against `destination_slots`.

Shape legend: L MoE layers, E experts, K experts per token, T tokens, S slots per rank, R ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from locus.engine.ep.invariant import placement_digest
from locus.routing.dispatch_rule import DispatchTable, build_dispatch_table, destination_slots, table_keys
from locus.routing.plan.placement import PlacementPlan


@dataclass(frozen=True)
class ExpertPlacement:
    plan: PlacementPlan
    table: DispatchTable
    rank: int
    epoch: int
    local_experts: tuple[tuple[int, ...], ...]  # per MoE index: the expert of each of this rank's slots
    start: torch.Tensor  # [L, E + 1] int64: this rank's part of the table (column 0 = no expert)
    count: torch.Tensor  # [L, E + 1] int64
    replica_slots: torch.Tensor  # [L * R * S] int64: physical slot of every replica entry
    digest: int = 0  # what every rank's control header carries: equal on every rank (invariant.py)

    @classmethod
    def build(cls, plan: PlacementPlan, rank: int, epoch: int = 0, device: str | torch.device = "cpu",
              rule: str | None = None) -> "ExpertPlacement":
        table = build_dispatch_table(plan, rule)
        local = tuple(tuple(int(e) for e in plan.slots[moe_index][rank]) for moe_index in range(len(plan.moe_layers)))
        as_tensor = lambda a: torch.as_tensor(np.ascontiguousarray(a), dtype=torch.int64, device=device)  # noqa: E731
        return cls(plan, table, rank, epoch, local, as_tensor(table.start[:, rank]), as_tensor(table.count[:, rank]),
                   as_tensor(table.replica_slots), placement_digest(plan, epoch))

    @property
    def slots_per_gpu(self) -> int:
        return self.plan.topology.slots_per_gpu

    @property
    def host_rule(self) -> bool:
        """True where the node-aware set cover decides some tokens: route() then runs on the host."""
        return self.table.flexible is not None

    def route(self, moe_index: int, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Physical slot of every (token, k): ids [T, K] expert ids (-1 = none), positions [T] each
        token's position in its request -> [T, K] int64 slots, -1 where the id is -1."""
        if self.host_rule:
            keys = table_keys(self.table, ids.cpu().numpy().astype(np.int32)[:, None, :],
                              np.full(ids.shape[0], self.rank), [moe_index])
            slots = destination_slots(self.table, keys, positions.cpu().numpy())[:, 0, :]
            return torch.from_numpy(slots.astype(np.int64)).to(ids.device)
        column = ids.long() + 1  # [T, K]
        entry = self.start[moe_index][column] + positions.long()[:, None] % self.count[moe_index][column]
        return torch.where(ids >= 0, self.replica_slots[entry], -1)
