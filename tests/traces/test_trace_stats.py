"""Statistics on small traces whose figures are worked out by hand in the comments."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from locus.traces import stats as stats_module
from locus.traces.counts import CountTrace, count_tokens, read_counts, write_counts
from locus.traces.format import TraceMeta
from locus.traces.reader import TraceReader
from locus.traces.report import render_stats
from locus.traces.metrics import js_divergence, layer_imbalance, plugin_mi
from locus.traces.stats import compute_stats
from locus.traces.writer import TraceWriter


def rows(*layers):
    """rows([...layer0 ids...], [...layer1 ids...]) for top-1 -> [n, L, 1]."""
    return np.array(layers, dtype=np.int16).T[:, :, None]


@pytest.fixture
def top1_trace(tmp_path):
    # E=4, K=1, two MoE layers.
    # r0 (domain a, 2 prefill + 2 decode): layer0 [0, 0 | 0, 1], layer1 [2, 2 | 2, 3]
    # r1 (domain b, 1 prefill + 1 decode): layer0 [2 | 3],       layer1 [0 | 1]
    meta = TraceMeta("hand", num_experts=4, top_k=1, moe_layers=(0, 1), hidden_size=8)
    with TraceWriter(tmp_path / "t", meta) as w:
        w.add_request("r0", "a", 2, rows([0, 0, 0, 1], [2, 2, 2, 3]))
        w.add_request("r1", "b", 1, rows([2, 3], [0, 1]))
    return TraceReader(tmp_path / "t")


def test_js_divergence_by_hand():
    # m = [.75, .25]; KL(p||m) = log2(4/3); KL(q||m) = .5 log2(2/3) + .5 log2(2)
    want = 0.5 * math.log2(4 / 3) + 0.5 * (0.5 * math.log2(2 / 3) + 0.5)
    assert js_divergence(np.array([1.0, 0.0]), np.array([0.5, 0.5])) == pytest.approx(want)
    assert js_divergence(np.array([1.0, 0.0]), np.array([0.0, 3.0])) == pytest.approx(1.0)
    assert js_divergence(np.array([2.0, 6.0]), np.array([1.0, 3.0])) == pytest.approx(0.0)


def test_load_imbalance_by_hand(top1_trace):
    s = compute_stats(top1_trace)
    # layer0 load [3, 1, 1, 1]: mean 1.5, max/mean 2, std sqrt(0.75); layer1 [1, 1, 3, 1] the same.
    np.testing.assert_array_equal(s.load, [[3, 1, 1, 1], [1, 1, 3, 1]])
    np.testing.assert_allclose(s.max_mean, [2.0, 2.0])
    np.testing.assert_allclose(s.cv, [math.sqrt(0.75) / 1.5] * 2)
    assert s.max_mean_mean == 2.0 and s.max_mean_worst == 2.0 and s.worst_layer == 0
    # prefill rows: layer0 [2, 0, 1, 0] -> 2 / 0.75; layer1 [1, 0, 2, 0] -> same
    assert s.prefill_max_mean == pytest.approx(2 / 0.75)
    assert (s.num_requests, s.num_tokens, s.prefill_tokens, s.decode_tokens) == (2, 6, 3, 3)


def test_domain_js_by_hand(top1_trace):
    s = compute_stats(top1_trace)
    # Domains a and b use disjoint experts at both layers: JS = 1 bit.
    assert s.domain_js == {"a|b": pytest.approx(1.0)}
    assert s.js_mean == pytest.approx(1.0) and s.js_layer_max == pytest.approx(1.0)


def test_prefill_decode_by_hand(top1_trace):
    s = compute_stats(top1_trace)
    # r0: layer0 prefill [2,0,0,0] vs decode [1,1,0,0] -> cos 1/sqrt2; layer1 likewise. r1: disjoint -> 0.
    assert s.pd_requests == 2
    assert s.pd_cosine == pytest.approx((1 / math.sqrt(2) + 0) / 2)
    # top_n = max(K, E // 8) = 1: r0 puts half its decode on its prefill's top expert, r1 none.
    assert s.top_n == 1
    assert s.pd_coverage == pytest.approx(0.25)
    # Swapping prefills between r0 and r1 shares no expert at all.
    assert s.pd_cosine_baseline == pytest.approx(0.0) and s.pd_coverage_baseline == pytest.approx(0.0)


def test_inter_layer_information_by_hand(top1_trace):
    s = compute_stats(top1_trace)
    # Real pairs (layer0 -> layer1): (0,2) x3, (1,3), (2,0), (3,1): a bijection, so MI = H(layer0).
    real = 0.5 * 1 + 3 * (1 / 6) * math.log2(6)
    # Each token paired with the layer-1 expert of the token half its request away:
    # r0 -> (0,2), (0,3), (0,2), (1,2); r1 -> (2,1), (3,0)
    shuffled = np.zeros((4, 4))
    for a, b in [(0, 2), (0, 3), (0, 2), (1, 2), (2, 1), (3, 0)]:
        shuffled[a, b] += 1
    assert s.inter_layer_mi == pytest.approx(real - plugin_mi(shuffled))
    assert s.coact_top_lift is None  # top-1 has no pairs within a token


def test_coactivation_by_hand(tmp_path):
    # E=4, K=2, one layer, tokens (0,1) (0,1) (2,3) (0,2): P = load / 4 = [.75, .5, .5, .25]
    meta = TraceMeta("hand", num_experts=4, top_k=2, moe_layers=(0,), hidden_size=8)
    with TraceWriter(tmp_path / "t", meta) as w:
        w.add_request("r", "a", 4, np.array([[[0, 1]], [[1, 0]], [[3, 2]], [[0, 2]]], dtype=np.int16))
    s = compute_stats(TraceReader(tmp_path / "t"))
    # Independent reference P(i)P(j)*4 per pair: (0,1) 1.5, (0,2) 1.5, (0,3) .75, (1,2) 1, (1,3) .5,
    # (2,3) .5 = 5.75 pairs, rescaled to the 4 observed: x 4/5.75.
    # Pairs that occur: (0,1) x2 lift 2/1.5; (0,2) lift 1/1.5; (2,3) lift 1/.5, each / (4/5.75).
    assert s.coact_top_lift == pytest.approx((2 / 1.5 + 1 / 1.5 + 1 / 0.5) / 3 * 5.75 / 4)
    # Top 1% of the 6 pairs = the top pair: observed 2 of 4; independent 1.5 of 5.75.
    assert s.coact_top_share == pytest.approx(0.5)
    assert s.coact_top_share_independent == pytest.approx(1.5 / 5.75)
    assert s.pd_requests == 0 and s.pd_cosine is None


def test_chunking_does_not_change_the_sums(top1_trace, monkeypatch):
    whole = compute_stats(top1_trace)
    monkeypatch.setattr(stats_module, "_BUDGET", 1)  # one request per chunk
    chunked = compute_stats(top1_trace)
    np.testing.assert_array_equal(whole.load, chunked.load)
    assert chunked.domain_js == whole.domain_js and chunked.pd_cosine == whole.pd_cosine
    assert chunked.inter_layer_mi == pytest.approx(whole.inter_layer_mi)
    assert chunked.pd_cosine_baseline is None  # no second request in a chunk to compare with


def test_counts_of_a_token_trace_and_count_stats(top1_trace, tmp_path):
    c = count_tokens(top1_trace)
    np.testing.assert_array_equal(c.counts, [[3, 1, 1, 1], [1, 1, 3, 1]])
    assert c.num_tokens == 6
    np.testing.assert_array_equal(read_counts(top1_trace.path).counts, c.counts)
    write_counts(tmp_path / "c", c.meta, np.array([[4, 0, 0, 0], [1, 1, 1, 1]]), num_tokens=4)
    s = compute_stats(read_counts(tmp_path / "c"))
    np.testing.assert_allclose(s.max_mean, [4.0, 1.0])
    assert s.domain_js == {} and s.pd_cosine is None
    assert "count trace: 4 tokens" in render_stats(s)
    np.testing.assert_allclose(layer_imbalance(np.array([[0, 0]]))[0], [np.nan])


def test_json_and_text_report(top1_trace):
    s = compute_stats(top1_trace)
    d = json.loads(json.dumps(s.to_json()))  # plain JSON types only
    assert d["load_imbalance"]["max_mean_mean"] == 2.0
    assert d["domain_specificity"]["pairs"] == {"a|b": pytest.approx(1.0)}
    assert d["prefill_decode"]["top_n"] == 1
    text = render_stats(s)
    assert "mean over layers 2.00" in text and "a vs b: 1.000" in text


def test_count_trace_wrapper_type():
    meta = TraceMeta("m", num_experts=2, top_k=1, moe_layers=(0,), hidden_size=8)
    s = compute_stats(CountTrace(meta, np.array([[3, 1]]), None))
    assert s.max_mean_mean == pytest.approx(1.5)


def test_empty_trace(tmp_path):
    meta = TraceMeta("m", num_experts=4, top_k=2, moe_layers=(0, 1), hidden_size=8)
    with TraceWriter(tmp_path / "t", meta):
        pass
    s = compute_stats(TraceReader(tmp_path / "t"))
    assert s.max_mean_mean is None and s.worst_layer is None and s.js_mean is None and s.pd_cosine is None
    assert json.loads(json.dumps(s.to_json()))["load_imbalance"]["max_mean_mean"] is None
    assert "mean over layers n/a" in render_stats(s)
