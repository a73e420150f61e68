"""`locus replay` end to end on a small random trace, and its one-line errors."""

import json

import numpy as np
import pytest

from locus.cli import main
from locus.traces.format import TraceMeta
from locus.traces.writer import TraceWriter


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("replay") / "trace"
    rng = np.random.default_rng(0)
    meta = TraceMeta("toy", 16, 2, (1, 3), hidden_size=64, dtype_bytes=2)
    with TraceWriter(path, meta) as writer:
        for i in range(20):
            n = int(rng.integers(3, 30))
            ids = np.sort(rng.choice(16, (n, 2, 8))[..., :2], axis=-1)  # skewed towards low ids
            ids[..., 1] = np.where(ids[..., 0] == ids[..., 1], (ids[..., 1] + 1) % 16, ids[..., 1])
            writer.add_request(f"r{i}", "code" if i % 2 else "math", 1, ids)
    return path


def test_builtin_plan_on_one_half_replayed_on_the_other(trace, tmp_path, capsys):
    out, plan, assign = tmp_path / "r.json", tmp_path / "plan.json", tmp_path / "a.json"
    rc = main(["replay", str(trace), "--plan", "eplb", "--topology", "2x2", "--slots", "5",
               "--plan-requests", "0:0.5", "--requests", "0.5:1.0", "--batch-tokens", "32",
               "--json", str(out), "--save-plan", str(plan), "--save-assignment", str(assign)])
    assert rc == 0
    captured = capsys.readouterr()
    assert "inter-node bytes (node-dedup)" in captured.out and "eplb on 2x2" in captured.out
    assert "overlap" not in captured.err  # planned on 0:10, replayed 10:20
    doc = json.loads(out.read_text())
    assert doc["requests"] == [10, 20] and doc["plan_requests"] == [0, 10] and doc["planner"] == "eplb"
    assert sorted(json.loads(assign.read_text())) == sorted(f"r{i}" for i in range(10, 20))

    # The saved plan and assignment replay to the very same figures.
    out2 = tmp_path / "r2.json"
    assert main(["replay", str(trace), "--plan", str(plan), "--assign", str(assign), "--requests", "10:20",
                 "--batch-tokens", "32", "--json", str(out2)]) == 0
    doc2 = json.loads(out2.read_text())
    for key in ("inter_node_bytes", "intra_node_bytes", "locality", "expert_imbalance_mean", "a2a_seconds"):
        assert doc2[key] == doc[key]


def test_planning_on_the_replayed_data_is_flagged(trace, capsys):
    assert main(["replay", str(trace), "--plan", "eplb", "--topology", "1x4", "--assign", "round_robin",
                 "--step-order", "ranks", "--batch-tokens", "64"]) == 0
    captured = capsys.readouterr()
    assert "figures on planning data are not results" in captured.err and "ranks order" in captured.out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--plan", "eplb"], "needs --topology"),
        (["--plan", "round_robin", "--topology", "2by2"], "not of the form NODESxGPUS"),
        (["--plan", "round_robin", "--topology", "2x2", "--slots", "3"], "fewer than the 16 experts"),
        (["--plan", "round_robin", "--topology", "2x2", "--requests", "5:2"], "request range"),
        (["--plan", "round_robin", "--topology", "2x2", "--batch-tokens", "0"], "--batch-tokens"),
        (["--plan", "missing.json"], "cannot read placement plan"),
        (["--plan", "round_robin", "--topology", "2x2", "--assign", "nope.json"], "cannot read assignment"),
    ],
)
def test_bad_input_is_one_line(trace, capsys, args, message):
    assert main(["replay", str(trace), *args]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("locus: error:") and message in err and "\n" not in err


def test_bad_trace_is_one_line(tmp_path, capsys):
    assert main(["replay", str(tmp_path / "absent"), "--plan", "round_robin", "--topology", "1x2"]) == 2
    assert "not a trace directory" in capsys.readouterr().err


def test_plan_file_contradicting_flags(trace, tmp_path, capsys):
    plan = tmp_path / "plan.json"
    assert main(["replay", str(trace), "--plan", "round_robin", "--topology", "2x2", "--save-plan", str(plan)]) == 0
    capsys.readouterr()
    assert main(["replay", str(trace), "--plan", str(plan), "--topology", "1x4"]) == 2
    assert "contradicts the plan's 2x2" in capsys.readouterr().err


def test_dispatch_flag_chooses_the_rule_and_the_plan_records_it(trace, tmp_path, capsys):
    """Top-2 on 4 nodes of 1 GPU, 6 slots each: EPLB's replicas sit on several nodes, so the node-aware
    rule reaches fewer remote nodes than the `position` rule, the built-in EPLB plan's own."""
    figures = {}
    for rule in ("position", "node-aware", None):
        out, plan = tmp_path / f"{rule}.json", tmp_path / f"{rule}-plan.json"
        args = ["replay", str(trace), "--plan", "eplb", "--topology", "4x1", "--slots", "6",
                "--json", str(out), "--save-plan", str(plan)] + (["--dispatch", rule] if rule else [])
        assert main(args) == 0
        doc = json.loads(out.read_text())
        figures[rule] = doc["inter_node_bytes"]
        assert doc["dispatch"] == (rule or "position")
        assert json.loads(plan.read_text())["dispatch"] == (rule or "position")
    capsys.readouterr()
    assert figures["node-aware"] < figures["position"] and figures[None] == figures["position"]
