"""bench/mini_trace.py records a domain-tagged trace of the shipped model and prints its statistics."""

from __future__ import annotations

import json

import pytest

from locus.engine.checkpoint.loader import shipped_model
from tests.bench.bench_scripts import run_bench

pytestmark = pytest.mark.slow  # runs bench/mini_trace.py as a subprocess


def test_mini_trace_records_every_domain(tmp_path):
    if shipped_model("mini") is None:
        pytest.skip("locus/assets/mini is not in this checkout")
    out = run_bench("mini_trace.py", "--models", "mini", "--requests-per-domain", "2", "--max-tokens", "4",
                    "--out", str(tmp_path / "traces"), "--json", str(tmp_path / "rows.json"))
    assert "| mini | 8, 1, [1, 3] |" in out
    row, = json.loads((tmp_path / "rows.json").read_text())
    assert row["requests"] == 14 and set(row["domain_js"]) and row["js_mean"] > 0
    assert (tmp_path / "traces" / "mini").is_dir()
