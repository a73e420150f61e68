"""Helpers shared by the trace tests: tiny traces written to tmp_path, tiny synth configs."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from locus.traces.format import TraceMeta
from locus.traces.synth import LengthDist, SynthConfig
from locus.traces.writer import TraceWriter


def tiny_meta(num_experts: int = 8, top_k: int = 2, layers: tuple[int, ...] = (1, 3, 5)) -> TraceMeta:
    return TraceMeta(model="tiny", num_experts=num_experts, top_k=top_k, moe_layers=layers, hidden_size=64)


def random_rows(rng: np.random.Generator, n: int, meta: TraceMeta) -> np.ndarray:
    """[n, L, K] distinct experts per (token, layer)."""
    keys = rng.random((n, meta.num_layers, meta.num_experts))
    return np.argsort(keys, axis=2)[:, :, : meta.top_k].astype(np.int16)


def write_tiny_trace(path: Path, lengths=((3, 5), (0, 2), (4, 4), (2, 7)), with_weights: bool = False,
                     seed: int = 0, meta: TraceMeta | None = None) -> tuple[TraceMeta, list[np.ndarray]]:
    """A trace of len(lengths) requests, (prompt_tokens, tokens) each; returns the rows written."""
    meta = meta or tiny_meta()
    rng = np.random.default_rng(seed)
    rows = []
    with TraceWriter(path, meta, with_weights=with_weights) as w:
        for i, (prompt, total) in enumerate(lengths):
            ids = random_rows(rng, total, meta)
            weights = rng.random(ids.shape).astype(np.float16) if with_weights else None
            w.add_request(f"req-{i}", ("code", "math")[i % 2], prompt, ids, weights)
            rows.append((ids, weights))
    return meta, rows


def small_config(**overrides) -> SynthConfig:
    """A fast config: 16 experts, top-2, 4 MoE layers, short requests."""
    base = dict(
        model="small", num_experts=16, top_k=2, moe_layers=(0, 1, 2, 3), hidden_size=128, requests=200, seed=1,
        prompt_len=LengthDist(24, 0.3, 4, 64), decode_len=LengthDist(24, 0.3, 4, 64),
        zipf_exponent=0.5, domain_skew=0.5, request_spread=0.8, prefill_decode_corr=0.8, layer_affinity=0.2,
    )
    base.update(overrides)
    return SynthConfig(**base)
