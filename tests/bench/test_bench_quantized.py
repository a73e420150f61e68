"""bench/moe_kernels.py's weight formats on the CPU kernel (what bench/quantized_experts_cpu.py did
before it was folded in) and bench/quantized_quality.py run end to end and write their JSON."""

from __future__ import annotations

import json

import pytest

from locus.engine.checkpoint.loader import shipped_model
from locus.kernels import moe_cpu
from tests.bench.bench_scripts import run_bench as run

pytestmark = pytest.mark.slow  # every test runs a bench script as a subprocess


@pytest.mark.skipif(not moe_cpu.available(), reason="no C compiler: the kernel is unavailable")
def test_quantized_experts_cpu_bench(tmp_path):
    out = tmp_path / "q.json"
    stdout = run("moe_kernels.py", "--shapes", "mini", "--backends", "cpu", "--format", "model,fp8,mxfp8,mxfp4",
                 "--dtype", "bfloat16", "--tokens", "1,4", "--repeat", "2", "--layer-bytes", "2", "--out", str(out))
    assert "| shape | T | weights | backend |" in stdout
    rows = json.loads(out.read_text())["rows"]
    assert {(r["T"], r["weights"]) for r in rows} == {(t, w) for t in (1, 4)
                                                      for w in ("bfloat16", "fp8", "mxfp8", "mxfp4")}
    by = {(r["T"], r["weights"]): r for r in rows}
    assert by[(1, "mxfp4")]["expert_bytes"] < by[(1, "mxfp8")]["expert_bytes"] < by[(1, "bfloat16")]["expert_bytes"]
    assert by[(1, "mxfp8")]["expert_bytes"] == by[(1, "mxfp8")]["experts_touched"] * 3 * 256 * (256 + 256 // 32)
    assert all(r["ms"] > 0 and r["max_abs_diff"] < 0.05 for r in rows)
    assert all(r["vs_model"] == pytest.approx(by[(r["T"], "bfloat16")]["ms"] / r["ms"]) for r in rows)


@pytest.mark.slow
def test_quantized_quality_bench(tmp_path):
    if shipped_model("mini") is None:
        pytest.skip("the shipped mini checkpoint is not installed")
    out = tmp_path / "quality.json"
    stdout = run("quantized_quality.py", "--domains", "math", "--formats", "mxfp8", "--dispatch-formats", "mxfp8",
                 "--both", "mxfp8+mxfp8", "--max-prompts", "2", "--greedy-tokens", "4", "--out", str(out), timeout=600)
    assert "| weights | mxfp8 |" in stdout and "| dispatch | mxfp8 |" in stdout and "| both | mxfp8 + mxfp8 |" in stdout
    result = json.loads(out.read_text())
    assert [(r["where"], r["weights"], r["dispatch"]) for r in result["rows"]] == [
        ("weights", "mxfp8", None), ("dispatch", None, "mxfp8"), ("both", "mxfp8", "mxfp8")]
    for r in result["rows"]:
        row = r["domains"]["math"]
        assert abs(row["change"]) < 0.01 and 0.9 < row["top1_agreement"] <= 1
    assert "TODO" not in stdout
