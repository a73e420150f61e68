"""`locus plan evaluate` on a small trace: every row, results written as JSON and Markdown."""

import json

from locus.cli import main
from locus.routing.planners.planner import PlanOptions
from locus.routing.planners.step_objective import candidates
from locus.routing.plan.caps import Caps
from locus.routing.planners.eval_readme import BEGIN, END
from locus.routing.planners.evaluate import EvalCase, evaluate_case, format_markdown

from tests.routing.planners.planner_fixtures import separable_trace, synth_trace

VARIANTS = ["round_robin", "eplb", "eplb, node-aware rule", "locality placement only (balanced assignment)", "locality placement + grouper"]


def test_evaluate_case_rows(tmp_path):
    trace = separable_trace(tmp_path / "sep")
    result = evaluate_case(EvalCase("sep", str(trace), "4x2", 2), Caps(), log=lambda _: None)
    assert [r.variant for r in result.rows] == VARIANTS
    rows = {r.variant: r for r in result.rows}
    assert rows["eplb"].reduction_vs_eplb == 0.0
    grouped = rows["locality placement + grouper"]
    assert grouped.inter_node_bytes_per_token == 0.0 and grouped.reduction_vs_eplb == 1.0
    assert grouped.attention_imbalance <= 1.10
    # in-sample ceiling: the separable trace keeps every pair on its node there too; eplb's own figure differs
    assert grouped.in_sample_bytes_per_token == 0.0 and grouped.in_sample_reduction_vs_eplb == 1.0
    assert rows["eplb"].in_sample_bytes_per_token > 0 and rows["eplb"].in_sample_reduction_vs_eplb == 0.0
    text = format_markdown([result], {"caps": Caps().to_dict(), "seed": 0, "batch_tokens": 4096})
    assert "| locality placement + grouper | 0 | -100.0 % |" in text and "| 0 (-100.0 %) |" in text


def test_evaluate_command_writes_json_and_markdown(tmp_path, capsys):
    trace = synth_trace(tmp_path / "t", requests=100, seed=2)
    out = tmp_path / "results"
    assert main(["plan", "evaluate", "--cases", "none", "--trace", f"toy={trace},2x2,10", "--out", str(out)]) == 0
    doc = json.loads((out / "results.json").read_text())
    (case,) = doc["cases"]
    assert [r["variant"] for r in case["rows"]] == VARIANTS
    assert case["plan_range"] == [0, 50] and case["replay_range"] == [50, 100]
    assert "## toy: 2x2, 10 slots/GPU" in (out / "results.md").read_text()
    assert sorted(p.name for p in out.iterdir()) == ["results.json", "results.md"]
    assert "locality placement + grouper" in capsys.readouterr().out


def test_the_grouper_row_is_what_locus_replay_assign_grouper_reports(tmp_path, capsys):
    """One figure for the grouper: the row is the live admission `locus replay --assign grouper` runs with
    its default arrivals (a closed-loop client on a trace without recorded admissions), on the plan
    `locus plan` makes from the same half with the same defaults."""
    trace = synth_trace(tmp_path / "t", requests=120, seed=3)
    result = evaluate_case(EvalCase("toy", str(trace), "2x2", 10), Caps(), log=lambda _: None)
    grouped = {r.variant: r for r in result.rows}["locality placement + grouper"]
    assert result.arrivals == "closed"
    plan, report = tmp_path / "plan.json", tmp_path / "replay.json"
    assert main(["plan", str(trace), "--topology", "2x2", "--slots", "10", "--requests", "0:0.5", "-o", str(plan)]) == 0
    assert main(["replay", str(trace), "--plan", str(plan), "--assign", "grouper", "--requests", "0.5:1",
                 "--json", str(report)]) == 0
    replayed = json.loads(report.read_text())
    assert grouped.inter_node_bytes_per_token == replayed["inter_node_bytes_per_token"]
    assert grouped.attention_imbalance == replayed["attention_imbalance"]
    assert "closed loop, 16 in flight" in capsys.readouterr().err  # what `locus replay` said it ran
    text = format_markdown([result], {"caps": Caps().to_dict(), "seed": 0, "batch_tokens": 4096})
    assert "live expert-parallel server" in text and "closed-loop client of 16 requests in flight" in text


