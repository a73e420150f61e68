"""bench/group_alignment.py records a tiny DeepSeek-V3 trace and compares EPLB and the locality plan with and
without --align-groups on it."""

from __future__ import annotations

import json

import pytest

from locus.engine.checkpoint.loader import shipped_model
from tests.bench.bench_scripts import run_bench

pytestmark = pytest.mark.slow  # runs bench/group_alignment.py as a subprocess


def test_aligned_plans_split_no_group_and_stay_within_topk_group_nodes(tmp_path):
    if shipped_model("mini") is None:
        pytest.skip("locus/assets/mini is not in this checkout (its held-out sample gives the prompts)")
    out = tmp_path / "rows.json"
    text = run_bench("group_alignment.py", "--requests-per-domain", "6", "--max-tokens", "8", "--topologies", "4x2:3",
                     "--trace", str(tmp_path / "trace"), "--work", str(tmp_path / "work"), "--out", str(out))
    rows = {r["plan"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"eplb (global)", "eplb (hierarchical)", "locality", "locality --align-groups"}
    for name in rows:
        assert f"| 4x2, 3 | {name} (" in text
    for name in ("eplb (hierarchical)", "locality --align-groups"):  # tiny-deepseek-v3: 4 groups, top 2 of them
        assert rows[name]["split_groups"] == 0 and rows[name]["node_bound"] == 2
        assert rows[name]["remote_nodes_max"] <= 2
    assert rows["eplb (global)"]["split_groups"] > 0
