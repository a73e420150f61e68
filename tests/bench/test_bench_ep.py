"""bench/ep.py end to end on `tiny`: three plans served by 4 ranks as 2x2, each run's measured bytes
equal to the replay of the trace it recorded (the script exits non-zero otherwise), with the recorded
assignment's attention and expert imbalance."""

from __future__ import annotations

import json

import pytest

from tests.bench.bench_scripts import run_bench

pytestmark = pytest.mark.slow  # runs bench/ep.py: a 4-rank server


def test_bench_ep_measures_what_the_replay_predicts(tmp_path):
    out = tmp_path / "ep.json"
    stdout = run_bench("ep.py", "--model", "tiny", "--slots", "3", "--requests", "6", "--planning-requests", "12",
                       "--output-len", "4", "--concurrency", "6", "--out", str(out), timeout=600)
    results = json.loads(out.read_text())["results"]
    assert [r["plan"] for r in results] == ["round_robin", "eplb", "locality"]
    assert [r["assignment"] for r in results] == ["balanced", "balanced", "grouper"]
    for r in results:
        assert r["equal"] and r["measured"] == {k: r["replayed"][k] for k in r["measured"]}
        assert r["tokens"] > 6 * 4 and r["out_tokens"] == 6 * 4 and r["step_ms"] > 0
        # the recorded assignment's balance, from the same replay: max/mean over ranks, the worst layer at least the mean
        assert r["attention_imbalance"] >= 1.0 and 1.0 <= r["expert_imbalance_mean"] <= r["expert_imbalance_worst"]
    assert "| locality" in stdout
    # the grouper row's balance reference: EPLB's plan over the same served requests, balanced assignment
    ref = results[2]["eplb_balanced"]
    assert ref["inter_per_token"] > 0 and ref["attention_imbalance"] >= 1.0
    assert 1.0 <= ref["expert_imbalance_mean"] <= ref["expert_imbalance_worst"]
    assert "served requests under EPLB, balanced" in stdout
    # the served run's expert imbalance minus the reference's, with its spread over resampled served requests
    d = ref["expert_difference"]
    assert d["point"] == pytest.approx(results[2]["expert_imbalance_mean"] - ref["expert_imbalance_mean"], abs=1e-12)
    assert d["ci95"][0] <= d["point"] <= d["ci95"][1] and d["requests"] == 6 + 1  # and the bench's warm-up request
