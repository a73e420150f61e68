import json

import numpy as np
import pytest

from locus.routing.plan.placement import PlacementPlan, PlanError, load_plan, plan_from_dict, validate
from locus.routing.plan.topology import Topology


def small_plan() -> PlacementPlan:
    # 2 nodes x 2 GPUs, 2 slots each = 8 slots for 6 experts: experts 0 and 3 have a replica.
    slots = np.array([[[0, 1], [2, 0], [3, 4], [5, 3]], [[5, 4], [3, 2], [1, 0], [0, 1]]])
    return PlacementPlan("toy", 6, (1, 3), Topology(2, 2, 2), slots, provenance={"planner": "hand"})


def plan_dict() -> dict:
    return small_plan().to_dict()


def test_json_round_trip(tmp_path):
    plan = small_plan()
    plan.grouping = {"micro_batches": 2}
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = load_plan(path)
    assert loaded.model == "toy" and loaded.num_experts == 6 and loaded.moe_layers == (1, 3)
    assert loaded.topology == plan.topology
    np.testing.assert_array_equal(loaded.slots, plan.slots)
    assert loaded.grouping == {"micro_batches": 2} and loaded.provenance == {"planner": "hand"}
    assert json.loads(path.read_text()) == plan.to_dict()
    assert not [p for p in tmp_path.iterdir() if p.name != "plan.json"]  # no temp file left behind


def test_json_layout_matches_design():
    data = plan_dict()
    assert data["format"] == "locus-placement" and data["version"] == 1
    assert data["topology"] == {"nodes": 2, "gpus_per_node": 2, "slots_per_gpu": 2}
    assert data["layers"][0] == {"layer": 1, "slots": [[0, 1], [2, 0], [3, 4], [5, 3]]}


def broken(**changes):
    data = plan_dict()
    for key, value in changes.items():
        if value is None:
            del data[key]
        else:
            data[key] = value
    return data


@pytest.mark.parametrize(
    "data, message",
    [
        (broken(layers=None), r"missing field\(s\): layers"),
        (broken(format="locus-trace"), r"format is 'locus-trace', expected 'locus-placement'"),
        (broken(version=2), r"version 2 is not supported"),
        (broken(num_experts=0), r"num_experts must be a positive integer"),
        (broken(moe_layers=[1, "3"]), r"moe_layers must be a list"),
        (broken(topology={"nodes": 2, "gpus_per_node": 2}), r"topology is missing field\(s\): slots_per_gpu"),
        (broken(provenance=[1]), r"provenance must be an object"),
        ([1, 2], r"must be a JSON object"),
    ],
)
def test_malformed_fields_are_named(data, message):
    with pytest.raises(PlanError, match=message):
        plan_from_dict(data)


def test_layer_errors_name_the_layer_and_rank():
    data = plan_dict()
    data["layers"][1]["layer"] = 5
    with pytest.raises(PlanError, match=r"layer 5 is placed but is not in the plan's moe_layers \[1, 3\]"):
        plan_from_dict(data)
    data = plan_dict()
    data["layers"][1]["layer"] = 1
    with pytest.raises(PlanError, match="layer 1 is placed twice"):
        plan_from_dict(data)
    data = plan_dict()
    del data["layers"][1]
    with pytest.raises(PlanError, match="MoE layer 3 has no placement"):
        plan_from_dict(data)
    data = plan_dict()
    data["layers"][0]["slots"].pop()
    with pytest.raises(PlanError, match=r"layer 1: slots lists 3 ranks, topology 2x2 .* has 4"):
        plan_from_dict(data)
    data = plan_dict()
    data["layers"][1]["slots"][2].append(5)
    with pytest.raises(PlanError, match="layer 3, rank 2: holds 3 expert ids, topology has 2 slots per GPU"):
        plan_from_dict(data)


def test_expert_id_errors_name_the_slot():
    data = plan_dict()
    data["layers"][1]["slots"][3][1] = 6
    with pytest.raises(PlanError, match=r"layer 3, rank 3, slot 1: expert id 6 is outside 0..5"):
        plan_from_dict(data)
    data = plan_dict()
    data["layers"][0]["slots"][0][0] = 1.5
    with pytest.raises(PlanError, match=r"layer 1, rank 0, slot 0: expert id 1.5 is not an integer"):
        plan_from_dict(data)


def test_missing_expert_is_named():
    data = plan_dict()
    data["layers"][0]["slots"][2] = [3, 3]  # expert 4 now has no slot in layer 1
    with pytest.raises(PlanError, match=r"layer 1: expert\(s\) 4 have no slot"):
        plan_from_dict(data)


def test_validate_against_the_model():
    plan = small_plan()
    validate(plan, num_experts=6, moe_layers=[1, 3])
    with pytest.raises(PlanError, match="plan is for 6 experts, the model has 8"):
        validate(plan, num_experts=8)
    with pytest.raises(PlanError, match=r"plan places layer 3, which is not an MoE layer of the model \[1, 5\]"):
        validate(plan, moe_layers=[1, 5])
    with pytest.raises(PlanError, match="plan has no placement for MoE layer 5"):
        validate(plan, moe_layers=[1, 3, 5])


def test_validate_programmatic_plans():
    plan = small_plan()
    plan.slots = plan.slots[:, :, :1]
    with pytest.raises(PlanError, match=r"slots have shape \(2, 4, 1\)"):
        validate(plan)
    plan = small_plan()
    plan.topology = Topology(1, 2, 2)
    with pytest.raises(PlanError, match="slots have shape"):
        validate(plan)
    plan = PlacementPlan("toy", 9, (1,), Topology(2, 2, 2), np.zeros((1, 4, 2), dtype=int))
    with pytest.raises(PlanError, match="8 slots per layer, fewer than the 9 experts"):
        validate(plan)


def test_load_plan_file_errors(tmp_path):
    with pytest.raises(PlanError, match="cannot read placement plan"):
        load_plan(tmp_path / "absent.json")
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "locus-placement",')
    with pytest.raises(PlanError, match=r"bad.json: not valid JSON \(line 1"):
        load_plan(bad)
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps(broken(version=7)))
    with pytest.raises(PlanError, match=r"wrong.json: version 7"):
        load_plan(wrong)
