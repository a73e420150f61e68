"""The generator: exact sampling law, determinism, preset shapes, streaming memory, and knobs that
move the statistics the right way."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from trace_fixtures import small_config

from locus.traces import sampler
from locus.traces.presets import PRESETS, preset_config
from locus.traces.reader import TraceReader
from locus.traces.stats import compute_stats
from locus.traces.synth import generate, synthesize


def ordered_pair_law(q: np.ndarray) -> np.ndarray:
    """P(first = a, second = b) under successive sampling without replacement, [E, E]."""
    law = q[:, None] * q[None, :] / (1 - q[:, None])
    np.fill_diagonal(law, 0)
    return law


def pair_frequencies(chosen: np.ndarray, E: int) -> np.ndarray:
    return np.bincount(chosen[:, 0] * E + chosen[:, 1], minlength=E * E).reshape(E, E) / chosen.shape[0]


def test_topk_sampling_is_successive_sampling_without_replacement():
    rng = np.random.default_rng(0)
    p = np.array([[0.5, 0.3, 0.15, 0.05]])
    rows = np.zeros(200_000, dtype=np.int64)
    chosen = sampler.sample_topk(p, rows, None, 0.0, 2, rng)
    assert np.abs(pair_frequencies(chosen, 4) - ordered_pair_law(p[0])).max() < 0.005


def test_topk_sampling_with_layer_affinity_mixture():
    rng = np.random.default_rng(1)
    p = np.array([[0.4, 0.3, 0.2, 0.1]])
    rows = np.zeros(200_000, dtype=np.int64)
    succ = np.tile(np.array([3, 2]), (rows.size, 1))  # hand-over favours experts 3 and 2
    lam = 0.5
    chosen = sampler.sample_topk(p, rows, succ, lam, 2, rng)
    q = (1 - lam) * p[0] + lam * np.array([0, 0, 0.5, 0.5])
    assert np.abs(pair_frequencies(chosen, 4) - ordered_pair_law(q)).max() < 0.005


def test_gumbel_continuation_matches_the_same_law():
    rng = np.random.default_rng(2)
    p = np.array([[0.6, 0.25, 0.1, 0.05]])
    rows = np.zeros(100_000, dtype=np.int64)
    fresh = sampler.finish_gumbel(p, rows, None, 0.0, np.empty((rows.size, 0), dtype=np.int64), 2, rng)
    assert np.abs(pair_frequencies(fresh, 4) - ordered_pair_law(p[0])).max() < 0.006
    # Continuing after a draw of expert 2 keeps it first; the second follows p without expert 2.
    cont = sampler.finish_gumbel(p, rows, None, 0.0, np.full((rows.size, 3), 2), 2, rng)
    assert (cont[:, 0] == 2).all()
    want = np.array([0.6, 0.25, 0, 0.05]) / 0.9
    np.testing.assert_allclose(np.bincount(cont[:, 1], minlength=4) / rows.size, want, atol=0.006)


def test_concentrated_rows_still_get_k_distinct_experts():
    # One expert holds almost all the mass: successive draws repeat it and the fallback finishes.
    p = np.full((1, 64), 1e-9)
    p[0, 5] = 1.0
    p /= p.sum()
    chosen = sampler.sample_topk(p, np.zeros(50, dtype=np.int64), None, 0.0, 4, np.random.default_rng(0))
    assert (chosen[:, 0] == 5).all()
    assert (np.diff(np.sort(chosen, axis=1), axis=1) > 0).all()


def test_deterministic_per_seed(tmp_path):
    config = small_config(requests=40, with_weights=True)
    synthesize(config, tmp_path / "a")
    synthesize(config, tmp_path / "b")
    synthesize(small_config(requests=40, with_weights=True, seed=2), tmp_path / "c")
    for name in ("expert_ids.npy", "expert_weights.npy", "requests.jsonl", "meta.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    assert (tmp_path / "a" / "expert_ids.npy").read_bytes() != (tmp_path / "c" / "expert_ids.npy").read_bytes()


def test_output_is_a_valid_trace_with_distinct_experts(tmp_path):
    config = small_config(requests=60, with_weights=True, chunk_tokens=300)
    result = synthesize(config, tmp_path / "t")
    r = TraceReader(tmp_path / "t")
    assert r.num_requests == 60 and r.num_tokens == result.num_tokens
    ids = np.asarray(r.expert_ids)
    assert ids.min() >= 0 and ids.max() < 16
    assert (np.diff(np.sort(ids, axis=2), axis=2) > 0).all()  # top-k without repeats
    np.testing.assert_allclose(np.asarray(r.expert_weights, dtype=np.float64).sum(axis=2), 1.0, atol=3e-3)
    assert {q.domain for q in r.requests} <= {"code", "math", "chat", "general"}
    assert all(1 <= q.prompt_tokens < q.tokens for q in r.requests)


def test_chunks_respect_the_token_budget():
    chunks = list(generate(small_config(requests=100, chunk_tokens=500)))
    assert len(chunks) > 5
    assert all(c.expert_ids.shape[0] <= 500 or len(c.records) == 1 for c in chunks)
    assert sum(len(c.records) for c in chunks) == 100


@pytest.mark.parametrize("name, shape", [
    ("llama4-scout", (16, 1, 48, 5120)), ("llama4-maverick", (128, 1, 24, 5120)),
    ("deepseek-v3", (256, 8, 58, 7168)), ("qwen3-235b", (128, 8, 94, 4096)), ("mixtral-8x7b", (8, 2, 32, 4096)),
])
def test_preset_shapes(name, shape):
    c = PRESETS[name]
    assert (c.num_experts, c.top_k, len(c.moe_layers), c.hidden_size) == shape
    chunk = next(generate(preset_config(name, requests=2)))
    assert chunk.expert_ids.shape[1:] == (shape[2], shape[1])


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown preset"):
        preset_config("gpt-5")


def stats_of(tmp_path, name, **overrides):
    synthesize(small_config(**overrides), tmp_path / name)
    return compute_stats(TraceReader(tmp_path / name))


def test_more_domain_skew_more_js(tmp_path):
    low = stats_of(tmp_path, "low", domain_skew=0.1)
    high = stats_of(tmp_path, "high", domain_skew=1.0)
    assert high.js_mean > 2 * low.js_mean
    assert high.js_mean > 0.1


def test_more_prefill_decode_correlation_more_similarity(tmp_path):
    low = stats_of(tmp_path, "low", prefill_decode_corr=0.0)
    high = stats_of(tmp_path, "high", prefill_decode_corr=1.0)
    assert high.pd_cosine > low.pd_cosine + 0.05
    assert high.pd_coverage > low.pd_coverage
    # With full correlation a request's own prefill predicts its decode better than another's.
    assert high.pd_cosine > high.pd_cosine_baseline + 0.05


def test_more_request_spread_widens_the_gap_to_other_requests(tmp_path):
    low = stats_of(tmp_path, "low", request_spread=0.0)
    high = stats_of(tmp_path, "high", request_spread=1.5)
    # Without request affinity only the domain separates a request from others.
    assert high.pd_cosine - high.pd_cosine_baseline > low.pd_cosine - low.pd_cosine_baseline + 0.1


def test_more_layer_affinity_more_inter_layer_information(tmp_path):
    low = stats_of(tmp_path, "low", layer_affinity=0.0)
    high = stats_of(tmp_path, "high", layer_affinity=0.6)
    assert high.inter_layer_mi > low.inter_layer_mi + 0.1


def test_more_zipf_more_imbalance_and_flatter_decode(tmp_path):
    low = stats_of(tmp_path, "low", zipf_exponent=0.0, domain_skew=0.0)
    high = stats_of(tmp_path, "high", zipf_exponent=1.5, domain_skew=0.0)
    assert high.max_mean_mean > low.max_mean_mean + 0.5
    flat = stats_of(tmp_path, "flat", zipf_exponent=1.5, domain_skew=0.0, decode_zipf_scale=0.3)
    assert flat.decode_max_mean < flat.prefill_max_mean - 0.3


@pytest.mark.slow  # two subprocesses synthesising traces
def test_memory_stays_flat_as_the_trace_grows(tmp_path):
    """Peak RSS of a child process barely moves when the trace gets 4x larger (rows stream to disk)."""
    script = textwrap.dedent("""
        import json, re, sys
        from locus.traces.presets import preset_config
        from locus.traces.synth import synthesize
        res = synthesize(preset_config("llama4-maverick", requests=int(sys.argv[1]), chunk_tokens=1 << 14), sys.argv[2])
        # VmHWM is this process's own peak; getrusage's ru_maxrss would include the parent's peak at fork
        # (Linux keeps it across exec), i.e. pytest's, not ours.
        hwm = int(re.search(r"VmHWM:\\s+(\\d+) kB", open("/proc/self/status").read()).group(1))
        print(json.dumps({"rss_kib": hwm, "tokens": res.num_tokens}))
    """)
    runs = {}
    for n in (500, 3000):
        out = subprocess.run([sys.executable, "-c", script, str(n), str(tmp_path / f"t{n}")],
                             capture_output=True, text=True, check=True).stdout
        runs[n] = json.loads(out)
    grew_bytes = (runs[3000]["tokens"] - runs[500]["tokens"]) * 24 * 2
    grew_rss = (runs[3000]["rss_kib"] - runs[500]["rss_kib"]) * 1024
    assert grew_bytes > 40e6
    assert grew_rss < 0.25 * grew_bytes, runs
    assert runs[3000]["rss_kib"] < 400 * 1024
