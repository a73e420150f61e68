"""`locus plan` and `locus replay --assign grouper` end to end; invalid inputs fail cleanly, writing nothing."""

import json

import pytest

from locus.cli import main
from locus.routing.plan.placement import load_plan

from tests.routing.planners.planner_fixtures import synth_trace


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    return synth_trace(tmp_path_factory.mktemp("plancli") / "t", requests=120, seed=5)


def test_plan_then_replay_with_the_grouper(trace, tmp_path, capsys):
    plan, summary, report = tmp_path / "plan.json", tmp_path / "summary.json", tmp_path / "replay.json"
    assert main(["plan", str(trace), "--topology", "2x2", "--slots", "10", "--requests", "0:0.5",
                 "-o", str(plan), "--json", str(summary), "--seed", "3"]) == 0
    out = capsys.readouterr().out
    for label in ("locality (expected, planning data)", "inter-node bytes/token", "expert imbalance", "plan time"):
        assert label in out
    loaded = load_plan(plan)
    assert loaded.planner == "locality" and loaded.grouping["version"] == 1
    assert loaded.provenance["requests"] == "0:60" and loaded.provenance["seed"] == 3
    doc = json.loads(summary.read_text())
    assert doc["expert_imbalance_worst"] <= 1.10 + 1e-9
    assert main(["replay", str(trace), "--plan", str(plan), "--assign", "grouper", "--requests", "0.5:1",
                 "--json", str(report)]) == 0
    doc = json.loads(report.read_text())
    assert doc["assignment"] == "grouper" and doc["requests"] == [60, 120] and "migrated_kv_bytes" in doc


def test_baseline_planners_from_the_plan_command(trace, tmp_path, capsys):
    out = tmp_path / "eplb.json"
    assert main(["plan", str(trace), "--topology", "2x2", "--slots", "9", "--planner", "eplb", "-o", str(out)]) == 0
    assert load_plan(out).planner == "eplb" and "balanced assignment" in capsys.readouterr().out


@pytest.mark.parametrize("planner, flag, rule", [
    ("eplb", None, "position"),  # the rule EPLB balances for, unless asked otherwise
    ("eplb", "node-aware", "node-aware"),
    ("round_robin", None, "node-aware"),
    ("locality", None, "node-aware"),
    ("locality", "position", "position"),
])
def test_each_planner_s_plan_carries_its_dispatch_rule(trace, tmp_path, capsys, planner, flag, rule):
    out = tmp_path / "plan.json"
    extra = ["--dispatch", flag] if flag else []
    assert main(["plan", str(trace), "--topology", "2x2", "--slots", "9", "--planner", planner, "-o", str(out),
                 *extra]) == 0
    assert load_plan(out).dispatch == rule


@pytest.mark.parametrize("args, message", [
    (["--topology", "2x2", "--slots", "7"], "fewer than the 32 experts"),
    (["--topology", "2x2", "--slots", "8", "--expert-cap", "1.0"], "expert-load cap 1.000 cannot be met"),
    (["--topology", "2x2", "--slots", "9", "--expert-cap", "0.5"], "cap must be a number >= 1.0"),
    (["--topology", "2by2"], "not of the form NODESxGPUS"),
    (["--topology", "2x2", "--requests", "5:2"], "outside 0:120 or reversed"),
])
def test_invalid_inputs_get_one_line_and_no_file(trace, tmp_path, capsys, args, message):
    out = tmp_path / "plan.json"
    assert main(["plan", str(trace), "-o", str(out), *args]) == 2
    assert message in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # nothing written, not even a temporary file


def test_missing_output_directory_fails_before_planning(trace, tmp_path, capsys):
    assert main(["plan", str(trace), "--topology", "2x2", "--slots", "9", "-o", str(tmp_path / "no" / "p.json")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_a_plan_for_another_model_or_without_grouping_is_refused(trace, tmp_path, capsys):
    other = synth_trace(tmp_path / "other", requests=20, experts=16)
    plan = tmp_path / "plan.json"
    assert main(["plan", str(trace), "--topology", "2x2", "--slots", "9", "-o", str(plan)]) == 0
    assert main(["replay", str(other), "--plan", str(plan), "--assign", "grouper"]) == 2
    assert "plan is for 32 experts, the model has 16" in capsys.readouterr().err
    eplb = tmp_path / "eplb.json"
    assert main(["plan", str(trace), "--topology", "2x2", "--slots", "9", "--planner", "eplb", "-o", str(eplb)]) == 0
    assert main(["replay", str(trace), "--plan", str(eplb), "--assign", "grouper"]) == 2
    assert "has no grouping object" in capsys.readouterr().err


def test_help_reaches_both_inner_parsers(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "-h"])
    assert "--topology" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["plan", "evaluate", "--help"])
    assert "--synth-requests" in capsys.readouterr().out


def test_no_structure_to_exploit_is_said_plainly(tmp_path, capsys):
    import numpy as np

    from locus.traces.format import TraceMeta
    from locus.traces.writer import TraceWriter

    rng = np.random.default_rng(0)
    path = tmp_path / "uniform"
    with TraceWriter(path, TraceMeta("flat", 16, 2, (0, 1), hidden_size=32)) as writer:
        for i in range(200):
            ids = np.argsort(rng.random((12, 2, 16)), axis=2)[:, :, :2]
            writer.add_request(f"u{i}", ("code", "chat")[i % 2], 6, ids)
    assert main(["plan", str(path), "--topology", "2x2", "--slots", "4", "-o", str(tmp_path / "p.json")]) == 0
    assert "little expert locality to exploit" in capsys.readouterr().out
