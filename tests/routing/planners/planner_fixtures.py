"""Small traces for the planner, grouper and evaluation tests (written to tmp paths, seconds to make)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from locus.traces.format import TraceMeta
from locus.traces.synth import LengthDist, SynthConfig, synthesize
from locus.traces.writer import TraceWriter


def synth_trace(path: Path, requests: int = 160, seed: int = 0, experts: int = 32, top_k: int = 2,
                layers=(1, 3, 5), **knobs) -> Path:
    """A skewed synthetic trace with the four conventional domains and short requests."""
    config = SynthConfig(
        model="toy", num_experts=experts, top_k=top_k, moe_layers=tuple(layers), hidden_size=64,
        requests=requests, seed=seed, prompt_len=LengthDist(24, 0.6, 2, 120), decode_len=LengthDist(20, 0.6, 1, 80),
        zipf_exponent=knobs.pop("zipf_exponent", 0.8), domain_skew=knobs.pop("domain_skew", 1.0),
        request_spread=knobs.pop("request_spread", 0.5), **knobs,
    )
    synthesize(config, path)
    return path


def separable_trace(path: Path, requests: int = 240, seed: int = 0, tagged: bool = True,
                    kv_bytes_per_token: int | None = None) -> Path:
    """4 domains, each routing only to its own 4 of 16 experts (uniformly, top-2), equal token shares:
    a 4-node topology with 4 slots per node can keep every pair on its node. Untagged: domain "".
    `kv_bytes_per_token`: what meta.json says the recording engine's cache held per token (or nothing)."""
    rng = np.random.default_rng(seed)
    domains = ("code", "math", "chat", "general")
    meta = TraceMeta("separable", 16, 2, (0, 2), hidden_size=32, dtype_bytes=2, kv_bytes_per_token=kv_bytes_per_token)
    with TraceWriter(path, meta) as writer:
        for i in range(requests):
            d = i % 4
            n = 16  # equal lengths: equal domain shares, so the expert cap can hold without replicas
            keys = rng.random((n, 2, 4))
            ids = 4 * d + np.argsort(keys, axis=2)[:, :, :2]
            writer.add_request(f"q{i:04d}", domains[d] if tagged else "", n // 2, ids.astype(np.int16))
    return path


def worded_trace(path: Path, requests: int = 240, seed: int = 0, tagged: bool = True, vocab: int = 64) -> Path:
    """Like separable_trace, and every row carries a token id: domain d's prompts use tokens
    16 d .. 16 d + 15 and a token's routing follows its id (expert 4 d + id % 4 first, top-2), so what a
    prompt's tokens route to is learnable from a planning half. Tagged or not (domain "")."""
    rng = np.random.default_rng(seed)
    domains = ("code", "math", "chat", "general")
    meta = TraceMeta("worded", 16, 2, (0, 2), hidden_size=32, dtype_bytes=2, vocab_size=vocab)
    with TraceWriter(path, meta, with_tokens=True) as writer:
        for i in range(requests):
            d = i % 4
            n = 16
            tokens = 16 * d + rng.integers(0, 16, n)
            first = 4 * d + tokens % 4
            second = 4 * d + (tokens % 4 + 1 + rng.integers(0, 3, n)) % 4
            ids = np.stack([first, second], -1)[:, None, :].repeat(2, axis=1)  # [n, 2 layers, 2]
            writer.add_request(f"w{i:04d}", domains[d] if tagged else "", n // 2, ids.astype(np.int16),
                               token_ids=tokens)
    return path


def paired_trace(path: Path, requests: int = 160, seed: int = 0) -> Path:
    """4 equal domains a, b, c, d over 8 experts, top-1: a and c route only to experts 0-3, b and d only
    to 4-7 (uniformly, both layers). Laid out by size (a tie, so by name), a and b would share a node."""
    rng = np.random.default_rng(seed)
    domains = ("a", "b", "c", "d")
    meta = TraceMeta("paired", 8, 1, (0, 2), hidden_size=32, dtype_bytes=2)
    with TraceWriter(path, meta) as writer:
        for i in range(requests):
            d = i % 4
            n = 16
            ids = 4 * (d % 2) + rng.integers(0, 4, (n, 2, 1))
            writer.add_request(f"p{i:04d}", domains[d], n // 2, ids.astype(np.int16))
    return path
