"""The benchmark and the tuner run end to end on CPU (interpreter, small shapes) and write their files."""

from __future__ import annotations

import json

import pytest
import torch
from bench_scripts import run_bench as run

from locus.kernels import argmax_cpu
from locus.kernels.moe_configs import config_file_name, load_table


def test_moe_kernels_bench_small(tmp_path):
    out = tmp_path / "results" / "moe_kernels.json"
    stdout = run("moe_kernels.py", "--small", "--shapes", "tiny", "--tokens", "1,16", "--repeat", "1", "--dtype", "float32",
                 "--out", str(out))
    assert "TFLOP/s" in stdout and "GB/s" in stdout
    result = json.loads(out.read_text())
    assert result["benchmark"] == "moe_kernels"
    rows = result["rows"]
    assert {(r["T"], r["backend"]) for r in rows} == {(1, "triton"), (1, "torch"), (16, "triton"), (16, "torch")}
    for r in rows:
        assert r["ms"] > 0 and r["tflops"] > 0 and r["gbps"] > 0
        assert r["max_abs_diff"] < 1e-4  # triton and torch agree on the timed inputs
    if not torch.cuda.is_available():
        assert all(r["compute_share"] is None for r in rows)  # no peak for a CPU


def test_tuner_small_writes_a_loadable_table(tmp_path):
    run("tune_moe.py", "--small", "--repeat", "1", "--out-dir", str(tmp_path))
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    name = config_file_name(8, 64, 64, torch.float32, device)
    assert set(load_table(tmp_path, name)) == {1, 16}


@pytest.mark.skipif(argmax_cpu.load_library() is None, reason="no C compiler: the kernel is unavailable")
def test_argmax_bench_small(tmp_path):
    out = tmp_path / "argmax.json"
    stdout = run("argmax.py", "--vocab", "300", "--batch", "1,20", "--repeat", "2", "--out", str(out))
    assert "| float32 | 20 |" in stdout and "| bfloat16 | 1 |" in stdout
    rows = json.loads(out.read_text())["rows"]
    assert {(r["dtype"], r["B"]) for r in rows} == {(d, b) for d in ("float32", "bfloat16") for b in (1, 20)}
    assert all(v > 0 for r in rows for v in r["us"].values())
