"""Synthetic expert-activation traces with the structure real MoE routing shows.

Generative model, per MoE layer l (all "popularities" are log-weights over the E experts):
    base[l]        = -a_l * log(1 + rank_l)              Zipf-like skew; rank_l a random permutation,
                                                          a_l = zipf_exponent * lognormal(layer_skew_spread)
    domain[d, l]   = base[l] + domain_skew * g[d, l]      task-family preferences, g ~ N(0, 1)
    prefill[r, l]  = domain[d_r, l] + request_spread * h1            request affinity, h ~ N(0, 1)
    decode[r, l]   = domain'[d_r, l] + request_spread * (c h1 + sqrt(1 - c^2) h2),  c = prefill_decode_corr
where domain' uses base * decode_zipf_scale (decode batches are measured flatter than prefill).
A token draws its K experts without replacement (successive sampling, i.e. the Plackett-Luce /
Gumbel-top-k law) from the mixture
    q = (1 - layer_affinity) * softmax(prefill or decode [r, l])
        + layer_affinity * uniform over succ_l(experts the token chose at the previous MoE layer)
where succ_l is a fixed random permutation: expert i at layer l-1 "hands over" to succ_l(i).

The sampling itself (vectorised, exact) lives in sampler.py.

Requests stream to disk in chunks of at most `chunk_tokens` tokens, so memory stays flat whatever
the request count. Output is deterministic for a given config (seed included).

Shape legend: R requests in a chunk, T tokens in a chunk, L MoE layers, K top-k, E experts,
D domains.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from locus.traces.format import RequestRecord, TraceMeta
from locus.traces.sampler import routing_weights, sample_topk, softmax
from locus.traces.writer import TraceWriter

DEFAULT_DOMAINS = (("code", 0.25), ("math", 0.15), ("chat", 0.40), ("general", 0.20))


@dataclass(frozen=True)
class LengthDist:
    """Log-normal token count, clipped to [min, max]."""

    median: float
    sigma: float
    min: int = 1
    max: int = 8192

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        x = np.rint(self.median * np.exp(self.sigma * rng.standard_normal(n)))
        return np.clip(x, self.min, self.max).astype(np.int64)


@dataclass(frozen=True)
class SynthConfig:
    # Model shape.
    model: str
    num_experts: int
    top_k: int
    moe_layers: tuple[int, ...]
    hidden_size: int
    dtype_bytes: int = 2
    # Workload.
    requests: int = 1000
    seed: int = 0
    domain_mix: tuple[tuple[str, float], ...] = DEFAULT_DOMAINS
    prompt_len: LengthDist = field(default_factory=lambda: LengthDist(160, 1.0, 4, 8192))
    decode_len: LengthDist = field(default_factory=lambda: LengthDist(128, 0.8, 1, 4096))
    # Routing structure (see the module docstring for the exact model).
    zipf_exponent: float = 1.0
    layer_skew_spread: float = 0.0
    decode_zipf_scale: float = 1.0
    domain_skew: float = 0.5
    request_spread: float = 0.5
    prefill_decode_corr: float = 0.8
    layer_affinity: float = 0.2
    # Output.
    with_weights: bool = False
    chunk_tokens: int = 1 << 16

    def __post_init__(self) -> None:
        object.__setattr__(self, "moe_layers", tuple(int(x) for x in self.moe_layers))
        if self.requests < 0:
            raise ValueError("requests must be >= 0")
        if not 0.0 <= self.prefill_decode_corr <= 1.0:
            raise ValueError("prefill_decode_corr must lie in [0, 1]")
        if not 0.0 <= self.layer_affinity < 1.0:
            raise ValueError("layer_affinity must lie in [0, 1)")
        for name in ("zipf_exponent", "layer_skew_spread", "decode_zipf_scale", "domain_skew", "request_spread"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if not self.domain_mix or any(w < 0 for _, w in self.domain_mix) or sum(w for _, w in self.domain_mix) <= 0:
            raise ValueError("domain_mix needs at least one domain with a positive weight")
        if self.chunk_tokens < 1:
            raise ValueError("chunk_tokens must be >= 1")

    def meta(self) -> TraceMeta:
        return TraceMeta(
            model=self.model,
            num_experts=self.num_experts,
            top_k=self.top_k,
            moe_layers=self.moe_layers,
            hidden_size=self.hidden_size,
            dtype_bytes=self.dtype_bytes,
            source=f"synth:{self.model} seed={self.seed}",
        )


@dataclass
class SynthChunk:
    records: list[RequestRecord]
    expert_ids: np.ndarray  # int16 [T, L, K]
    expert_weights: np.ndarray | None  # float16 [T, L, K]


@dataclass(frozen=True)
class SynthResult:
    path: Path
    num_requests: int
    num_tokens: int
    seconds: float


@dataclass(frozen=True)
class _Structure:
    """What is fixed for the whole trace: popularity per domain, hand-over maps."""

    domain_logits: np.ndarray  # float64 [2, D, L, E]; [0] prefill, [1] decode
    successor: np.ndarray  # int64 [L, E]; successor[l, i] = expert favoured at l after i at l-1


@dataclass(frozen=True)
class _Workload:
    domain: np.ndarray  # int64 [R_total] index into domain_mix
    prompt: np.ndarray  # int64 [R_total]
    decode: np.ndarray  # int64 [R_total]


def synthesize(
    config: SynthConfig,
    path: str | Path,
    overwrite: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> SynthResult:
    """Generate config.requests requests into a trace directory at `path`; progress(done, total)."""
    t0 = time.perf_counter()
    with TraceWriter(path, config.meta(), with_weights=config.with_weights, overwrite=overwrite) as writer:
        for chunk in generate(config):
            writer.add_requests(chunk.records, chunk.expert_ids, chunk.expert_weights)
            if progress is not None:
                progress(writer.num_requests, config.requests)
        n_req, n_tok = writer.num_requests, writer.num_tokens
    return SynthResult(Path(path), n_req, n_tok, time.perf_counter() - t0)


def generate(config: SynthConfig) -> Iterator[SynthChunk]:
    """The trace as a stream of chunks of whole requests (what synthesize writes)."""
    # Independent streams for the fixed structure, the request mix, and each chunk's routing.
    structure_seq, workload_seq = np.random.SeedSequence(config.seed).spawn(2)
    structure = _build_structure(config, np.random.default_rng(structure_seq))
    work = _draw_workload(config, np.random.default_rng(workload_seq))
    names = [name for name, _ in config.domain_mix]
    width = len(str(max(config.requests - 1, 0)))
    for index, (lo, hi) in enumerate(_chunk_bounds(config, work)):
        rng = np.random.default_rng(np.random.SeedSequence(config.seed, spawn_key=(2, index)))
        ids, weights = _route_chunk(config, structure, work, lo, hi, rng)
        records = [
            RequestRecord(f"r{r:0{width}d}", names[work.domain[r]], int(p), int(p + d))
            for r, p, d in zip(range(lo, hi), work.prompt[lo:hi], work.decode[lo:hi])
        ]
        yield SynthChunk(records, ids, weights)


def _build_structure(config: SynthConfig, rng: np.random.Generator) -> _Structure:
    L, E, D = len(config.moe_layers), config.num_experts, len(config.domain_mix)
    rank = np.argsort(rng.random((L, E)), axis=1)  # [L, E] a random popularity order per layer
    exponent = config.zipf_exponent * np.exp(config.layer_skew_spread * rng.standard_normal(L))  # [L]
    base = -exponent[:, None] * np.log1p(rank)  # [L, E]
    offsets = config.domain_skew * rng.standard_normal((D, L, E))
    scale = np.array([1.0, config.decode_zipf_scale])[:, None, None, None]
    domain_logits = scale * base[None, None] + offsets[None]  # [2, D, L, E]
    successor = np.argsort(rng.random((L, E)), axis=1)  # [L, E] random permutations
    return _Structure(domain_logits, successor)


def _draw_workload(config: SynthConfig, rng: np.random.Generator) -> _Workload:
    weights = np.array([w for _, w in config.domain_mix], dtype=np.float64)
    domain = rng.choice(len(weights), size=config.requests, p=weights / weights.sum())
    prompt = config.prompt_len.sample(rng, config.requests)
    decode = config.decode_len.sample(rng, config.requests)
    return _Workload(domain.astype(np.int64), prompt, decode)


def _chunk_bounds(config: SynthConfig, work: _Workload) -> list[tuple[int, int]]:
    """[lo, hi) request ranges of at most chunk_tokens tokens (and a bounded request count)."""
    # The per-request CDFs of a chunk are [2R, E] float64: cap R so they stay small too.
    max_requests = max(1, (1 << 21) // config.num_experts)
    ends = np.cumsum(work.prompt + work.decode)
    bounds, lo, done = [], 0, 0
    while lo < config.requests:
        hi = int(np.searchsorted(ends, done + config.chunk_tokens, side="right"))
        hi = min(max(hi, lo + 1), lo + max_requests)
        bounds.append((lo, hi))
        done = int(ends[hi - 1])
        lo = hi
    return bounds


def _route_chunk(
    config: SynthConfig, structure: _Structure, work: _Workload, lo: int, hi: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray | None]:
    """Expert ids [T, L, K] (and weights) for requests lo..hi-1."""
    L, E, K = len(config.moe_layers), config.num_experts, config.top_k
    R = hi - lo
    prompt, total = work.prompt[lo:hi], work.prompt[lo:hi] + work.decode[lo:hi]
    T = int(total.sum())
    token_req = np.repeat(np.arange(R), total)  # [T]
    position = np.arange(T) - np.repeat(np.cumsum(total) - total, total)  # [T] 0-based within request
    dist_row = 2 * token_req + (position >= np.repeat(prompt, total))  # [T] row of the [2R, E] table
    domains = work.domain[lo:hi]
    lam = config.layer_affinity
    rho = config.prefill_decode_corr
    ids = np.empty((T, L, K), dtype=np.int16)
    weights = np.empty((T, L, K), dtype=np.float16) if config.with_weights else None
    prev: np.ndarray | None = None
    for layer in range(L):
        h1 = rng.standard_normal((R, E))
        h2 = rng.standard_normal((R, E))
        pre = structure.domain_logits[0, domains, layer] + config.request_spread * h1  # [R, E]
        mixed = rho * h1 + np.sqrt(1 - rho * rho) * h2  # correlation rho with the prefill offsets
        dec = structure.domain_logits[1, domains, layer] + config.request_spread * mixed
        logits = np.stack([pre, dec], axis=1)  # [R, 2, E]
        probs = softmax(logits.reshape(2 * R, E))  # [2R, E]
        succ = None if prev is None or lam == 0 else structure.successor[layer][prev]  # [T, K]
        chosen = sample_topk(probs, dist_row, succ, lam, K, rng)  # [T, K]
        ids[:, layer, :] = chosen
        if weights is not None:
            weights[:, layer, :] = routing_weights(probs, dist_row, succ, lam, chosen)
        prev = chosen
    return ids, weights
