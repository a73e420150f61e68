"""bench/offline.py, bench/profile_decode.py and bench/omp_teams.py run end to end on the tiny preset."""

from __future__ import annotations

import json
import sys

import pytest

from locus.engine.checkpoint.presets import build_preset
from locus.engine.checkpoint.weights import save_checkpoint
from tests.bench.bench_scripts import BENCH, run_bench as run

sys.path.insert(0, str(BENCH))
import gpu_suite  # noqa: E402

pytestmark = pytest.mark.slow  # every test runs a bench script as a subprocess


def test_offline_bench_against_transformers(tmp_path):
    model = save_checkpoint(build_preset("tiny", seed=3), tmp_path / "tiny")
    out = tmp_path / "offline.json"
    stdout = run("offline.py", "--model", str(model), "--prompts", "3", "--prompt-len", "9", "--new-tokens", "5",
                 "--repeats", "1", "--phases", "--compile", "--out", str(out))
    assert "locus / transformers throughput" in stdout and "speed-up of locus-compiled: prefill" in stdout
    result = json.loads(out.read_text())
    assert result["dtype"] == "float32"
    locus, compiled, hf = result["rows"]
    assert (locus["engine"], compiled["engine"], hf["engine"]) == ("locus", "locus-compiled", "transformers")
    assert result["ratio_locus_over_transformers"] == locus["output_tokens_per_s"] / hf["output_tokens_per_s"]
    assert result["identical_greedy_share"] == 1.0  # float32: the same greedy tokens as transformers
    assert compiled["identical_to_eager_share"] == 1.0
    for row in (locus, compiled, hf):
        assert 0 < row["prefill_seconds"] and row["prefill_seconds"] + row["decode_seconds"] == pytest.approx(row["seconds"])
    assert gpu_suite.offline_figures(result)["transformers_error"] is None  # what the GPU suite reads of it


def test_profile_decode_puts_eager_and_compiled_steps_beside_the_floor(tmp_path):
    out = tmp_path / "decode.json"
    stdout = run("profile_decode.py", "--model", "tiny", "--prompts", "2", "--prompt-len", "4", "--steps", "2",
                 "--profile", "--out", str(out))
    assert "| **floor** |" in stdout and "| compiled step |" in stdout and "aten::" in stdout
    result = json.loads(out.read_text())
    parts = result["floor_parts_ms"]
    assert set(parts) == {"lm_head_ms", "experts_ms", "dense_ms"} and all(v > 0 for v in parts.values())
    assert result["floor_ms"] == pytest.approx(sum(parts.values()))
    assert result["lm_head_forms_ms"] and parts["lm_head_ms"] == min(result["lm_head_forms_ms"].values())
    for kind in ("eager", "compiled"):
        assert result["step_over_floor"][kind] == pytest.approx(result["step_ms"][kind] / result["floor_ms"])
    assert result["touched_expert_bytes"] > 0 and result["compile_s"] > 0
    for kind in ("eager", "compiled"):  # on CPU no graph replays: the split says why, each figure None
        split = result["step_split"][kind]
        assert "CPU" in split["reason"] and split["replay_ms"] is None and split["host_ms"] is None
    figures = gpu_suite.decode_figures(result, 3.0)  # what the GPU suite reads of it
    assert figures["best_mode"] == "compiled" and figures["graphs_skipped"] == {}
    assert figures["target_met"] == (result["step_over_floor"]["compiled"] <= 3.0)


@pytest.mark.slow
def test_profile_decode_puts_narrow_experts_beside_the_model_dtype(tmp_path):
    """--quantize-experts: a copy with mxfp4 experts steps beside the float model; its floor counts
    the narrow bytes (ExpertQuantization.bytes_after per held expert)."""
    out = tmp_path / "decode.json"
    stdout = run("profile_decode.py", "--model", "tiny", "--prompts", "2", "--prompt-len", "4", "--steps", "2",
                 "--quantize-experts", "mxfp4", "--out", str(out), timeout=900)
    assert "| mxfp4 |" in stdout and "| float32 |" in stdout
    result = json.loads(out.read_text())
    q = result["quantized_experts"]
    assert q["format"] == "mxfp4" and q["bytes_per_expert"] == 3 * 64 * (64 // 2 + 64 // 32)  # tiny: H = I = 64
    assert q["floor_ms"] == pytest.approx(sum(q["floor_parts_ms"].values()))
    assert q["floor_parts_ms"]["lm_head_ms"] == result["floor_parts_ms"]["lm_head_ms"]
    for kind in ("eager", "compiled"):
        assert q["step_speedup_vs_model"][kind] == pytest.approx(result["step_ms"][kind] / q["step_ms"][kind])


def test_omp_teams_bench_times_each_phase(tmp_path):
    out = tmp_path / "teams.json"
    stdout = run("omp_teams.py", "--model", "tiny", "--prompts", "2", "--prompt-len", "4", "--new-tokens", "3",
                 "--rounds", "2", "--out", str(out))
    assert "second team alive" in stdout and "vs one team" in stdout
    result = json.loads(out.read_text())
    assert result["torch_threads"] == 1  # run_bench's OMP_NUM_THREADS=1: no worker, so no throttling to see
    assert list(result["runs"]) == ["one team", "second team alive", "second team gone"]
    for phase, runs in result["runs"].items():
        assert len(runs) == 2 and all(v > 0 for v in runs)
        assert result["median"][phase] == pytest.approx(sorted(runs)[0] / 2 + sorted(runs)[1] / 2)
