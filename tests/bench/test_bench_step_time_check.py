"""bench/step_time_check.py: the H200 profiles' kernel figures are what its fit gives on the committed
roofline results (so a profile cannot drift from its source), and the measured ratio pairs repeats."""

import json
import sys

import pytest

from locus.routing.replay.hardware import load_hardware
from tests.bench.bench_scripts import BENCH, run_bench

sys.path.insert(0, str(BENCH))

import step_time_check  # noqa: E402

ROOFLINE = BENCH.parent / "results" / "moe_roofline_NVIDIA_H200.json"


def test_the_profiles_kernel_figures_are_the_fit():
    floor, curve = step_time_check.fit_kernels(json.loads(ROOFLINE.read_text())["rows"])
    for name in ("h200-ib400", "h100-ib400"):
        hw = load_hardware(name)
        assert hw.expert_kernel_floor_s == pytest.approx(floor, rel=1e-3)
        assert [n for n, _ in hw.expert_efficiency] == [n for n, _ in curve]
        assert [e for _, e in hw.expert_efficiency] == pytest.approx([e for _, e in curve], abs=1e-4)


def test_kernels_check_prints_the_held_out_rows(tmp_path):
    out = run_bench("step_time_check.py", "kernels", "--roofline", str(ROOFLINE), "--out", str(tmp_path / "k.json"))
    assert "held out: 11 of 12 within 10%" in out
    doc = json.loads((tmp_path / "k.json").read_text())
    held = [r for r in doc["rows"] if r["held_out"]]
    assert sorted({r["T"] for r in held}) == [2, 8, 32, 128, 4096, 16384]
    assert all(abs(r["error"]) <= 0.10 for r in held if r["T"] <= 256)


def test_measured_ratio_pairs_repeats_by_index(tmp_path):
    def run(path, loc, eplb):
        rows = [{"plan": plan, "format": "model", "rate": "948kbit", "workload": "wave", "overlap": False,
                 "runs": [{"tpot_p50_ms": t} for t in tpots]} for plan, tpots in (("locality", loc), ("eplb", eplb))]
        path.write_text(json.dumps({"bench": "ep_network", "results": rows}))
        return str(path)

    a = run(tmp_path / "a.json", [50, 60, 90], [100, 100, 100])
    b = run(tmp_path / "b.json", [80], [160])
    got = step_time_check.measured_ratios([a, b])["948kbit"]
    assert got["pairs"] == 4 and got["paired_ratio"] == pytest.approx(0.55)  # ratios 0.5, 0.6, 0.9, 0.5
    assert (got["subject_median_ms"], got["against_median_ms"]) == (70, 100)
