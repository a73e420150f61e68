"""bench/soak.py end to end, small: a real server with 16 KV blocks, mixed requests, a JSON report."""

from __future__ import annotations

import json

import pytest

from tests.bench.bench_scripts import run_bench

pytestmark = pytest.mark.slow  # runs bench/soak.py: a server under load


def test_soak_smoke_answers_every_request(tmp_path):
    out = tmp_path / "soak.json"
    stdout = run_bench("soak.py", "--requests", "30", "--concurrency", "6", "--seed", "3", "--out", str(out), timeout=300)
    report = json.loads(out.read_text())
    assert set(report["outcomes"]) <= {"completed", "refused-400", "left"}
    assert sum(report["outcomes"].values()) == 30 and report["outcomes"]["completed"] > 0
    assert report["server_alive_at_end"] and report["exit_code"] == 0 and report["preemptions"] > 0
    assert "| completed |" in stdout
