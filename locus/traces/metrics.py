"""The metric functions behind TraceStats, on plain count arrays (no trace I/O here).

Shape legend: L MoE layers, E experts, Rc requests.
"""

from __future__ import annotations

import numpy as np


def js_divergence(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Jensen-Shannon divergence, base 2, between distributions along the last axis (normalised here)."""
    p = p / p.sum(axis=-1, keepdims=True)
    q = q / q.sum(axis=-1, keepdims=True)
    m = 0.5 * (p + q)
    return 0.5 * _kl(p, m) + 0.5 * _kl(q, m)


def _kl(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        terms = np.where(p > 0, p * np.log2(p / q), 0.0)
    return terms.sum(axis=-1)


def max_over_mean(load: np.ndarray, empty: float = 1.0) -> np.ndarray:
    """The one imbalance measure (docs/design.md, "Metrics"): max / mean over the last axis (expert load of a layer
    over its experts or ranks, tokens over ranks); `empty` where nothing is loaded (mean 0)."""
    load = np.asarray(load)
    mean = load.mean(axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(mean > 0, load.max(axis=-1) / np.where(mean > 0, mean, 1.0), empty)


def layer_imbalance(load: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(max/mean, std/mean) per layer of load [L, E]; nan for a layer with no load."""
    load = np.asarray(load, dtype=np.float64)
    mean = load.mean(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        return max_over_mean(load, np.nan), np.where(mean > 0, load.std(axis=1) / mean, np.nan)


def mean_cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per request [Rc]: cosine of a and b [Rc, L, E] per layer, averaged over layers where both are non-empty."""
    na, nb = np.linalg.norm(a, axis=2), np.linalg.norm(b, axis=2)
    ok = (na > 0) & (nb > 0)
    with np.errstate(divide="ignore", invalid="ignore"):
        cos = np.where(ok, (a * b).sum(axis=2) / (na * nb), 0.0)
        return cos.sum(axis=1) / ok.sum(axis=1)


def mean_coverage(pre: np.ndarray, dec: np.ndarray, n: int) -> np.ndarray:
    """Per request [Rc]: share of decode pairs on the n experts prefill used most (used ones only)."""
    top = np.argsort(-pre, axis=2, kind="stable")[:, :, :n]  # ties: lower expert id first
    mask = np.zeros(pre.shape, dtype=bool)
    np.put_along_axis(mask, top, True, axis=2)
    mask &= pre > 0
    total = dec.sum(axis=2)
    ok = total > 0
    with np.errstate(divide="ignore", invalid="ignore"):
        cov = np.where(ok, (dec * mask).sum(axis=2) / total, 0.0)
        return cov.sum(axis=1) / ok.sum(axis=1)


def domain_js(domain_load: dict[str, np.ndarray]) -> tuple[dict[str, float], float | None]:
    """Per domain pair "a|b" (domain_load: name -> [L, E]): JS divergence averaged over the layers both
    domains reach; and the largest single-layer value over all pairs."""
    names = sorted(domain_load)
    out: dict[str, float] = {}
    layer_max = None
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            pa, pb = domain_load[a].astype(np.float64), domain_load[b].astype(np.float64)
            ok = (pa.sum(axis=1) > 0) & (pb.sum(axis=1) > 0)
            if not ok.any():
                continue
            js = js_divergence(pa[ok], pb[ok])  # [L']
            out[f"{a}|{b}"] = float(js.mean())
            layer_max = max(layer_max or 0.0, float(js.max()))
    return out, layer_max


def coactivation(
    pairs: np.ndarray, load: np.ndarray, active: np.ndarray
) -> tuple[float | None, float | None, float | None]:
    """(mean lift of the top pairs, top-1% pair share, the same share for independent choices).

    pairs [L, E*E]: tokens choosing both i < j (upper triangle used); load [L, E]; active [L]: tokens
    with a choice. The independent reference is P(i) P(j) per token, rescaled so that it holds as
    many pairs as were observed: a token's K choices are distinct, so raw P(i) P(j) would
    over-count pairs (with 8 near-uniform experts and top-2, by 75%) and every lift would read < 1.
    """
    L, E = load.shape
    iu = np.triu_indices(E, k=1)
    n_top_share = max(1, len(iu[0]) // 100)
    lifts, shares, shares_ind = [], [], []
    for layer in range(L):
        n = active[layer]
        observed = pairs[layer].reshape(E, E)[iu].astype(np.float64)  # [E(E-1)/2]
        if n == 0 or observed.sum() == 0:
            continue
        p = load[layer] / n  # P(expert chosen by a token)
        expected = (p[:, None] * p[None, :])[iu]
        expected *= observed.sum() / expected.sum()
        top = np.argsort(-observed, kind="stable")[: min(E, int((observed > 0).sum()))]
        lifts.append(float(np.mean(observed[top] / expected[top])))
        shares.append(float(np.sort(observed)[-n_top_share:].sum() / observed.sum()))
        shares_ind.append(float(np.sort(expected)[-n_top_share:].sum() / expected.sum()))
    if not lifts:
        return None, None, None
    return float(np.mean(lifts)), float(np.mean(shares)), float(np.mean(shares_ind))


def plugin_mi(counts: np.ndarray) -> float:
    """Mutual information (bits) of a joint count table [X, Y], plug-in estimate."""
    joint = counts / counts.sum()
    px, py = joint.sum(axis=1), joint.sum(axis=0)
    with np.errstate(divide="ignore", invalid="ignore"):
        return float(np.where(joint > 0, joint * np.log2(joint / (px[:, None] * py[None, :])), 0.0).sum())


def layer_handover_mi(transitions: np.ndarray) -> float | None:
    """Mean over layer pairs of MI(real pairing) - MI(shuffled pairing); transitions [2, L-1, E*E]."""
    values = []
    E = int(round(np.sqrt(transitions.shape[2]))) if transitions.size else 0
    for real, shuffled in zip(transitions[0], transitions[1]):
        if real.sum() == 0 or shuffled.sum() == 0:
            continue
        # Both estimates carry the same small-sample bias; the difference keeps the real association.
        values.append(plugin_mi(real.reshape(E, E)) - plugin_mi(shuffled.reshape(E, E)))
    return float(np.mean(values)) if values else None
