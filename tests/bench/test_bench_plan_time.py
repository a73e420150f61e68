"""bench/plan_time.py: CPU seconds and peak RSS count the planner's worker processes, and --workers reaches the
planner (the same plan figures at 1 and 2 workers)."""

import json
import os
import sys
import time

import numpy as np
import pytest

from tests.bench.bench_scripts import BENCH, run_bench
from tests.routing.planners.planner_fixtures import synth_trace

sys.path.insert(0, str(BENCH))

import plan_time  # noqa: E402


def test_cpu_seconds_and_peak_rss_count_finished_children():
    cpu, own, peak = plan_time.cpu_seconds(), time.process_time(), plan_time.peak_rss_mib()
    pid = os.fork()
    if pid == 0:  # a worker: 0.3 s of CPU and a peak RSS 150 MiB above anything seen so far
        try:
            block = np.ones(int((peak + 150) * 2**20) // 8)
            end = time.process_time() + 0.3
            while time.process_time() < end:
                block[:1000] += 1.0
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert plan_time.cpu_seconds() - cpu >= 0.3 + (time.process_time() - own) - 0.01
    assert plan_time.peak_rss_mib() >= peak + 150


@pytest.mark.slow
def test_workers_reach_the_planner_and_keep_the_plan(tmp_path):
    trace = synth_trace(tmp_path / "t", requests=200, seed=2, experts=32, top_k=2, layers=(1, 3, 5, 7))
    cases = {}
    for workers in (1, 2):
        out = tmp_path / f"w{workers}.json"
        text = run_bench("plan_time.py", "--trace", str(trace), "--topology", "4x2", "--slots", "5",
                         "--expert-cap", "auto", "--workers", str(workers), "--out", str(out))
        assert f"workers                          {workers}" in text
        cases[workers] = json.loads(out.read_text())
        assert cases[workers]["workers"] == workers and cases[workers]["cpu_seconds"] > 0
    for case in cases.values():
        case["summary"].pop("plan_seconds")
    assert cases[1]["summary"] == cases[2]["summary"]
