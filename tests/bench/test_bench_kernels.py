"""The benchmark and the tuner run end to end on CPU (interpreter, small shapes) and write their files."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from locus.kernels import argmax_cpu
from locus.kernels.moe_configs import config_file_name, load_table
from tests.bench.bench_scripts import BENCH
from tests.bench.bench_scripts import run_bench as run

pytestmark = pytest.mark.slow  # every test runs a bench script as a subprocess


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
    stdout = run("tune_moe.py", "--small", "--repeat", "1", "--budget-seconds", "4", "--out-dir", str(tmp_path))
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    name = config_file_name(8, 64, 64, torch.float32, device)
    assert set(load_table(tmp_path, name)) == {1, 16}
    data = json.loads((tmp_path / name).read_text())
    assert data["provenance"]["search"].startswith("seeds + coordinate descent")
    assert set(data["provenance"]["configs_tried"]) == {"1", "16"} and "done in" in stdout


def test_tuner_small_with_a_weight_format(tmp_path):
    """--format: the experts held in mxfp4, the table named and marked by the format, the dot form of
    each point in its provenance."""
    run("tune_moe.py", "--small", "--format", "mxfp4", "--repeat", "1", "--budget-seconds", "4",
        "--out-dir", str(tmp_path))
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    name = config_file_name(8, 64, 64, "mxfp4", device)
    assert set(load_table(tmp_path, name)) == {1, 16}
    data = json.loads((tmp_path / name).read_text())
    assert data["weights"] == "mxfp4" and data["provenance"]["weights"] == "mxfp4"
    assert set(data["provenance"]["dot"]) == {"1", "16"}
    assert not (tmp_path / config_file_name(8, 64, 64, torch.float32, device)).exists()


def test_moe_kernels_bench_with_narrow_weights_on_triton(tmp_path):
    out = tmp_path / "mk.json"
    stdout = run("moe_kernels.py", "--shapes", "tiny", "--format", "model,mxfp8", "--backends", "triton",
                 "--tokens", "2", "--repeat", "1", "--dtype", "float32", "--out", str(out))
    rows = {r["weights"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"float32", "mxfp8"} and "| tiny | 2 | mxfp8 | triton |" in stdout
    assert rows["mxfp8"]["expert_bytes"] == rows["mxfp8"]["experts_touched"] * 3 * 64 * (64 + 2)
    assert rows["float32"]["expert_bytes"] == rows["float32"]["experts_touched"] * 3 * 64 * 64 * 4
    assert all(r["max_abs_diff"] < 1e-4 for r in rows.values())


def test_roofline_self_check_on_cpu(tmp_path):
    """The roofline table's CPU self-check: the tiny shape under the interpreter, ceilings given."""
    if torch.cuda.is_available():
        pytest.skip("on a GPU the roofline table is the GPU suite's job")
    out = tmp_path / "roofline.json"
    stdout = run("moe_kernels.py", "--roofline", "--shapes", "tiny", "--tokens", "1,2", "--repeat", "1",
                 "--peak-gbps", "10", "--peak-tflops", "1", "--out", str(out))
    result = json.loads(out.read_text())
    assert result["benchmark"] == "moe_roofline" and result["ceilings"]["bandwidth"] == 10e9
    assert [r["T"] for r in result["rows"]] == [1, 2]
    for r in result["rows"]:
        assert r["parity"] and r["max_abs_diff"] < 1e-4 and r["pass"] is None  # no target for a preset
        assert r["bytes"] == r["experts_touched"] * 3 * 64 * 64 * 4 + 2 * r["T"] * 64 * 4
        assert r["gbps"] == pytest.approx(r["bytes"] / r["ms"] / 1e6)
    assert stdout.strip().splitlines()[-3].startswith("| tiny | 2 | float32 |")  # the markdown table comes last


def test_roofline_counts_the_narrow_bytes_read(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("on a GPU the roofline table is the GPU suite's job")
    out = tmp_path / "roofline.json"
    run("moe_kernels.py", "--roofline", "--shapes", "tiny", "--format", "fp8,mxfp4", "--tokens", "2", "--repeat", "1",
        "--peak-gbps", "10", "--peak-tflops", "1", "--out", str(out))
    rows = {r["weights"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"fp8", "mxfp4"} and all(r["parity"] and r["dot"] == "dequant" for r in rows.values())
    # per expert: gate_up [64, 128] and down [64, 64] elements, plus scales (fp8: a float32 per column)
    assert rows["fp8"]["bytes"] == rows["fp8"]["experts_touched"] * (3 * 64 * 64 + 4 * (128 + 64)) + 2 * 2 * 64 * 4
    assert rows["mxfp4"]["bytes"] == rows["mxfp4"]["experts_touched"] * 3 * 64 * (32 + 2) + 2 * 2 * 64 * 4


def test_roofline_without_cuda_exits_2_for_the_llama_shapes():
    if torch.cuda.is_available():
        pytest.skip("checks the no-CUDA refusal")
    done = subprocess.run([sys.executable, str(BENCH / "moe_kernels.py"), "--roofline", "--shapes", "llama4-scout"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "needs a CUDA device" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.skipif(argmax_cpu.load_library() is None, reason="no C compiler: the kernel is unavailable")
def test_argmax_bench_small(tmp_path):
    out = tmp_path / "argmax.json"
    stdout = run("argmax.py", "--vocab", "300", "--batch", "1,20", "--repeat", "2", "--out", str(out))
    assert "| float32 | 20 |" in stdout and "| bfloat16 | 1 |" in stdout
    rows = json.loads(out.read_text())["rows"]
    assert {(r["dtype"], r["B"]) for r in rows} == {(d, b) for d in ("float32", "bfloat16") for b in (1, 20)}
    assert all(v > 0 for r in rows for v in r["us"].values())
