"""bench/gpu_suite.py's CPU self-check: without CUDA it exits 2 and says why; --dry-run writes the JSON's
shape; a stage that hangs is cut at its budget with its whole process group; the parsers read what the
bench scripts write (the offline and profile_decode tests feed them real output)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch

from tests.bench.bench_scripts import BENCH

ROOT = BENCH.parent
sys.path.insert(0, str(BENCH))
import gpu_suite  # noqa: E402
import profile_decode  # noqa: E402


def run_suite(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(BENCH / "gpu_suite.py"), *args], capture_output=True, text=True,
                          timeout=120)


@pytest.mark.slow  # runs bench/gpu_suite.py as a subprocess
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU exit")
def test_without_cuda_it_exits_2_and_says_why():
    done = run_suite("--stages", "tests")
    assert done.returncode == 2 and "no CUDA device" in done.stderr


@pytest.mark.slow  # runs bench/gpu_suite.py as a subprocess
def test_dry_run_writes_every_stage_with_its_figures_keys(tmp_path):
    out = tmp_path / "suite.json"
    done = run_suite("--dry-run", "--out", str(out))
    assert done.returncode == 0, done.stderr
    assert done.stdout.rstrip().splitlines()[-1].startswith(f"| {gpu_suite.STAGES[-1]} | dry-run")  # the table: last
    report = json.loads(out.read_text())
    assert report["format"] == "locus-gpu-suite" and report["dry_run"] and not report["passed"]
    assert list(report["stages"]) == list(gpu_suite.STAGES)
    for name, stage in report["stages"].items():
        assert stage["status"] == "dry-run" and set(stage) == {"name", "status", "seconds", "reason", "command",
                                                               "figures", "output_tail"}
        assert stage["figures"] == gpu_suite.dry_figures(name)
    assert report["targets"]["decode-scout"]["target"] == 1.5
    assert set(gpu_suite.DECODE_KEYS) <= set(report["stages"]["decode-small"]["figures"])
    assert "step_split" in report["stages"]["decode-scout"]["figures"]  # replay / kernels / gaps / host per mode


@pytest.mark.slow  # runs bench/gpu_suite.py as a subprocess, three times
def test_stages_subset_and_bad_names(tmp_path):
    out = tmp_path / "s.json"
    assert run_suite("--dry-run", "--stages", "parity,serve", "--out", str(out)).returncode == 0
    assert list(json.loads(out.read_text())["stages"]) == ["parity", "serve"]
    done = run_suite("--dry-run", "--stages", "nope")
    assert done.returncode == 2 and "unknown stages" in done.stderr
    done = run_suite("--dry-run", "--budget", "tests")
    assert done.returncode != 0 and "STAGE=SECONDS" in done.stderr


@pytest.mark.slow  # a stage's process tree, cut at its budget
def test_a_stage_over_budget_is_cut_with_its_children():
    r = gpu_suite.StageResult("x")
    child = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); " \
            "print('started', flush=True); time.sleep(60)"
    start = time.perf_counter()
    assert gpu_suite.run_command(r, [sys.executable, "-c", child], budget=3) is None
    assert time.perf_counter() - start < 20 and r.status == "timeout" and "started" in r.output_tail
    r = gpu_suite.StageResult("y")
    assert gpu_suite.run_command(r, [sys.executable, "-c", "raise ValueError('boom')"], budget=30) == 1
    assert r.status == "failed" and "ValueError: boom" in r.reason


@pytest.mark.slow  # runs bench/moe_kernels.py --roofline as a subprocess (the Triton interpreter)
def test_kernels_narrow_stage_records_each_formats_bandwidth_share_from_its_stored_bytes(tmp_path):
    """The kernels-narrow stage's own command on `tiny` on CPU (ceilings given): every format's row,
    bytes counted as the format stores them, the share of the copy bandwidth from those bytes, the
    speed against the model-dtype row of the same run, and a table row that reads them."""
    r = gpu_suite.StageResult("kernels-narrow")
    gpu_suite.stage_kernels_narrow(r, 300, tmp_path, shape="tiny", tokens="2",
                                   extra=("--dtype", "float32", "--repeat", "1", "--peak-gbps", "10", "--peak-tflops", "1"))
    assert r.status == "ok", r.output_tail
    assert "--format model,fp8,mxfp8,mxfp4" in " ".join(r.command) and r.figures["table"]["complete"]
    by_format = r.figures["by_format"]
    assert set(by_format) == {"float32", "fp8", "mxfp8", "mxfp4"} and all(set(p) == {"2"} for p in by_format.values())
    touched = {row["weights"]: row["experts_touched"] for row in r.figures["table"]["rows"]}
    # tiny: gate_up [64, 128] and down [64, 64] per expert, scales along K = 64 (fp8: a float32 per column)
    per_expert = {"float32": 3 * 64 * 64 * 4, "fp8": 3 * 64 * 64 + 4 * (128 + 64), "mxfp8": 3 * 64 * (64 + 2),
                  "mxfp4": 3 * 64 * (32 + 2)}
    model_ms = by_format["float32"]["2"]["ms"]
    for weights, points in by_format.items():
        p = points["2"]
        assert p["bytes"] == touched[weights] * per_expert[weights] + 2 * 2 * 64 * 4  # + x read, out written
        assert p["bandwidth_share"] == pytest.approx(p["bytes"] / (p["ms"] / 1e3) / 10e9)
        assert p["parity"] and p["speedup_vs_model"] == pytest.approx(model_ms / p["ms"])
        assert p["dot"] == (None if weights == "float32" else "dequant")
    row = gpu_suite.summary_row(r)
    assert "incomplete" not in row and "T=2: float32 " in row and "mxfp4 (dequant) " in row


def test_junit_counts_name_the_failures():
    xml = ('<testsuites><testsuite tests="3" failures="1" errors="0" skipped="1">'
           '<testcase classname="a" name="t1"/><testcase classname="a" name="t2"><failure/></testcase>'
           '<testcase classname="b" name="t3"><skipped/></testcase></testsuite></testsuites>')
    counts = gpu_suite.junit_counts(xml)
    assert (counts["tests"], counts["failures"], counts["skipped"]) == (3, 1, 1) and counts["failed_tests"] == ["a::t2"]


@pytest.mark.slow  # two engines and the interpreted Triton experts
def test_parity_stage_self_check_on_cpu_and_its_table_row(tmp_path):
    """bench/gpu_parity.py on `tiny` on CPU (interpreted Triton experts, uncompiled static-buffer
    graphs): it passes, and the suite's table row reads its figures."""
    out = tmp_path / "parity.json"
    done = subprocess.run([sys.executable, str(BENCH / "gpu_parity.py"), "--model", "tiny", "--device", "cpu",
                           "--prompts", "3", "--new-tokens", "5", "--out", str(out)], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr
    figures = json.loads(out.read_text())
    assert figures["passed"] and figures["graph_vs_eager"]["steps_compared"] >= 4
    assert figures["graph_vs_eager"]["logits_max_diff"] <= 1e-5 and figures["triton_vs_torch"]["logits_max_diff"] <= 1e-4
    assert figures["overlapped_vs_serial"] == {"tokens_identical": 3, "prompts": 3, "identical_to_eager": 3}
    row = gpu_suite.summary_row(gpu_suite.StageResult("parity", "ok", 1.0, figures=figures))
    assert "3/3 identical" in row and "incomplete" not in row


def test_table_rows_read_every_stage_figures():
    """Rows built from figures shaped as the parsers return them (the parsers read real bench output
    in the offline, profile_decode and serve bench tests)."""
    split = {"eager": profile_decode.no_split("eager"), "graph": profile_decode.split_step(0.5, 0.3, 0.25, 120),
             "graph+compile": profile_decode.split_step(0.4, 0.3, 0.2, 90)}
    decode = gpu_suite.decode_figures({
        "workload": "w", "floor_ms": 0.2, "floor_parts_ms": {}, "step_ms": {"eager": 9.0, "graph": 0.5, "graph+compile": 0.4},
        "step_over_floor": {"eager": 45.0, "graph": 2.5, "graph+compile": 2.0}, "bandwidth_gbps": 3000.0,
        "peak_tflops": 700.0, "graphs": {}, "graphs_skipped": {}, "inductor_cudagraph_skips": 0, "step_split": split}, 3.0)
    assert decode["best_mode"] == "graph+compile" and decode["target_met"]
    assert "graph+compile step = replay 0.300 (kernels 0.200 + gaps 0.100) + host 0.100 ms" in \
        gpu_suite.summary_row(gpu_suite.StageResult("decode-small", "ok", 1.0, figures=decode))
    percentiles = {"mean": 1.0, "median": 1.0, "p90": 1.0, "p99": 1.0}
    serve = {"successful": 64, "failed": 0, "duration_s": 1.0, "output_throughput": 4096.0, "ttft_ms": percentiles,
             "tpot_ms": percentiles, "itl_ms": percentiles, "errors": []}
    offline = {"rows": [{"engine": "locus", "output_tokens_per_s": 9000.0}], "ratio_locus_over_transformers": 3.0,
               "identical_greedy_share": 1.0, "transformers_error": None}
    tests = {"tests": 10, "failures": 1, "errors": 0, "skipped": 2, "failed_tests": ["a::b"]}
    overhead = gpu_suite.overhead_figures(json.loads((ROOT / "results" / "engine_overhead_before.json").read_text()))
    for name, figures in (("decode-small", decode), ("serve", serve), ("offline", offline), ("tests", tests),
                          ("overhead", overhead)):
        row = gpu_suite.summary_row(gpu_suite.StageResult(name, "ok", 1.0, figures=figures))
        assert "incomplete" not in row and row.startswith(f"| {name} | ok |")


def test_the_suite_loop_runs_each_stage_and_keeps_going(tmp_path, monkeypatch, capsys):
    """main() with a pretend GPU and stand-in stages: a passing, a failing and a hanging stage each
    get their status and reason, a stage past the deadline is skipped, the JSON and the table come
    out, and the exit code says a stage failed."""
    def stand_in(code: str):
        def stage(result, budget, work):
            gpu_suite.run_command(result, [sys.executable, "-c", code], budget)
        return stage

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_suite, "environment", lambda dry_run: {"device": "Pretend GPU", "torch": torch.__version__,
                                                                    "python": "3", "cuda": "0", "triton": None,
                                                                    "commit": None})
    monkeypatch.setattr(gpu_suite, "RUNNERS", {"tests": stand_in("print('fine')"),
                                               "parity": stand_in("import sys; sys.exit('parity broke')"),
                                               "kernels": stand_in("import time; time.sleep(30)"),
                                               "serve": stand_in("print('never')")})
    out = tmp_path / "suite.json"
    code = gpu_suite.main(["--stages", "tests,parity,kernels,serve", "--budget", "kernels=2", "--deadline", "16.5",
                           "--out", str(out)])
    report = json.loads(out.read_text())
    stages = report["stages"]
    assert code == 1 and not report["passed"] and not report["complete"] and report["device"] == "Pretend GPU"
    assert stages["tests"]["status"] == "ok" and "fine" in stages["tests"]["output_tail"]
    assert stages["parity"]["status"] == "failed" and "parity broke" in stages["parity"]["reason"]
    assert stages["kernels"]["status"] == "timeout"
    assert stages["serve"]["status"] == "skipped" and "deadline" in stages["serve"]["reason"]
    # every stage that ran passed, one did not fit the deadline: passed, not complete, exit 0, and the
    # command for the rest is printed
    monkeypatch.setattr(gpu_suite, "RUNNERS", {"tests": stand_in("import time; time.sleep(2)"),
                                               "serve": stand_in("print('never')")})
    code = gpu_suite.main(["--stages", "tests,serve", "--deadline", "16.5", "--out", str(out)])
    report = json.loads(out.read_text())
    assert code == 0 and report["passed"] and not report["complete"]
    assert "--stages serve" in capsys.readouterr().out


def test_the_decode_step_split_reads_a_profiler_trace():
    """profile_decode's split of a graph step: device activities of a chrome trace (kernels, copies,
    memsets; not the host's runtime calls) summed; launch gaps = replay - kernels; host = step - replay."""
    trace = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "gemm", "dur": 120.0}, {"ph": "X", "cat": "kernel", "name": "argmax", "dur": 30.5},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD", "dur": 4.5},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "dur": 900.0},
        {"ph": "i", "cat": "kernel", "name": "marker"}]}
    assert profile_decode.device_time_ms(trace) == (pytest.approx(0.155), 3)
    parts = profile_decode.split_step(step_ms=0.9, replay_ms=0.2, kernel_sum_ms=0.155, kernel_count=3)
    assert parts["launch_gaps_ms"] == pytest.approx(0.045) and parts["host_ms"] == pytest.approx(0.7)
    assert set(profile_decode.SPLIT_KEYS) < set(parts) and parts["reason"] is None
