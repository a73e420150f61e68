"""The step-time objective (locus/routing/planners/step_objective.py, `locus plan --hardware`): of EPLB's
plan and the locality planner's candidates, the one whose predicted TPOT is lowest on requests none of
them was planned on."""

from __future__ import annotations

import json

import pytest

from locus.cli import main
from locus.errors import LocusError
from locus.routing.plan.caps import Caps
from locus.routing.plan.placement import load_plan
from locus.routing.plan.topology import parse_topology
from locus.routing.planners.planner import PlanOptions
from locus.routing.planners.step_objective import StepObjective, candidates, plan_for_step_time
from locus.routing.replay.hardware import load_hardware
from locus.routing.replay.model_shape import load_model_shape
from locus.traces.reader import TraceReader
from tests.routing.planners.planner_fixtures import synth_trace

SHAPE = {"source": "the toy synthetic trace of planner_fixtures.synth_trace", "hidden_size": 64,
         "moe_intermediate_size": 128, "num_hidden_layers": 6, "num_moe_layers": 3, "num_experts": 32, "top_k": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "dense_intermediate_size": 256,
         "shared_intermediate_size": 0, "vocab_size": 1000, "tie_word_embeddings": False, "dtype_bytes": 2}


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    root = tmp_path_factory.mktemp("objective")
    trace = synth_trace(root / "t", requests=320, seed=4)
    shape = root / "toy.json"
    shape.write_text(json.dumps(SHAPE))
    return trace, shape


def objective(shape, inter_gbps: float | None, concurrency: int = 16) -> StepObjective:
    hardware = load_hardware("h200-ib400")
    if inter_gbps is not None:
        hardware = hardware.with_links(inter_gbps * 1e9)
    return StepObjective(hardware, load_model_shape(str(shape)), concurrency)


@pytest.mark.parametrize("inter_gbps", [1e-4, None, 1e4], ids=["link-bound", "h200-ib400", "link-free"])
def test_the_chosen_plan_is_never_predicted_slower_than_eplb(toy, inter_gbps):
    trace, shape = toy
    reader = TraceReader(trace)
    topology = parse_topology("2x4", reader.meta.num_experts, 5)
    planned = plan_for_step_time(reader, topology, (0, 320), PlanOptions(caps=Caps()), objective(shape, inter_gbps),
                                 trace=str(trace))
    scores = {s.label: s for s in planned.scores}
    chosen, eplb = scores[planned.chosen], scores["eplb"]
    assert [s.label for s in planned.scores] == [c.label for c in candidates(PlanOptions(caps=Caps()))]
    assert chosen.tpot_p50_ms <= eplb.tpot_p50_ms
    assert all(chosen.key() <= s.key() for s in planned.scores)
    assert planned.scored_on == (240, 320)  # the last quarter: no candidate planned on it
    provenance = planned.result.plan.provenance
    assert provenance["objective"] == "step-time" and provenance["chosen"] == planned.chosen
    assert [c["label"] for c in provenance["candidates"]] == list(scores)
    if inter_gbps == 1e-4:  # the link sets the step: the plan that sends the fewest bytes wins, by far
        assert planned.chosen.startswith("locality")
        assert chosen.inter_node_bytes_per_token < eplb.inter_node_bytes_per_token
        assert chosen.tpot_p50_ms <= 0.9 * eplb.tpot_p50_ms
    grouped = not planned.chosen.startswith(("eplb", "locality placement only"))
    assert (planned.result.plan.grouping is not None) == grouped


def test_too_few_planning_requests_to_score_on(toy):
    trace, shape = toy
    reader = TraceReader(trace)
    topology = parse_topology("2x4", reader.meta.num_experts, 5)
    with pytest.raises(LocusError, match="scores plans on the last 25 %.*--objective bytes"):
        plan_for_step_time(reader, topology, (0, 20), PlanOptions(), objective(shape, None))


def test_locus_plan_with_a_hardware_profile_plans_for_the_step(toy, tmp_path, capsys):
    trace, shape = toy
    out = tmp_path / "plan.json"
    assert main(["plan", str(trace), "--topology", "2x4", "--slots", "5", "--hardware", "h200-ib400",
                 "--model-shape", str(shape), "--inter-gbps", "0.0001", "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "step-time objective" in text and "(chosen)" in text
    plan = load_plan(out)
    assert plan.provenance["objective"] == "step-time" and plan.provenance["hardware"] == "h200-ib400"
    assert plan.provenance["concurrency"] == 16 * 8


@pytest.mark.parametrize("flags,message", [
    (["--objective", "step-time"], "needs --hardware"),
    (["--hardware", "h200-ib400", "--planner", "eplb"], "use --planner locality"),
    (["--concurrency", "4"], "--concurrency applies to the step-time objective"),
    (["--inter-gbps", "1"], "--inter-gbps applies to the step-time objective"),
    (["--hardware", "h200-ib400", "--concurrency", "0"], "--concurrency must be at least 1"),
    (["--hardware", "no-such-profile"], "no-such-profile"),
    (["--hardware", "h200-ib400", "--model-shape", "mini"], "mini"),
])
def test_bad_objective_flags_are_one_line(toy, tmp_path, capsys, flags, message):
    trace, shape = toy
    extra = [] if "--model-shape" in flags else ["--model-shape", str(shape)]
    code = main(["plan", str(trace), "--topology", "2x4", "--slots", "5", "-o", str(tmp_path / "p.json"), *flags,
                 *(extra if "--hardware" in flags else [])])
    assert code != 0
    err = capsys.readouterr().err
    assert message in err
    assert not (tmp_path / "p.json").exists()
