"""The expert-parallel invariant: a rank answers only with the placement every rank holds.

Two checks keep it, both cheap:
- *The placement.* Every rank puts the digest of the placement its next step routes by (epoch,
  topology, every layer's slots, the dispatch rule) into its control header, which every rank
  receives; a step runs only when all digests are equal (control.py, worker.py). A placement only ever
  changes before the header (a live move's layers, a regroup), so the step of an iteration runs under
  the placement whose digest was checked in it.
- *The weights.* At start-up each rank fingerprints the experts it holds (a hash of an evenly spaced
  sample of each one's weights) and the ranks share them: a reference per (layer, expert), checked to
  agree between replicas. After every placement change a rank re-checks the slots that changed
  against it; a slot holding the wrong weights turns the rank's header digest into BROKEN.

A disagreement is never repaired silently: every rank sees the same headers and raises
`PlacementDisagreement` in the same iteration, before stepping; rank 0 fails every request with an
error and the server turns unhealthy and exits (a rank that may hold wrong weights must not answer).

Shape legend: L MoE layers, E experts, S slots per rank, W ranks.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch
import torch.distributed as dist

from locus.engine.model.expert_rows import ExpertWeight, parts
from locus.kernels.formats import QuantizedTensor

BROKEN = -1  # a header digest that never agrees: this rank's weights do not match its placement
FINGERPRINT_SAMPLES = 2048  # elements sampled from each of an expert's two weight tensors


class PlacementDisagreement(Exception):
    """Ranks hold different placements (or wrong weights for theirs): none of them may answer."""


def placement_digest(plan, epoch: int) -> int:
    """A 63-bit digest of what a step routes by: the epoch, topology, layers, slots and dispatch rule."""
    h = hashlib.blake2b(digest_size=8)
    topo = plan.topology
    h.update(repr((int(epoch), topo.nodes, topo.gpus_per_node, topo.slots_per_gpu, tuple(int(x) for x in plan.moe_layers),
                   plan.dispatch)).encode())
    h.update(np.ascontiguousarray(np.asarray(plan.slots, dtype=np.int64)).tobytes())
    return int.from_bytes(h.digest(), "little") >> 1


def expert_fingerprint(gate_up: ExpertWeight, down: ExpertWeight) -> int:
    """A 63-bit fingerprint of one expert's weights (never 0): a hash of a sample of each tensor, a
    narrow expert's elements and scales both (model/expert_rows.py), its format in the hash."""
    h = hashlib.blake2b(digest_size=8)
    for weight in (gate_up, down):
        if isinstance(weight, QuantizedTensor):
            h.update(repr((weight.format, tuple(weight.shape), weight.axis)).encode())
        for t in parts(weight):
            flat = t.reshape(-1)
            sample = flat[:: max(1, flat.numel() // FINGERPRINT_SAMPLES)].contiguous()
            h.update(repr((tuple(t.shape), str(t.dtype))).encode())
            h.update(sample.view(torch.uint8).cpu().numpy().tobytes())
    return (int.from_bytes(h.digest(), "little") >> 1) or 1


def held_fingerprints(runtime, moe_indices=None) -> dict[tuple[int, int], list[int]]:
    """{(MoE index, expert): fingerprints of each slot of this rank holding it}, for `moe_indices` (default all)."""
    out: dict[tuple[int, int], list[int]] = {}
    local = runtime.placement.local_experts
    for moe_index in range(len(runtime.layers)) if moe_indices is None else moe_indices:
        layer = runtime.layers[moe_index]
        for j, e in enumerate(local[moe_index]):
            out.setdefault((moe_index, int(e)), []).append(expert_fingerprint(layer.gate_up_proj[j], layer.down_proj[j]))
    return out


def share_fingerprints(runtime, group, num_experts: int) -> np.ndarray:
    """Every rank's fingerprints of the experts it holds, gathered: the reference [L, E] (a collective
    on `group`). Raises PlacementDisagreement when two holders of an expert hold different weights."""
    L = len(runtime.layers)
    mine = torch.zeros((L, num_experts), dtype=torch.int64)
    for (moe_index, e), prints in held_fingerprints(runtime).items():
        if len(set(prints)) > 1:
            raise PlacementDisagreement(f"this rank holds expert {e} of MoE index {moe_index} twice, with different weights")
        mine[moe_index, e] = prints[0]
    world = dist.get_world_size(group)
    gathered = torch.empty((world * L * num_experts,), dtype=torch.int64)
    dist.all_gather_single(gathered, mine.reshape(-1), group=group)
    table = gathered.view(world, L, num_experts).numpy()
    reference = table.max(axis=0)
    differs = (table != 0) & (table != reference[None])
    if differs.any():
        r, moe_index, e = (int(v) for v in np.argwhere(differs)[0])
        raise PlacementDisagreement(f"rank {r} holds other weights for expert {e} of MoE index {moe_index} than another holder")
    return reference


def wrong_slots(runtime, moe_indices=None) -> list[tuple[int, int]]:
    """(MoE index, expert) of this rank's slots whose weights are not the reference's, over `moe_indices` (default all)."""
    reference = runtime.fingerprints
    if reference is None:
        return []
    return [(moe_index, e) for (moe_index, e), prints in held_fingerprints(runtime, moe_indices).items()
            if any(p != reference[moe_index, e] for p in prints)]
