"""Pack a node's expert replicas onto its GPUs: exactly S replicas per GPU, loads as even as possible.

Greedy first (baselines.balanced_pack: heaviest replica to the lightest GPU with a free slot), then
swaps: the most loaded GPU trades one replica with a replica of any other GPU whenever that lowers the
larger of the two GPUs' loads. Greedy alone leaves a few percent on the table when S is small (3
slots per GPU: the last round has no light items left to even things out); the swaps recover most of
it. Every row (a layer's node) is packed independently, all rows at once.

Shape legend: M rows (layer x node), C = G * S replicas per node, G GPUs per node.
    weights [M, C] float   ->   gpu [M, C] int in 0..G-1, each value exactly S times per row
"""

from __future__ import annotations

import numpy as np

from locus.routing.planners.baselines import balanced_pack

MAX_SWAP_ROUNDS = 64


def pack_replicas(weights: np.ndarray, gpus: int) -> np.ndarray:
    """GPU of every replica, [M, C] (see the module docstring)."""
    weights = np.asarray(weights, dtype=np.float64)
    gpu, _ = balanced_pack(weights, gpus)
    return improve_by_swaps(weights, gpu, gpus)


def gpu_sums(weights: np.ndarray, gpu: np.ndarray, gpus: int) -> np.ndarray:
    """Load of every GPU, [M, G]."""
    M = weights.shape[0]
    keys = np.arange(M)[:, None] * gpus + gpu
    return np.bincount(keys.ravel(), weights=weights.ravel(), minlength=M * gpus).reshape(M, gpus)


def improve_by_swaps(weights: np.ndarray, gpu: np.ndarray, gpus: int, rounds: int = MAX_SWAP_ROUNDS) -> np.ndarray:
    gpu = gpu.copy()
    M, C = weights.shape
    rows = np.arange(M)
    active = np.ones(M, dtype=bool)
    for _ in range(rounds):
        idx = np.flatnonzero(active)
        if len(idx) == 0:
            break
        w, g = weights[idx], gpu[idx]
        sums = gpu_sums(w, g, gpus)  # [m, G]
        top = sums.argmax(1)  # the most loaded GPU of every row
        on_top = g == top[:, None]  # [m, C]
        load_top = sums[rows[: len(idx)], top]  # [m]
        load_other = np.take_along_axis(sums, g, 1)  # [m, C] load of the GPU of item j
        # Swap item i (on the top GPU) with item j (elsewhere): [m, C(i), C(j)].
        diff = w[:, :, None] - w[:, None, :]
        new_top = load_top[:, None, None] - diff
        new_other = load_other[:, None, :] + diff
        worst = np.maximum(new_top, new_other)
        ok = on_top[:, :, None] & ~on_top[:, None, :]
        worst = np.where(ok, worst, np.inf)
        flat = worst.reshape(len(idx), -1).argmin(1)
        best = worst.reshape(len(idx), -1)[np.arange(len(idx)), flat]
        improves = best < load_top * (1 - 1e-9)
        active[idx[~improves]] = False
        i, j = np.divmod(flat[improves], C)
        r = idx[improves]
        gi, gj = gpu[r, i].copy(), gpu[r, j].copy()
        gpu[r, i], gpu[r, j] = gj, gi
    return gpu
