"""bench/ep_wire.py: the bytes gloo collectives put on a veth link between two namespaces. A payload
row carries at least its payload, a collective inside a node puts (almost) nothing on the link, and
nothing the bench created is left behind. Without root or namespaces it exits 2: skipped."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.bench.bench_scripts import BENCH
from tests.bench.test_bench_ep_network import namespaces

pytestmark = pytest.mark.slow  # runs bench/ep_wire.py: rank processes in namespaces


def test_bench_ep_wire_measures_each_collective_and_cleans_up(tmp_path):
    out = tmp_path / "ep_wire.json"
    before = namespaces() if os.geteuid() == 0 else set()
    done = subprocess.run([sys.executable, str(BENCH / "ep_wire.py"), "--iterations", "20", "--payload", "2048",
                           "--out", str(out)], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    if done.returncode == 2 and "needs" in done.stderr + done.stdout:
        pytest.skip((done.stderr or done.stdout).strip().splitlines()[-1])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    nodes = json.loads(out.read_text())["nodes"]
    for rows in nodes.values():
        by = {r["collective"]: r["bytes_per_call"] for r in rows}
        payload = next(v for k, v in by.items() if k.startswith("tier 1: rows") and "2048 B" in k)
        empty = next(v for k, v in by.items() if k.startswith("tier 1: rows") and "(0 B" in k)
        inside = next(v for k, v in by.items() if k.startswith("tier 2"))
        assert payload >= 2 * 2048  # both tier-1 groups send their rows over the one link
        assert 0 < empty < payload
        assert inside < empty / 4  # intra-node traffic stays off the link (what is left: the closing barrier)
    assert "| collective |" in done.stdout
    assert namespaces() == before, "the bench left network namespaces behind"
