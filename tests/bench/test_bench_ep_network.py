"""bench/ep_network.py end to end on `tiny`: two network namespaces joined by a shaped veth link, one
torchrun agent per namespace, one plan at one rate, its rows dispatched and combined in MXFP8; the cluster's measured bytes equal the replay of
the trace it recorded (the script exits non-zero otherwise), and nothing it created is left behind.
Where namespaces cannot be made (not root, no iproute2), the bench says why and exits 2: skipped."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.bench.bench_scripts import BENCH

pytestmark = pytest.mark.slow  # runs bench/ep_network.py: namespaces and torchrun agents


def namespaces() -> set[str]:
    done = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    return {line.split()[0] for line in done.stdout.splitlines() if line.strip()}


def test_bench_ep_network_runs_and_cleans_up(tmp_path):
    out = tmp_path / "ep_network.json"
    before = namespaces() if os.geteuid() == 0 else set()
    done = subprocess.run(
        [sys.executable, str(BENCH / "ep_network.py"), "--model", "tiny", "--slots", "3", "--plans", "locality",
         "--overlap", "off", "--rates", "20mbit", "--workloads", "wave", "--streams", "4", "--output-len", "6",
         "--repeats", "1", "--planning-requests", "12", "--dispatch-format", "mxfp8/mxfp8", "--out", str(out)],
        capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if done.returncode == 2 and "needs" in done.stderr + done.stdout:
        pytest.skip((done.stderr or done.stdout).strip().splitlines()[-1])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    data = json.loads(out.read_text())
    assert [s["equal"] for s in data["sessions"]] == [True]
    rows = data["results"]
    # both payloads quantized (dispatch and combine): measured == replay in those formats, to the byte
    assert [(r["rate"], r["workload"], r["format"]) for r in rows] == [("unshaped", "wave", "mxfp8/mxfp8"),
                                                                       ("20mbit", "wave", "mxfp8/mxfp8")]
    for r in rows:
        assert r["tpot_p50_ms"] > 0 and r["out_tok_s"] > 0 and r["steps"] > 0
        # the machine's CPU during the run: the ranks spent some per step, and no more cores were busy than exist
        assert r["cpu_ms_per_step"] > 0 and 0 < r["cpu_busy_cores"] <= os.cpu_count() * 1.05
    shaped = rows[1]
    assert all(sum(run["link_bytes"]) > 0 for run in shaped["runs"])  # inter-node traffic crossed the veth link
    assert namespaces() == before, "the bench left network namespaces behind"