def test_evaluate_rejects_unknown_presets_and_bad_trace_specs(tmp_path, capsys):
    assert main(["plan", "evaluate", "--cases", "gpt-5", "--out", str(tmp_path / "r")]) == 2
    assert "unknown synthetic preset 'gpt-5'" in capsys.readouterr().err
    assert main(["plan", "evaluate", "--cases", "none", "--trace", "x=/nope", "--out", str(tmp_path / "r")]) == 2
    assert "is not NAME=DIR,NODESxGPUS,SLOTS" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()


def test_evaluate_rewrites_the_readme_table_between_its_markers(tmp_path, capsys):
    from locus.routing.planners.eval_readme import BEGIN, END

    trace = separable_trace(tmp_path / "sep")
    readme = tmp_path / "README.md"
    readme.write_text(f"# Title\n\nbefore\n{BEGIN}\nold table\n{END}\nafter\n")
    args = ["plan", "evaluate", "--cases", "none", "--trace", f"sep={trace},4x2,2", "--out", str(tmp_path / "r")]
    assert main(args + ["--readme", str(readme)]) == 0
    text = readme.read_text()
    assert text.startswith("# Title\n\nbefore\n") and text.endswith(f"{END}\nafter\n") and "old table" not in text
    assert "| sep, 4x2, 2 slots/GPU | round_robin |" in text and "| locality placement + grouper | 0 | **-100.0%** |" in text
    bare = tmp_path / "bare.md"
    bare.write_text("no markers\n")
    assert main(args + ["--readme", str(bare), "--out", str(tmp_path / "r2")]) != 0
    assert "plan-eval:begin" in capsys.readouterr().err and not (tmp_path / "r2").exists()


