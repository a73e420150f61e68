"""`locus plan sweep`: eplb and locality per slot count, as a table, JSON and a plot."""

import json

import pytest

from locus.cli import main
from locus.routing.planners.sweep import parse_slot_range

from tests.routing.planners.planner_fixtures import synth_trace


def test_slot_ranges():
    assert parse_slot_range("2:4") == [2, 3, 4]
    assert parse_slot_range("9,5,5") == [5, 9]
    for bad in ("x", "0:2", "3:2"):
        with pytest.raises(Exception, match="--slots"):
            parse_slot_range(bad)


def test_sweep_command_rows_skips_and_files(tmp_path, capsys):
    trace = synth_trace(tmp_path / "t", requests=80, seed=1, experts=16)
    out = tmp_path / "sweep"
    # 2x2 ranks: 3 slots hold 12 < 16 experts; 4 hold each once, too few to meet the cap; 5 and 8 leave
    # 4 and 16 replicas
    assert main(["plan", "sweep", str(trace), "--topology", "2x2", "--slots", "3,4,5,8",
                 "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert "skipped 3 slots/GPU: too few" in captured.err and "skipped 4 slots/GPU: MoE layer" in captured.err
    doc = json.loads((out / "sweep.json").read_text())
    rows = [(r["slots"], r["planner"]) for r in doc["rows"]]
    assert rows == [(5, "eplb"), (5, "locality"), (8, "eplb"), (8, "locality")]
    by = {(r["slots"], r["planner"]): r for r in doc["rows"]}
    assert by[(5, "eplb")]["reduction_vs_eplb"] == 0.0
    # more spare slots let the locality plan replicate more: fewer bytes
    assert by[(8, "locality")]["inter_node_bytes_per_token"] < by[(5, "locality")]["inter_node_bytes_per_token"]
    assert "| 8 | locality |" in captured.out and (out / "sweep.md").exists()
    pytest.importorskip("matplotlib")
    assert (out / "sweep.png").read_bytes()[:4] == b"\x89PNG"


def test_sweep_under_auto_and_eplb_plans_every_slot_count_that_holds_the_experts(tmp_path, capsys):
    trace = synth_trace(tmp_path / "t", requests=80, seed=1, experts=16)
    for mode in ("auto", "eplb:0.5"):
        out = tmp_path / mode.replace(":", "_")
        # 4 slots on 2x2 hold each expert once: the fixed 1.10 cannot be met there (test above), these modes plan it
        assert main(["plan", "sweep", str(trace), "--topology", "2x2", "--slots", "3,4,5", "--expert-cap", mode,
                     "--out", str(out)]) == 0
        captured = capsys.readouterr()
        assert "skipped 3 slots/GPU: too few" in captured.err and "skipped 4" not in captured.err
        doc = json.loads((out / "sweep.json").read_text())
        assert [(r["slots"], r["planner"]) for r in doc["rows"]] == [(4, "eplb"), (4, "locality"), (5, "eplb"),
                                                                     (5, "locality")]
        assert doc["settings"]["expert_cap"] == mode and f"expert cap {mode}" in captured.out
    assert main(["plan", "sweep", str(trace), "--topology", "2x2", "--expert-cap", "lots", "--out", str(tmp_path / "x")]) != 0
    assert "--expert-cap must be a number or auto[:FLOOR] or eplb[:SHARE], not 'lots'" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()  # refused before any work
