"""Vectorised sampling of K distinct experts per token from per-token mixtures (no per-token loop).

Each token t draws from
    q_t = (1 - lam) * probs[rows[t]] + lam * uniform over succ[t]      (succ: K experts, or none)
K distinct experts in order, without replacement: the Plackett-Luce / Gumbel-top-k law. i.i.d. draws
from q_t, keeping the first K distinct values, follow exactly that law (successive sampling), so:
draw a few more than K per token (inverse CDF over the stacked rows, plus the succ draws), keep
the first K distinct, give the rows that came up short more draws, and finish the rare row still
short with an exact Gumbel-top-k continuation that keeps what it already drew.

Shape legend: T tokens, K experts per token, E experts, M draws per token, rows of probs: one
distribution per (request, phase).
"""

from __future__ import annotations

import numpy as np


def softmax(x: np.ndarray) -> np.ndarray:
    """Row-wise softmax of logits [rows, E]."""
    x = np.exp(x - x.max(axis=1, keepdims=True))
    return x / x.sum(axis=1, keepdims=True)


class InverseCdf:
    """Draws from many categorical rows at once: inverse CDF with a guide table.

    The rows' CDFs are stacked into one increasing array (row r occupies (r, r + 1]); the guide
    table says where bucket b/E of row r starts, so a draw costs a lookup and a step or two of
    linear search instead of a binary search over every row.
    """

    def __init__(self, probs: np.ndarray):  # probs [rows, E]
        n_rows, self.E = probs.shape
        cdf = np.cumsum(probs, axis=1)
        cdf[:, -1] = 1.0
        flat = (cdf + np.arange(n_rows)[:, None]).ravel()
        self.flat = np.append(flat, np.inf)  # sentinel: a key rounded up to r + 1 stops here
        grid = np.arange(self.E) / self.E + np.arange(n_rows)[:, None]  # [rows, E], sorted
        self.guide = np.searchsorted(self.flat, grid.ravel(), side="right")

    def draw(self, rows: np.ndarray, m: int, rng: np.random.Generator) -> np.ndarray:
        """m draws per entry of rows -> expert ids [len(rows), m]."""
        u = rng.random((rows.shape[0], m))
        key = (u + rows[:, None]).ravel()
        bucket = np.minimum((u * self.E).astype(np.int64), self.E - 1)
        idx = self.guide[(rows[:, None] * self.E + bucket).ravel()]
        need = np.nonzero(self.flat[idx] <= key)[0]
        while need.size:  # entries, not tokens: a few shrinking passes
            idx[need] += 1
            need = need[self.flat[idx[need]] <= key[need]]
        draws = idx.reshape(-1, m) - rows[:, None] * self.E
        return np.minimum(draws, self.E - 1, out=draws)


def _draw(sampler: InverseCdf, rows: np.ndarray, succ: np.ndarray | None, lam: float, m: int,
          rng: np.random.Generator) -> np.ndarray:
    """m i.i.d. draws [T', m] from each token's mixture q (token t uses probability row rows[t])."""
    draws = sampler.draw(rows, m, rng)
    if succ is not None:
        follow = np.nonzero(rng.random(draws.shape) < lam)
        slot = rng.integers(0, succ.shape[1], size=follow[0].shape[0])
        draws[follow] = succ[follow[0], slot]
    return draws


def sample_topk(probs: np.ndarray, rows: np.ndarray, succ: np.ndarray | None, lam: float, K: int,
                rng: np.random.Generator) -> np.ndarray:
    """K distinct experts per token [T, K] in draw order; token t mixes probs[rows[t]] and succ[t]."""
    sampler = InverseCdf(probs)
    T = rows.shape[0]
    if K == 1:
        return _draw(sampler, rows, succ, lam, 1, rng)
    out = np.empty((T, K), dtype=np.int64)
    pending = np.arange(T)
    draws = np.empty((T, 0), dtype=np.int64)
    m = K + K // 2
    while pending.size and m <= 64 * K:
        sub_succ = None if succ is None else succ[pending]
        fresh = _draw(sampler, rows[pending], sub_succ, lam, m - draws.shape[1], rng)
        draws = np.concatenate([draws, fresh], axis=1)
        picked, ok = _first_distinct(draws, K)
        out[pending[ok]] = picked
        pending, draws = pending[~ok], draws[~ok]
        m *= 2
    if pending.size:
        rest_succ = None if succ is None else succ[pending]
        out[pending] = finish_gumbel(probs, rows[pending], rest_succ, lam, draws, K, rng)
    return out


def _first_distinct(draws: np.ndarray, K: int) -> tuple[np.ndarray, np.ndarray]:
    """First K distinct values of each row in order of appearance [T_ok, K], and which rows have K."""
    order = np.argsort(draws, axis=1, kind="stable")
    sorted_vals = np.take_along_axis(draws, order, axis=1)
    first_sorted = np.ones_like(draws, dtype=bool)
    first_sorted[:, 1:] = sorted_vals[:, 1:] != sorted_vals[:, :-1]  # stable: earliest copy comes first
    first = np.zeros_like(first_sorted)
    np.put_along_axis(first, order, first_sorted, axis=1)
    ok = first.sum(axis=1) >= K
    keep = first[ok] & (np.cumsum(first[ok], axis=1) <= K)
    return draws[ok][keep].reshape(-1, K), ok


def _mixture(probs: np.ndarray, rows: np.ndarray, succ: np.ndarray | None, lam: float) -> np.ndarray:
    """Each token's full q [T', E]."""
    q = probs[rows]
    if succ is not None:
        q *= 1 - lam
        np.add.at(q, (np.arange(q.shape[0])[:, None], succ), lam / succ.shape[1])
    return q


def finish_gumbel(probs: np.ndarray, rows: np.ndarray, succ: np.ndarray | None, lam: float, draws: np.ndarray,
                  K: int, rng: np.random.Generator) -> np.ndarray:
    """Complete rows whose draws hold < K distinct experts: keep those (in order), Gumbel-top-k the rest."""
    with np.errstate(divide="ignore"):
        score = np.log(_mixture(probs, rows, succ, lam)) + rng.gumbel(size=(rows.shape[0], probs.shape[1]))
    # Experts already drawn keep their order of appearance ahead of every fresh one.
    for j in range(draws.shape[1] - 1, -1, -1):  # columns, not tokens: reverse so the earliest wins
        score[np.arange(rows.shape[0]), draws[:, j]] = 1e6 - j
    return np.argsort(-score, axis=1, kind="stable")[:, :K]


def routing_weights(probs: np.ndarray, rows: np.ndarray, succ: np.ndarray | None, lam: float,
                    chosen: np.ndarray) -> np.ndarray:
    """Routing weights [T, K]: q of each chosen expert, renormalised over the K (softmax-top-k style)."""
    w = probs[rows[:, None], chosen]
    if succ is not None:
        hits = (chosen[:, :, None] == succ[:, None, :]).sum(axis=2)  # [T, K]
        w = (1 - lam) * w + lam * hits / succ.shape[1]
    return (w / w.sum(axis=1, keepdims=True)).astype(np.float16)
