"""bench/paired_tpot.py: repeats pair across clusters by index within a file, pool across files, and
the sign test and the median's interval are the binomial's."""

import json
import subprocess
import sys

import pytest

from tests.bench.bench_scripts import BENCH, run_bench

sys.path.insert(0, str(BENCH))

import paired_tpot  # noqa: E402


def write_run(path, clusters):
    """clusters: {(plan, format, rate): [tpot per repeat]} as bench/ep_network.py writes them."""
    results = [{"plan": plan, "format": fmt, "overlap": False, "untagged": False, "rate": rate, "workload": "wave",
                "tpot_p50_ms": sorted(tpots)[len(tpots) // 2], "runs": [{"tpot_p50_ms": t} for t in tpots]}
               for (plan, fmt, rate), tpots in clusters.items()]
    path.write_text(json.dumps({"bench": "ep_network", "results": results}))
    return path


def test_the_sign_test_and_the_median_interval_are_the_binomials():
    assert paired_tpot.sign_test_p(10, 10) == pytest.approx(2 / 1024)
    assert paired_tpot.sign_test_p(0, 10) == pytest.approx(2 / 1024)
    assert paired_tpot.sign_test_p(5, 10) == 1.0
    assert paired_tpot.sign_test_p(8, 10) == pytest.approx(2 * 56 / 1024)
    # n = 10: P(X <= 1) = 11/1024 < 0.025 < P(X <= 2) = 56/1024, so the interval is (d(2), d(9))
    diffs = [float(i) for i in range(10, 0, -1)]
    assert paired_tpot.median_interval(diffs) == (2.0, 9.0)
    assert paired_tpot.median_interval([1.0, 2.0, 3.0, 4.0, 5.0]) is None  # 2/32 > 0.025: no 95% interval


def test_repeats_pair_by_index_inside_a_file_and_pool_across_files(tmp_path):
    # a cluster that is 1 ms faster in every pair, though its repeats spread wider than 1 ms
    one = write_run(tmp_path / "a.json", {("locality", "mxfp8", "r"): [40.0, 49.0, 59.0],
                                          ("locality", "model", "r"): [41.0, 50.0, 60.0]})
    two = write_run(tmp_path / "b.json", {("locality", "mxfp8", "r"): [44.0, 54.0, 64.0],
                                          ("locality", "model", "r"): [45.0, 55.0, 65.0]})
    [row] = paired_tpot.compare(paired_tpot.load_runs([one, two]), "locality/mxfp8", ["locality/model"])
    assert (row.pairs, row.subject_faster, row.median_difference_ms) == (6, 6, -1.0)
    assert row.sign_test_p == pytest.approx(2 / 64)
    assert row.subject_median_ms == pytest.approx(51.5) and row.against_median_ms == pytest.approx(52.5)


def test_the_script_prints_the_table_and_writes_json(tmp_path):
    run = write_run(tmp_path / "run.json", {("eplb", "model", "r"): [50.0, 52.0, 51.0, 55.0, 49.0, 53.0],
                                            ("locality", "mxfp8", "r"): [47.0, 48.0, 52.0, 50.0, 46.0, 49.0]})
    out = run_bench("paired_tpot.py", str(run), "--subject", "locality/mxfp8", "--out", str(tmp_path / "o.json"))
    assert "eplb/model" in out and "5 of 6" in out
    written = json.loads((tmp_path / "o.json").read_text())
    assert written["comparisons"][0]["pairs"] == 6 and written["comparisons"][0]["subject_faster"] == 5


def test_unpaired_repeats_and_unknown_clusters_are_refused_by_name(tmp_path):
    run = write_run(tmp_path / "run.json", {("eplb", "model", "r"): [50.0, 52.0],
                                            ("locality", "mxfp8", "r"): [47.0, 48.0, 49.0]})
    done = subprocess.run([sys.executable, str(BENCH / "paired_tpot.py"), str(run), "--subject", "locality/mxfp8"],
                          capture_output=True, text=True)
    assert done.returncode != 0 and "do not pair" in done.stderr
    done = subprocess.run([sys.executable, str(BENCH / "paired_tpot.py"), str(run), "--subject", "locality/fp4"],
                          capture_output=True, text=True)
    assert done.returncode != 0 and "no cluster 'locality/fp4'" in done.stderr and "eplb/model" in done.stderr
    (tmp_path / "other.json").write_text(json.dumps({"bench": "serve"}))
    done = subprocess.run([sys.executable, str(BENCH / "paired_tpot.py"), str(tmp_path / "other.json"),
                           "--subject", "x/y"], capture_output=True, text=True)
    assert done.returncode != 0 and "not a bench/ep_network.py result" in done.stderr
