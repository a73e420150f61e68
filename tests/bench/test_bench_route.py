"""bench/route.py: the router and the direct round robin side by side, paired by round; the tagged share
spread evenly; and (slow) a whole small run through real backends writes its table and JSON."""

import json
import sys

import pytest

from tests.bench.bench_scripts import BENCH, run_bench

sys.path.insert(0, str(BENCH))

import route  # noqa: E402
from serve_lib.load import LoadReport, Percentiles  # noqa: E402


def load(ttft: float, throughput: float) -> LoadReport:
    p = Percentiles(ttft, ttft, ttft, ttft)
    return LoadReport(10, 0, 1.0, 100, int(throughput), 10.0, throughput, throughput + 100, p, p, p, p, 0.1, "asyncio",
                      None, None, [])


def test_rounds_are_paired_and_their_differences_and_ratios_are_medians():
    runs = []
    for k, (d, r) in enumerate([((20.0, 100.0), (20.5, 99.0)), ((30.0, 80.0), (30.2, 80.0)), ((10.0, 90.0), (11.0, 85.5))]):
        runs.append(route.Run(1, k, "direct", load(*d), None, 1.0))
        runs.append(route.Run(1, k, "router", load(*r), 0.05, 1.0))
    runs.append(route.Run(1, 3, "direct", load(1.0, 1.0), None, 1.0))  # a round without its pair is left out
    (s,) = route.summarise(runs, [1])
    assert s["rounds"] == 3 and s["ttft_p50_added_ms"] == pytest.approx(0.5)
    assert s["throughput_ratio"] == pytest.approx(0.99) and s["ttft_p50_ms_direct"] == 20.0
    assert s["router_cpu_ms_per_request"] == pytest.approx(5.0)


def test_the_tagged_share_is_spread_evenly():
    class Text:
        def take(self, count, offset):
            return [("code", f"p{i}") for i in range(count)]

    for share, tagged in ((0.5, [1, 3, 5, 7]), (0.25, [3, 7]), (1.0, list(range(8))), (0.0, [])):
        bodies = route.bodies_of(Text(), 8, 4, share, 0)
        assert [i for i, b in enumerate(bodies) if "domain" in b] == tagged


@pytest.mark.slow  # starts two mini backends and the router
def test_a_small_run_prints_its_table_and_writes_json(tmp_path):
    out = tmp_path / "route.json"
    text = run_bench("route.py", "--backends", "1x2", "--concurrency", "2", "--rounds", "1", "--num-prompts", "4",
                     "--output-len", "2", "--out", str(out), timeout=300)
    assert "| concurrency | TTFT p50 direct ms |" in text
    result = json.loads(out.read_text())
    assert result["bench"] == "route" and [r["target"] for r in result["runs"]] == ["direct", "router"]
    assert all(r["load"]["successful"] == 4 for r in result["runs"])
    assert result["summary"][0]["rounds"] == 1


def test_the_router_s_own_time_is_read_from_its_histogram():
    before = ([(0.001, 0.0), (0.002, 0.0), (float("inf"), 0.0)], 0.0, 0.0)
    after = ([(0.001, 2.0), (0.002, 4.0), (float("inf"), 4.0)], 0.006, 4.0)
    own = route.overhead_between(before, after)
    assert own == {"p50": pytest.approx(1.0), "mean": pytest.approx(1.5)}
    assert route.overhead_between(after, after) is None