def test_evaluate_with_hardware_adds_the_predicted_tpot(tmp_path, capsys):
    """--hardware: every row also carries the step-time model's TPOT, which is `locus replay --step-order
    decode --hardware` of that row's plan and assignment; the byte columns stay what they were."""
    trace = synth_trace(tmp_path / "t", requests=60, seed=4)
    shape = tmp_path / "toy.json"
    shape.write_text(json.dumps({"source": "test", "hidden_size": 64, "moe_intermediate_size": 128,
                                 "num_hidden_layers": 6, "num_moe_layers": 3, "num_experts": 32, "top_k": 2,
                                 "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                                 "dense_intermediate_size": 256, "shared_intermediate_size": 0, "vocab_size": 512}))
    plain, out = tmp_path / "plain", tmp_path / "hw"
    base = ["plan", "evaluate", "--cases", "none", "--trace", f"toy={trace},2x2,10"]
    assert main([*base, "--out", str(plain)]) == 0
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n{BEGIN}\n{END}\n")
    assert main([*base, "--out", str(out), "--hardware", "h200-ib400", "--model-shape", str(shape),
                 "--concurrency", "8", "--readme", str(readme)]) == 0
    assert "| Predicted TPOT |" in readme.read_text() and "8 requests in flight" in readme.read_text()
    rows = json.loads((out / "results.json").read_text())["cases"][0]["rows"]
    plain_rows = json.loads((plain / "results.json").read_text())["cases"][0]["rows"]
    assert all("predicted_tpot_ms" not in r for r in plain_rows)
    for r, p in zip(rows, plain_rows):
        assert 0 < r["predicted_tpot_ms"] <= r["predicted_tpot_p99_ms"]
        assert r["inter_node_bytes_per_token"] == p["inter_node_bytes_per_token"]
    # and a last row, the step-time objective's plan (step_objective.py), which has no in-sample figure
    step = [r for r in rows if r["variant"].startswith("step-time objective (")]
    assert len(step) == 1 and rows[-1] is step[0] and step[0]["in_sample_bytes_per_token"] is None
    labels = [c.label for c in candidates(PlanOptions())]
    assert step[0]["variant"] in [f"step-time objective ({label})" for label in labels]
    assert not any(r["variant"].startswith("step-time") for r in plain_rows)
    assert "| step-time objective (" in readme.read_text()
    text = (out / "results.md").read_text()
    assert "predicted TPOT p50 / p99 |" in text and "on `h200-ib400`" in text
    assert "predicted TPOT" not in (plain / "results.md").read_text()
    # the eplb row is the replay of EPLB's plan, balanced, in the decode order
    plan, report = tmp_path / "eplb.json", tmp_path / "r.json"
    assert main(["plan", str(trace), "--topology", "2x2", "--slots", "10", "--planner", "eplb", "--requests", "0:0.5",
                 "-o", str(plan)]) == 0
    assert main(["replay", str(trace), "--plan", str(plan), "--requests", "0.5:1", "--step-order", "decode",
                 "--concurrency", "8", "--hardware", "h200-ib400", "--model-shape", str(shape),
                 "--json", str(report)]) == 0
    eplb = next(r for r in rows if r["variant"] == "eplb")
    assert eplb["predicted_tpot_ms"] == json.loads(report.read_text())["step_time"]["tpot_p50_ms"]
    capsys.readouterr()
    assert main([*base, "--out", str(out), "--concurrency", "8"]) == 2
    assert "--concurrency applies to the predicted TPOT: add --hardware PROFILE" in capsys.readouterr().err


def test_evaluate_plans_the_locality_rows_under_the_eplb_expert_cap(tmp_path, capsys):
    """--expert-cap eplb (layer_caps' mode, as `locus plan` takes it): the locality rows are the plan
    `locus plan --expert-cap eplb` makes from the same half, not the fixed-cap one, and the tables say so."""
    trace = synth_trace(tmp_path / "t", requests=200, seed=3, layers=tuple(range(12)))  # test_layer_caps' skewed case
    base = ["plan", "evaluate", "--cases", "none", "--trace", f"skew={trace},2x2,9"]
    assert main([*base, "--out", str(tmp_path / "fixed")]) == 0
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n{BEGIN}\n{END}\n")
    assert main([*base, "--expert-cap", "eplb", "--out", str(tmp_path / "eplb"), "--readme", str(readme)]) == 0
    doc = json.loads((tmp_path / "eplb" / "results.json").read_text())
    assert doc["settings"]["expert_cap"] == "eplb" and doc["settings"]["caps"]["expert"] == 1.10
    rows = {r["variant"]: r for r in doc["cases"][0]["rows"]}
    fixed = {r["variant"]: r for r in json.loads((tmp_path / "fixed" / "results.json").read_text())["cases"][0]["rows"]}
    placed = "locality placement only (balanced assignment)"
    plan, report = tmp_path / "plan.json", tmp_path / "replay.json"
    assert main(["plan", str(trace), "--topology", "2x2", "--slots", "9", "--requests", "0:0.5", "--expert-cap", "eplb",
                 "-o", str(plan)]) == 0
    assert main(["replay", str(trace), "--plan", str(plan), "--assign", "grouper", "--requests", "0.5:1",
                 "--json", str(report)]) == 0
    grouped = rows["locality placement + grouper"]
    assert grouped["inter_node_bytes_per_token"] == json.loads(report.read_text())["inter_node_bytes_per_token"]
    assert rows[placed]["expert_imbalance_mean"] != fixed[placed]["expert_imbalance_mean"]  # another placement
    same = ("inter_node_bytes_per_token", "expert_imbalance_mean", "attention_imbalance")
    assert [rows["eplb"][k] for k in same] == [fixed["eplb"][k] for k in same]  # EPLB takes no cap
    assert "Expert-load cap `eplb` (each layer searched at 1 + 0.5 x" in (tmp_path / "eplb" / "results.md").read_text()
    assert "expert-load cap `eplb` (each layer searched" in " ".join(readme.read_text().split())
    assert "Expert-load cap 1.10," in (tmp_path / "fixed" / "results.md").read_text()


def test_a_bad_expert_cap_mode_stops_evaluate_before_any_work(tmp_path, capsys):
    args = ["plan", "evaluate", "--cases", "none", "--trace", f"x={tmp_path},2x2,3", "--out", str(tmp_path / "r")]
    assert main([*args, "--expert-cap", "eplb:2"]) == 2
    assert "--expert-cap 'eplb:2': the share of EPLB's slack must be in [0, 1]" in capsys.readouterr().err
    assert main([*args, "--expert-cap", "tight"]) == 2
    assert "--expert-cap must be a number or auto[:FLOOR] or eplb[:SHARE], not 'tight'" in capsys.readouterr().err
    assert not (tmp_path / "r").exists()
