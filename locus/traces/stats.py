"""What a trace's routing looks like: load imbalance, domain specificity, prefill->decode
predictability, co-activation and inter-layer affinity. One streaming pass over the trace.

Definitions (docs/traces.md "Statistics" has the long form):
- load[l, e]: (token, slot) pairs routed to expert e at MoE layer l. Imbalance of a layer is
  max_e load / mean_e load; cv is std/mean. Reported per layer, as the mean over layers, and worst.
- Domain specificity: Jensen-Shannon divergence (base 2, in [0, 1]) between two domains' expert
  distributions load_d[l] / sum, per layer; per pair the mean over layers; then the mean and the max
  over domain pairs, and the largest single (pair, layer) value.
- Prefill->decode: for each request with both phases, per layer, the cosine similarity of its
  prefill and decode expert histograms, and the coverage: the share of its decode pairs that go to
  the top_n experts its prefill used most. Averaged over layers, then requests. The baseline pairs
  each request's decode with another request's prefill (the next eligible request in the same chunk).
- Co-activation (K >= 2): lift(i, j) = P(i and j chosen by a token) / (P(i) P(j)), the reference
  rescaled to the observed number of pairs (a token's experts are distinct); reported per layer as
  the mean lift of the E most frequent pairs (among pairs that occur), and the share of pair
  occurrences held by the top 1% of pairs (observed vs. what independent choices would give).
- Inter-layer affinity: mutual information (bits) between a token's first expert at consecutive
  MoE layers, minus the same estimate with the layer-l expert taken from another token of the same
  request (half the request away). The difference cancels the plug-in estimator's small-sample bias
  and what the request's own affinity explains, leaving the per-token hand-over between layers;
  averaged over layer pairs.

Shape legend: T tokens in a chunk, L MoE layers, K top-k, E experts, D domains, Rc requests in a chunk.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from locus.traces.counts import CountTrace
from locus.traces.metrics import (
    coactivation,
    domain_js,
    layer_handover_mi,
    layer_imbalance,
    mean_cosine,
    mean_coverage,
)

# Per-chunk scratch stays around 2^22 int64 elements (32 MB) per array.
_BUDGET = 1 << 22


@dataclass
class TraceStats:
    model: str
    num_experts: int
    top_k: int
    moe_layers: tuple[int, ...]
    num_requests: int | None
    num_tokens: int | None
    prefill_tokens: int | None
    decode_tokens: int | None
    requests_per_domain: dict[str, int]
    # Load balance.
    load: np.ndarray  # int64 [L, E]
    max_mean: np.ndarray  # [L]
    cv: np.ndarray  # [L]
    prefill_max_mean: float | None = None  # mean over layers, prefill rows only
    decode_max_mean: float | None = None
    # Domain specificity.
    domain_load: dict[str, np.ndarray] = field(default_factory=dict)  # domain -> int64 [L, E]
    domain_js: dict[str, float] = field(default_factory=dict)  # "a|b" -> mean over layers
    js_layer_max: float | None = None
    # Prefill -> decode.
    pd_requests: int = 0
    top_n: int = 0
    pd_cosine: float | None = None
    pd_cosine_baseline: float | None = None
    pd_coverage: float | None = None
    pd_coverage_baseline: float | None = None
    # Co-activation within a token and across layers.
    coact_top_lift: float | None = None
    coact_top_share: float | None = None
    coact_top_share_independent: float | None = None
    inter_layer_mi: float | None = None

    # A layer with no load has nan figures; an empty trace has no figures at all (None).
    @property
    def max_mean_mean(self) -> float | None:
        return _mean_or_none(self.max_mean)

    @property
    def max_mean_worst(self) -> float | None:
        return None if np.all(np.isnan(self.max_mean)) else float(np.nanmax(self.max_mean))

    @property
    def worst_layer(self) -> int | None:
        return None if np.all(np.isnan(self.max_mean)) else self.moe_layers[int(np.nanargmax(self.max_mean))]

    @property
    def cv_mean(self) -> float | None:
        return _mean_or_none(self.cv)

    @property
    def js_mean(self) -> float | None:
        return float(np.mean(list(self.domain_js.values()))) if self.domain_js else None

    @property
    def js_max(self) -> float | None:
        return float(max(self.domain_js.values())) if self.domain_js else None

    def to_json(self) -> dict[str, Any]:
        def num(x: Any) -> Any:
            return None if x is None or (isinstance(x, float) and np.isnan(x)) else x

        return {
            "model": self.model, "num_experts": self.num_experts, "top_k": self.top_k,
            "moe_layers": list(self.moe_layers), "num_requests": self.num_requests, "num_tokens": self.num_tokens,
            "prefill_tokens": self.prefill_tokens, "decode_tokens": self.decode_tokens,
            "requests_per_domain": self.requests_per_domain,
            "load_imbalance": {
                "max_mean_mean": num(self.max_mean_mean), "max_mean_worst": num(self.max_mean_worst),
                "worst_layer": self.worst_layer, "cv_mean": num(self.cv_mean),
                "cv_worst": None if np.all(np.isnan(self.cv)) else float(np.nanmax(self.cv)),
                "prefill_max_mean_mean": num(self.prefill_max_mean), "decode_max_mean_mean": num(self.decode_max_mean),
                "per_layer_max_mean": [num(float(x)) for x in self.max_mean],
                "per_layer_cv": [num(float(x)) for x in self.cv],
            },
            "domain_specificity": {
                "js_mean": num(self.js_mean), "js_max": num(self.js_max), "js_layer_max": num(self.js_layer_max),
                "pairs": self.domain_js,
            },
            "prefill_decode": {
                "requests": self.pd_requests, "top_n": self.top_n,
                "cosine": num(self.pd_cosine), "cosine_baseline": num(self.pd_cosine_baseline),
                "coverage": num(self.pd_coverage), "coverage_baseline": num(self.pd_coverage_baseline),
            },
            "coactivation": {
                "top_pair_lift": num(self.coact_top_lift), "top1pct_pair_share": num(self.coact_top_share),
                "top1pct_pair_share_independent": num(self.coact_top_share_independent),
            },
            "inter_layer_mi_bits": num(self.inter_layer_mi),
        }


def count_stats(trace: CountTrace) -> TraceStats:
    """Stats a count trace supports: load imbalance only."""
    max_mean, cv = layer_imbalance(trace.counts)
    m = trace.meta
    return TraceStats(
        model=m.model, num_experts=m.num_experts, top_k=m.top_k, moe_layers=m.moe_layers, num_requests=None,
        num_tokens=trace.num_tokens, prefill_tokens=None, decode_tokens=None, requests_per_domain={},
        load=trace.counts, max_mean=max_mean, cv=cv,
    )


def compute_stats(reader, top_n: int | None = None, progress: Callable[[int, int], None] | None = None) -> TraceStats:
    """Statistics of a TraceReader (or a CountTrace: load imbalance only), in one streaming pass."""
    if isinstance(reader, CountTrace):
        return count_stats(reader)
    acc = _Accumulator(reader, top_n)
    L, E, K = reader.meta.num_layers, reader.meta.num_experts, reader.meta.top_k
    max_tokens = max(1, _BUDGET // (L * K))
    max_requests = max(1, _BUDGET // (2 * L * E))
    for chunk in reader.iter_chunks(max_tokens, max_requests=max_requests, copy=True):
        acc.add(chunk.request_start, chunk.request_stop, chunk.expert_ids)
        if progress is not None:
            progress(chunk.request_stop, reader.num_requests)
    return acc.finish()


class _Accumulator:
    """Running sums over chunks; finish() turns them into TraceStats."""

    def __init__(self, reader, top_n: int | None):
        m = reader.meta
        self.meta = m
        self.L, self.E, self.K = m.num_layers, m.num_experts, m.top_k
        self.top_n = min(self.E, top_n if top_n is not None else max(self.K, self.E // 8))
        self.domains = sorted({r.domain for r in reader.requests})
        code = {d: i for i, d in enumerate(self.domains)}
        self.req_domain = np.array([code[r.domain] for r in reader.requests], dtype=np.int64)  # [R]
        self.req_tokens = np.array([r.tokens for r in reader.requests], dtype=np.int64)  # [R]
        self.req_prompt = np.array([r.prompt_tokens for r in reader.requests], dtype=np.int64)  # [R]
        D = len(self.domains)
        self.phase_domain_load = np.zeros(D * 2 * self.L * self.E, dtype=np.int64)  # [D, 2, L, E]
        self.pd = {key: [0.0, 0] for key in ("cos", "cos_base", "cov", "cov_base")}  # [sum, requests]
        self.pairs = np.zeros((self.L, self.E * self.E), dtype=np.int64) if self.K >= 2 else None
        self.active = np.zeros(self.L, dtype=np.int64)  # tokens with at least one expert, per layer
        self.transitions = np.zeros((2, max(self.L - 1, 0), self.E * self.E), dtype=np.int64)  # [real|shuffled]

    def add(self, r0: int, r1: int, ids16: np.ndarray) -> None:
        L, E = self.L, self.E
        tokens = self.req_tokens[r0:r1]
        T = ids16.shape[0]
        if T == 0:
            return
        ids = ids16.astype(np.int64)  # [T, L, K]
        local_req = np.repeat(np.arange(r1 - r0), tokens)  # [T]
        position = np.arange(T) - np.repeat(np.cumsum(tokens) - tokens, tokens)
        phase = (position >= np.repeat(self.req_prompt[r0:r1], tokens)).astype(np.int64)  # [T] 1 = decode
        valid = ids >= 0
        layer_e = (np.arange(L, dtype=np.int64) * E)[None, :, None]  # [1, L, 1]
        group = (np.repeat(self.req_domain[r0:r1], tokens) * 2 + phase)[:, None, None]  # [T, 1, 1]
        key = (group * (L * E) + layer_e + ids)[valid]
        self.phase_domain_load += np.bincount(key, minlength=self.phase_domain_load.size)
        self.active += valid.any(axis=2).sum(axis=0)
        self._add_prefill_decode(r1 - r0, local_req, phase, ids, valid, layer_e)
        self._add_pairs(ids)
        tokens_of = np.repeat(tokens, tokens)  # [T] length of the token's request
        partner = (position + tokens_of // 2) % tokens_of + (np.arange(T) - position)  # same request, other token
        self._add_transitions(ids[:, :, 0], partner, tokens_of > 1)

    def _add_prefill_decode(self, n_req, local_req, phase, ids, valid, layer_e) -> None:
        L, E = self.L, self.E
        key = (((local_req * 2 + phase) * (L * E))[:, None, None] + layer_e + ids)[valid]
        hist = np.bincount(key, minlength=n_req * 2 * L * E).reshape(n_req, 2, L, E).astype(np.float64)
        pre, dec = hist[:, 0], hist[:, 1]  # [Rc, L, E]
        both = (pre.sum(axis=(1, 2)) > 0) & (dec.sum(axis=(1, 2)) > 0)
        if not both.any():
            return
        pre, dec = pre[both], dec[both]
        self._add_pd("cos", mean_cosine(pre, dec))
        self._add_pd("cov", mean_coverage(pre, dec, self.top_n))
        if pre.shape[0] > 1:  # another request's prefill as the "no affinity" reference
            other = np.roll(pre, 1, axis=0)
            self._add_pd("cos_base", mean_cosine(other, dec))
            self._add_pd("cov_base", mean_coverage(other, dec, self.top_n))

    def _add_pd(self, key: str, per_request: np.ndarray) -> None:
        ok = ~np.isnan(per_request)  # nan: no layer where both histograms are non-empty
        self.pd[key][0] += float(per_request[ok].sum())
        self.pd[key][1] += int(ok.sum())

    def _pd_mean(self, key: str) -> float | None:
        total, n = self.pd[key]
        return total / n if n else None

    def _add_pairs(self, ids: np.ndarray) -> None:
        if self.pairs is None:
            return
        E, K = self.E, self.K
        srt = np.sort(ids, axis=2)  # [T, L, K]; -1 sorts first
        a_idx, b_idx = np.triu_indices(K, k=1)
        for layer in range(self.L):
            a, b = srt[:, layer, a_idx], srt[:, layer, b_idx]  # [T, K(K-1)/2], a <= b
            ok = (a >= 0) & (a != b)
            self.pairs[layer] += np.bincount((a * E + b)[ok], minlength=E * E)

    def _add_transitions(self, first: np.ndarray, partner: np.ndarray, usable: np.ndarray) -> None:
        """first [T, L]: each token's slot-0 expert; partner [T]: a same-request token to pair with."""
        E = self.E
        first, partner = first[usable], partner[usable]
        if first.shape[0] == 0:
            return
        index = np.cumsum(usable) - 1  # partner rows in the filtered array (partners are usable too)
        partner = index[partner] if partner.size else partner
        for layer in range(1, self.L):
            a = first[:, layer - 1]
            for which, b in enumerate((first[:, layer], first[partner, layer])):
                ok = (a >= 0) & (b >= 0)
                self.transitions[which, layer - 1] += np.bincount((a * E + b)[ok], minlength=E * E)

    def finish(self) -> TraceStats:
        L, E = self.L, self.E
        D = len(self.domains)
        pdl = self.phase_domain_load.reshape(D, 2, L, E)
        load = pdl.sum(axis=(0, 1))
        max_mean, cv = layer_imbalance(load)
        domain_load = {d: pdl[i].sum(axis=0) for i, d in enumerate(self.domains)}
        pair_js, js_layer_max = domain_js(domain_load)
        phase_load = pdl.sum(axis=0)  # [2, L, E]
        prefill_mm = _mean_or_none(layer_imbalance(phase_load[0])[0])
        decode_mm = _mean_or_none(layer_imbalance(phase_load[1])[0])
        lift, share, share_ind = coactivation(self.pairs, load, self.active) if self.pairs is not None else (None,) * 3
        m = self.meta
        return TraceStats(
            model=m.model, num_experts=m.num_experts, top_k=m.top_k, moe_layers=m.moe_layers,
            num_requests=len(self.req_tokens), num_tokens=int(self.req_tokens.sum()),
            prefill_tokens=int(self.req_prompt.sum()), decode_tokens=int((self.req_tokens - self.req_prompt).sum()),
            requests_per_domain={d: int((self.req_domain == i).sum()) for i, d in enumerate(self.domains)},
            load=load, max_mean=max_mean, cv=cv, prefill_max_mean=prefill_mm, decode_max_mean=decode_mm,
            domain_load=domain_load, domain_js=pair_js, js_layer_max=js_layer_max,
            pd_requests=self.pd["cos"][1], top_n=self.top_n,
            pd_cosine=self._pd_mean("cos"), pd_cosine_baseline=self._pd_mean("cos_base"),
            pd_coverage=self._pd_mean("cov"), pd_coverage_baseline=self._pd_mean("cov_base"),
            coact_top_lift=lift, coact_top_share=share, coact_top_share_independent=share_ind,
            inter_layer_mi=layer_handover_mi(self.transitions),
        )


def _mean_or_none(x: np.ndarray) -> float | None:
    return None if np.all(np.isnan(x)) else float(np.nanmean(x))
