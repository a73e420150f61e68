"""bench/stop_strings.py times the stop-string scan against re-scanning, end to end."""

from __future__ import annotations

import json

import pytest

from tests.bench.bench_scripts import run_bench

pytestmark = pytest.mark.slow  # runs a bench script as a subprocess


def test_the_stop_string_bench_runs(tmp_path):
    out = run_bench("stop_strings.py", "--lengths", "150,300", "--stop-lengths", "100", "--out", str(tmp_path / "s.json"))
    assert "re-scan ms/token" in out
    rows = json.loads((tmp_path / "s.json").read_text())["rows"]
    assert [(r["output_chars"], r["stop_chars"]) for r in rows] == [(150, 100), (300, 100)]
