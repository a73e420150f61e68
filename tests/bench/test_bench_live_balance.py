"""bench/live_balance.py on a synthetic trace: every grouper row carries its expert imbalance minus EPLB's
(equal to the two rows' figures) with an interval around it, and --served-sets cuts the held-out half
into disjoint served sets."""

import json

import pytest

from tests.bench.bench_scripts import run_bench
from tests.routing.planners.planner_fixtures import synth_trace


def test_rows_carry_their_difference_and_served_sets_cut_the_held_out_half(tmp_path):
    trace = synth_trace(tmp_path / "t", requests=240, seed=4, experts=16, top_k=2, layers=(1, 3))
    out = tmp_path / "lb.json"
    text = run_bench("live_balance.py", "--trace", f"syn={trace},2x2,5", "--expert-cap", "eplb", "--draws", "100",
                     "--served-sets", "3", "--out", str(out))
    doc = json.loads(out.read_text())
    rows = doc["rows"]
    reference = rows[0]
    assert reference["assignment"] == "eplb, balanced" and reference["expert_difference"] is None
    judged = [r for r in rows if r["expert_mean_within_target"] is not None]
    assert len(judged) == 4  # the planned grouping and three client concurrencies
    for r in judged:
        d = r["expert_difference"]
        assert d["point"] == pytest.approx(r["expert_imbalance_mean"] - reference["expert_imbalance_mean"], abs=1e-12)
        assert d["ci95"][0] < d["point"] < d["ci95"][1] and d["sd"] > 0 and d["draws"] == 100
        assert (d["point"] <= 0) == r["expert_mean_within_target"]
    (sets,) = doc["served_sets"]
    assert sets["set_size"] == 40 and len(sets["differences"]) == 3 and sets["in_flight"] == 64
    assert sets["over"] == sum(x > 0 for x in sets["differences"])
    assert "| syn | eplb | 3 x 40 | 64 |" in text
