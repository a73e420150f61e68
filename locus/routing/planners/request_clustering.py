"""Balanced clustering of requests by expert signature: the planner's starting grouping for requests
that carry no domain tag.

Features: each request's expert histogram per layer, normalised per layer, concatenated and projected
to at most PROJECTED dimensions by a seeded Gaussian matrix (distances survive a random projection
well, and k-means on 58 x 256 dimensions would be needlessly slow). Then k-means with a capacity:
every cluster holds at most its share of the tokens (plus SLACK), requests placed in order of how much
they prefer their nearest centroid. k-means++ seeding; deterministic for a given seed.

Shape legend: R requests, F features, k clusters.
"""

from __future__ import annotations

import numpy as np

from locus.routing.plan.grouping_spec import normalise_rows

PROJECTED = 256
FEATURE_ROWS = 256  # requests read and projected at a time
ITERATIONS = 12
SLACK = 0.02


def signature_features(counts, seed: int) -> np.ndarray:
    """counts [R, L, E] -> unit-length features [R, <= PROJECTED] float32. `counts`: an array, or anything
    with `shape` and `len` that reads row slices as arrays (RequestSignatures.total_rows): read and projected
    FEATURE_ROWS rows at a time, so the float64 histograms of all requests are never held at once."""
    R = len(counts)
    F = int(np.prod(counts.shape[1:]))
    projection = None
    if F > PROJECTED:
        rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(7,)))
        projection = rng.standard_normal((F, PROJECTED)).astype(np.float32)
    flat = np.empty((R, F if projection is None else PROJECTED), dtype=np.float32)
    for lo in range(0, R, FEATURE_ROWS):
        hi = min(lo + FEATURE_ROWS, R)
        block = normalise_rows(counts[lo:hi]).reshape(hi - lo, F).astype(np.float32)
        flat[lo:hi] = block if projection is None else block @ projection
    flat -= flat.mean(0)
    return flat / np.maximum(np.linalg.norm(flat, axis=1, keepdims=True), 1e-12)


def balanced_clusters(features: np.ndarray, weights: np.ndarray, k: int, seed: int) -> np.ndarray:
    """Cluster of every request, [R] in 0..k-1, each cluster's weight at most (1 + SLACK) * total / k
    (or one request over, if a single request is that large)."""
    R = features.shape[0]
    weights = np.asarray(weights, dtype=np.float64)
    if R == 0:
        return np.zeros(0, dtype=np.int64)
    rng = np.random.default_rng(seed)
    centroids = _plus_plus(features, k, rng)
    capacity = (1 + SLACK) * weights.sum() / k
    labels = np.zeros(R, dtype=np.int64)
    for _ in range(ITERATIONS):
        dist = ((features[:, None, :] - centroids[None]) ** 2).sum(-1)  # [R, k]
        new = _assign_with_capacity(dist, weights, capacity)
        if np.array_equal(new, labels) and _ > 0:
            break
        labels = new
        for c in range(k):
            mine = labels == c
            if mine.any():
                centroids[c] = np.average(features[mine], axis=0, weights=np.maximum(weights[mine], 1e-12))
    return labels


def _plus_plus(features: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    R = features.shape[0]
    chosen = [int(rng.integers(R))]
    d2 = ((features - features[chosen[0]]) ** 2).sum(1)
    for _ in range(1, k):
        total = d2.sum()
        nxt = int(rng.choice(R, p=d2 / total)) if total > 0 else int(rng.integers(R))
        chosen.append(nxt)
        d2 = np.minimum(d2, ((features - features[nxt]) ** 2).sum(1))
    return features[chosen].astype(np.float64).copy()


def _assign_with_capacity(dist: np.ndarray, weights: np.ndarray, capacity: float) -> np.ndarray:
    """Greedy: requests that lose most by not getting their nearest cluster choose first."""
    R, k = dist.shape
    ranked = np.argsort(dist, axis=1, kind="stable")
    sorted_d = np.take_along_axis(dist, ranked, 1)
    regret = sorted_d[:, 1] - sorted_d[:, 0] if k > 1 else np.zeros(R)
    fill = np.zeros(k)
    labels = np.empty(R, dtype=np.int64)
    for i in np.argsort(-regret, kind="stable"):
        for c in ranked[i]:
            if fill[c] + weights[i] <= capacity:
                break
        else:
            c = int(np.argmin(fill))
        labels[i] = c
        fill[c] += weights[i]
    return labels
