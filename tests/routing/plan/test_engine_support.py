"""`locus plan export` says when the other engine will not apply the plan (locus/routing/plan/engine_support.py)."""

from __future__ import annotations

import json
import shlex

import numpy as np
import pytest

from locus.cli import main
from locus.routing.plan.engine_support import model_family, placement_warning
from locus.routing.plan.placement import PlacementPlan
from locus.routing.plan.topology import Topology

SLOTS = np.array([[[0, 1], [2, 0], [3, 4], [5, 5]]])  # [L=1, R=4, S=2], 6 experts


def export(tmp_path, capsys, model: str, fmt: str):
    plan = tmp_path / "plan.json"
    PlacementPlan(model, 6, (3,), Topology(2, 2, 2), SLOTS.copy(), provenance={"planner": "test"}).save(plan)
    out = tmp_path / f"map-{fmt}.json"
    assert main(["plan", "export", str(plan), "--to", fmt, "-o", str(out)]) == 0
    assert out.exists()  # a warning never stops the export
    return capsys.readouterr()


@pytest.mark.parametrize("model", ["meta-llama/Llama-4-Scout-17B-16E-Instruct", "llama4-maverick", "small"])
def test_a_llama4_plan_exported_to_sglang_warns_naming_the_family(tmp_path, capsys, model):
    captured = export(tmp_path, capsys, model, "sglang")
    assert "warning: SGLang 0.5.23 does not place experts for Llama-4 models" in captured.err
    assert "Llama4ForCausalLM" in captured.err and repr(model) in captured.err
    assert "SGLang: --ep-size 4" in captured.out and "warning" not in captured.out


def test_a_plan_exported_to_vllm_prints_the_vllm_serve_flags(tmp_path, capsys):
    """As for SGLang: the flags that size vLLM's expert parallelism and EPLB to the plan (4 ranks on 2 nodes,
    8 physical experts for 6), and how the file gets in, since vLLM has no flag that loads one."""
    out = export(tmp_path, capsys, "llama4-scout", "vllm").out.splitlines()
    flags = out[1]
    assert flags == ("vLLM: --tensor-parallel-size 1 --data-parallel-size 4 --data-parallel-size-local 2 "
                     "--enable-expert-parallel --enable-eplb "
                     "--eplb-config '{\"num_redundant_experts\":2,\"step_interval\":2147483647}'")
    args = shlex.split(flags.removeprefix("vLLM: "))
    assert json.loads(args[args.index("--eplb-config") + 1]) == {"num_redundant_experts": 2, "step_interval": 2**31 - 1}
    assert out[2] == (f"vLLM has no flag that loads {tmp_path / 'map-vllm.json'}: load it on every EP rank with the "
                      "patch in docs/interop.md (\"Taking a Locus plan to vLLM\")")


def test_a_one_rank_plan_exported_to_vllm_says_eplb_needs_more(tmp_path, capsys):
    plan = tmp_path / "plan.json"
    PlacementPlan("m", 6, (0,), Topology(1, 1, 8), SLOTS.reshape(1, 1, 8).copy(), provenance={"planner": "t"}).save(plan)
    assert main(["plan", "export", str(plan), "--to", "vllm", "-o", str(tmp_path / "v.json")]) == 0
    assert "vLLM: EPLB needs an expert-parallel size above 1" in capsys.readouterr().out


def test_a_mixtral_plan_exported_to_sglang_warns(tmp_path, capsys):
    assert "does not place experts for Mixtral models" in export(tmp_path, capsys, "mistralai/Mixtral-8x7B-v0.1",
                                                                 "sglang").err


@pytest.mark.parametrize("model, fmt", [
    ("deepseek-ai/DeepSeek-V3", "sglang"),  # DeepseekV3ForCausalLM has expert-location support
    ("deepseek-v3", "vllm"),
    ("Qwen/Qwen3-235B-A22B", "sglang"),
    ("meta-llama/Llama-4-Scout-17B-16E-Instruct", "vllm"),  # vLLM's Llama4 classes implement MixtureOfExperts
    ("meta-llama/Llama-4-Scout-17B-16E-Instruct", "deepseek"),  # a bare EPLB triple: no engine to judge
])
def test_no_warning_where_the_engine_places_the_family(tmp_path, capsys, model, fmt):
    assert export(tmp_path, capsys, model, fmt).err == ""


def test_an_unknown_family_gets_a_note_not_a_warning(tmp_path, capsys):
    err = export(tmp_path, capsys, "my-moe", "sglang").err
    assert err.startswith("note: model 'my-moe' is of no family") and "warning" not in err


@pytest.mark.parametrize("model, family", [
    ("Llama-4-Maverick-17B-128E-Instruct", "Llama-4"), ("/ckpt/llama_4_scout/", "Llama-4"), ("scout-2l", "Llama-4"),
    ("deepseek-ai/DeepSeek-V2-Lite", "DeepSeek-V2/V3"), ("qwen3-235b", "Qwen3-MoE"), ("mixtral-8x7b", "Mixtral"),
    ("tiny-moe", None), ("llama-3-70b", None), ("olmoe", None),
])
def test_model_family(model, family):
    got = model_family(model)
    assert (got.name if got else None) == family


def test_placement_warning_only_for_known_engines():
    assert placement_warning("llama4-scout", "deepseek") is None
    assert placement_warning("llama4-scout", "vllm") is None
    assert placement_warning("llama4-scout", "sglang").startswith("warning: ")
