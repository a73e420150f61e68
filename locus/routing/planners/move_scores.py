"""The cap search's move scores on the ranks a move touches (even remote spread).

A move changes the copies of two experts p and q only, and an expert puts load only on ranks holding
it, so a rank that holds neither before nor after the move keeps its load. A move's overload change
is therefore a sum over its touched ranks: those holding p or q before, plus the rank each gains a
copy on. With few slots per GPU an expert has a handful of copies, so scoring B moves costs B x W
(W: at most twice the most copies any expert has, plus two) instead of B x R: what makes the search
affordable at hundreds of ranks. The figures are slot_search's own rule (contributions), per rank;
only the sum over ranks runs over fewer terms.

Shape legend: R ranks, N nodes, G GPUs per node, E experts, B moves, W touched ranks per move.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class ExpertState:
    """Each expert's copies and demand before the move, the terms a one-copy change is computed from."""

    demand: np.ndarray  # [E, N] node demand
    h: np.ndarray  # [E, R] copies per rank
    x: np.ndarray  # [E, N] copies per node
    with_e: np.ndarray  # [E, N] ranks of the node holding the expert
    remote: np.ndarray  # [E] demand of nodes holding no copy
    total: np.ndarray  # [E] copies
    holders: np.ndarray  # [E, C] ranks holding the expert, padded with R
    holding: np.ndarray  # [E] ranks holding the expert (holders' unpadded width)
    gpus: int

    @classmethod
    def of(cls, dT: np.ndarray, hT: np.ndarray, gpus: int) -> "ExpertState":
        x, with_e, remote, total, holders, count = _expert_rows(dT, hT, gpus)
        return cls(dT, hT, x, with_e, remote, total, holders, count, gpus)

    def refreshed(self, experts: np.ndarray) -> "ExpertState":
        """The state after the caller changed experts' rows of h (in place): those rows recomputed, in place,
        by `of`'s own rows (_expert_rows: each row depends on its own expert only), so every figure equals
        `of` on the new h; a new state when the most copies any expert has changes (holders' width)."""
        width = self.holders.shape[1]
        x, with_e, remote, total, holders, count = _expert_rows(self.demand[experts], self.h[experts], self.gpus,
                                                                width)
        self.holding[experts] = count
        if max(int(self.holding.max()), 1) != width:
            return ExpertState.of(self.demand, self.h, self.gpus)
        self.x[experts], self.with_e[experts], self.remote[experts] = x, with_e, remote
        self.total[experts], self.holders[experts] = total, holders
        return self

    def remote_after(self, e: np.ndarray, lose: np.ndarray, get: np.ndarray) -> np.ndarray:
        """Expert e's [B] remote demand after losing a copy on rank lose and gaining one on get [B] (-1:
        none): the gaining node stops being remote, the losing node may start."""
        G = self.gpus
        nl, ng = np.where(lose >= 0, lose // G, -1), np.where(get >= 0, get // G, -1)
        x_ng = np.where(ng >= 0, self.x[e, np.maximum(ng, 0)], 1)
        x_nl = np.where(nl >= 0, self.x[e, np.maximum(nl, 0)] - 1 + (ng == nl), 1)
        return (self.remote[e] - np.where((ng >= 0) & (x_ng == 0), self.demand[e, np.maximum(ng, 0)], 0.0)
                + np.where((nl >= 0) & (x_nl == 0), self.demand[e, np.maximum(nl, 0)], 0.0))

    def changed(self, e: np.ndarray, lose: np.ndarray, get: np.ndarray, cols: np.ndarray):
        """Expert e [B] losing a copy on rank lose [B] and gaining one on get [B] (-1: none): its load on
        ranks cols [B, W] afterwards (contributions' rule), and its remote demand afterwards [B]."""
        G = self.gpus
        nl, ng = np.where(lose >= 0, lose // G, -1), np.where(get >= 0, get // G, -1)
        E, N = self.x.shape
        R = N * G
        nc = cols // G
        # (expert, node) and (expert, rank) of every column as flat indices: one gather each from the
        # flattened arrays instead of two-axis indexing, the same elements
        at_node = e[:, None] * N + nc
        # copies per node and ranks holding it, on each column's node, after the move
        on_nl, on_ng = nc == nl[:, None], nc == ng[:, None]
        x_c = self.x.ravel().take(at_node) - on_nl + on_ng
        h_lose = self.h[e, np.maximum(lose, 0)]
        h_get = self.h[e, np.maximum(get, 0)]
        with_c = (self.with_e.ravel().take(at_node) - (on_nl & ((lose >= 0) & (h_lose == 1))[:, None])
                  + (on_ng & ((get >= 0) & (h_get == 0))[:, None]))
        h_c = self.h.ravel().take(e[:, None] * R + cols) - (cols == lose[:, None]) + (cols == get[:, None])
        remote = self.remote_after(e, lose, get)
        total = self.total[e] - (lose >= 0) + (get >= 0)
        rho = remote / np.maximum(total, 1)
        per_rank = self.demand.ravel().take(at_node) / G
        spill = np.where(x_c > 0, per_rank * (G - with_c) / np.maximum(x_c, 1), 0.0)
        load = (h_c > 0) * per_rank + h_c * (spill + rho[:, None])
        return load, remote


def _expert_rows(dT: np.ndarray, hT: np.ndarray, gpus: int, width: int | None = None):
    """ExpertState's terms for K experts' rows, demand dT [K, N] and copies hT [K, R]: copies per node [K, N],
    holding ranks per node [K, N], remote demand [K], copies [K], holders [K, width] (padded with R; width
    default: the rows' most holders) and holding ranks [K]."""
    K, R = hT.shape
    h3 = hT.reshape(K, R // gpus, gpus)
    x = h3.sum(-1)
    has = hT > 0
    count = has.sum(1)
    if width is None:
        width = max(int(count.max()), 1)
    holders = np.argsort(~has, axis=1, kind="stable")[:, :width]
    holders[np.arange(width)[None, :] >= count[:, None]] = R
    return x, (h3 > 0).sum(-1), np.where(x > 0, 0.0, dT).sum(-1), x.sum(-1), holders, count


def touched_ranks(state: ExpertState, p: np.ndarray, get_p: np.ndarray, q: np.ndarray, get_q: np.ndarray) -> np.ndarray:
    """The ranks moves changing experts p and q [B] can change the load of, [B, W] ascending, each once,
    padded with R: the ranks holding p or q, and the ranks gaining a copy (get_*; -1: none). Two moves
    whose touched ranks do not meet change different experts on different ranks, so each one's figures
    hold with the other applied."""
    R = state.h.shape[1]
    extra = np.stack([np.where(get_p >= 0, get_p, R), np.where(get_q >= 0, get_q, R)], 1)
    cols = np.sort(np.concatenate([state.holders[p], state.holders[q], extra], 1), 1)
    dup = np.zeros(cols.shape, dtype=bool)
    dup[:, 1:] = cols[:, 1:] == cols[:, :-1]
    cols[dup] = R
    return np.sort(cols, 1)


def overload_change(state: ExpertState, loads: np.ndarray, contrib: np.ndarray, target: float,
                    p: np.ndarray, lose_p: np.ndarray, get_p: np.ndarray,
                    q: np.ndarray, lose_q: np.ndarray, get_q: np.ndarray,
                    cols: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """For moves changing experts p and q [B] (each losing a copy on lose_*, gaining one on get_*; -1:
    none): the overload they remove (sum over ranks of load above target, before minus after) and the
    local pairs they gain, both [B]. The overload is summed over cols [B, W] (distinct ranks, padded with
    R), by default every touched rank (touched_ranks: the exact figure); fewer ranks give the part of the
    change those ranks see, a cheaper estimate."""
    R = loads.shape[0]
    if cols is None:
        cols = touched_ranks(state, p, get_p, q, get_q)
    keep = cols < R
    cols = np.minimum(cols, R - 1)
    new_p, remote_p = state.changed(p, lose_p, get_p, cols)
    new_q, remote_q = state.changed(q, lose_q, get_q, cols)
    old = loads[cols]
    flat = contrib.ravel()
    new = old - flat.take(p[:, None] * R + cols) - flat.take(q[:, None] * R + cols) + new_p + new_q
    over_old = np.maximum(old - target, 0.0)
    over_new = np.maximum(new - target, 0.0)
    reduced = ((over_old - over_new) * keep).sum(1)
    gain_local = (state.remote[p] - remote_p) + (state.remote[q] - remote_q)
    return reduced, gain_local
