"""The planner comparison (`locus plan evaluate`): plan on the first half of a trace's requests, replay
the second half, for round_robin, eplb and locality, and write the results as JSON and Markdown.

Rows per case (same replayed requests, same replay, docs/design.md's metrics; every row routes by the
evaluation's dispatch rule except EPLB's, which route by `position`, the rule EPLB is made for):
  round_robin                      balanced assignment
  eplb [policy]                    balanced assignment (DeepSeek-V3 also with the hierarchical policy)
  eplb, node-aware rule            under the node-aware rule, the same EPLB plan also routed by it
  locality placement only          the locality plan, balanced assignment
  locality placement + grouper     the locality plan, requests admitted by the plan's grouper as a live
                                   expert-parallel server admits them: `locus replay --assign grouper`
                                   with its default arrivals (grouping/live.py's simulate_live)
Every row also carries its in-sample figure: the same planner planned on the replayed half itself, so a
reader sees how much of the gap is forecasting and how much is structure.
The reduction column compares with the eplb row that sends the fewest inter-node bytes.
Every locality plan is made under the evaluation's expert cap: a number, `auto[:FLOOR]` or
`eplb[:SHARE]` (`locus plan --expert-cap`, layer_caps.py; `eplb` is the balance-first cap for plans a live
server admits by), parsed once where it enters (cli.py) and passed here as its parts.

The grouper row is the live admission, not the planner's own offline view of it (every request admitted
in trace order, none finishing, no stream cap: grouping/simulation.py), because the offline view credits
the grouper with savings a server does not make (docs/planner.md, "Replaying with the grouper").

With a hardware profile (`--hardware`) every row is replayed in the decode step order (the same whole-
replay figures) and also carries the predicted TPOT p50 / p99 of replay/step_time.py; the in-sample
figures stay bytes only. A last row is then the step-time objective's plan (`locus plan --hardware`,
step_objective.py: the candidate with the lowest predicted TPOT, its label in brackets), planned on the
same half and replayed the same way; it has no in-sample figure.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from locus.files import write_text_atomic
from locus.routing.dispatch_rule import DEFAULT_RULE, PLANNER_RULES
from locus.routing.replay.assignment import assign_balanced
from locus.routing.replay.hardware import HardwareProfile
from locus.routing.replay.model_shape import load_model_shape
from locus.routing.replay.report import json_safe
from locus.routing.plan.caps import Caps
from locus.routing.grouping.live import describe_arrivals, simulate_live
from locus.routing.planners.layer_caps import parse_expert_cap_mode
from locus.routing.planners.planner import PlanOptions, make_plan
from locus.routing.planners.step_objective import StepObjective, plan_for_step_time
from locus.routing.replay.simulator import parse_request_range, replay
from locus.routing.plan.topology import parse_topology

Log = Callable[[str], None]
STEP_ROW = "step-time objective"


@dataclass(frozen=True)
class EvalCase:
    name: str
    trace: str
    topology: str  # "NxG"
    slots: int
    expert_groups: int | None = None  # also run hierarchical eplb with this many groups
    source: str = ""  # how the trace was made (synthetic knobs, recorder)


@dataclass
class EvalRow:
    case: str
    variant: str
    inter_node_bytes_per_token: float
    reduction_vs_eplb: float  # 1 - bytes / best eplb bytes
    locality: float
    expert_imbalance_mean: float
    expert_imbalance_worst: float
    attention_imbalance: float
    plan_seconds: float
    in_sample_bytes_per_token: float = 0.0  # the same planner planned on the replayed requests themselves
    in_sample_reduction_vs_eplb: float = 0.0  # against in-sample eplb
    predicted_tpot_ms: float | None = None  # with a hardware profile: the step-time model's TPOT p50
    predicted_tpot_p99_ms: float | None = None


@dataclass
class CaseResult:
    case: EvalCase
    requests: int
    tokens: int
    plan_range: tuple[int, int]
    replay_range: tuple[int, int]
    rows: list[EvalRow] = field(default_factory=list)
    planning_summary: dict = field(default_factory=dict)
    arrivals: str = ""  # how the grouper row's requests arrived: live.ARRIVALS, `locus replay`'s default


@dataclass(frozen=True)
class TpotModel:
    """What the predicted-TPOT column replays with: a hardware profile, the model's shape (None: the
    trace's model name) and the requests in flight of the decode step order."""

    hardware: HardwareProfile
    model_shape: str | None = None
    concurrency: int = 16


def evaluate_case(case: EvalCase, caps: Caps, seed: int = 0, batch_tokens: int = 4096, log: Log = print,
                  dispatch: str | None = None, replica_budget: str = "top", load_model: str | None = None,
                  tpot: TpotModel | None = None, expert_cap_auto: bool = False,
                  expert_cap_eplb_share: float | None = None) -> CaseResult:
    """Every row routes by `dispatch` (default dispatch_rule.DEFAULT_RULE) but EPLB's, which route by their
    own rule (`position`) and, where `dispatch` differs, once more by `dispatch`. With `tpot`, every row
    also carries its predicted TPOT. `expert_cap_auto` / `expert_cap_eplb_share`: the expert cap's mode
    (layer_caps.parse_expert_cap_mode's second and third parts), as `locus plan` takes them."""
    from locus.traces.reader import TraceReader

    reader = TraceReader(case.trace)
    meta = reader.meta
    steps = {}
    if tpot is not None:
        shape = load_model_shape(tpot.model_shape or meta.model)
        shape.check_trace(meta)
        steps = dict(step_order="decode", concurrency=tpot.concurrency, hardware=tpot.hardware, model_shape=shape)
    R = len(reader.requests)
    plan_range, replay_range = parse_request_range("0:0.5", R), parse_request_range("0.5:1", R)
    topology = parse_topology(case.topology, meta.num_experts, case.slots)
    tokens = [r.tokens for r in reader.requests[replay_range[0] : replay_range[1]]]
    balanced = assign_balanced(tokens, topology.ranks, request_start=replay_range[0])
    result = CaseResult(case, R, reader.num_tokens, plan_range, replay_range)

    options = PlanOptions(caps=caps, seed=seed, dispatch=dispatch, replica_budget=replica_budget,
                          load_model=load_model, expert_cap_auto=expert_cap_auto,
                          expert_cap_eplb_share=expert_cap_eplb_share)
    reports, result.planning_summary, result.arrivals = _replays(reader, case, topology, plan_range, replay_range,
                                                                 balanced, options, batch_tokens, log, steps)
    # The honest ceiling: the same plans made on the replayed requests themselves (in-sample).
    ceiling, _, _ = _replays(reader, case, topology, replay_range, replay_range, balanced, options, batch_tokens,
                          lambda text: log(text + " (in-sample)"))

    def best_eplb(rows) -> float:
        return min(r.inter_node_bytes_per_token for label, r, _ in rows if label.startswith("eplb"))

    eplb_best, eplb_in = best_eplb(reports), best_eplb(ceiling)
    in_sample = {label: r for label, r, _ in ceiling}
    for label, r, seconds in reports:
        r_in = in_sample.get(label)  # the step-time objective's row has none (module docstring)
        in_bytes = r_in.inter_node_bytes_per_token if r_in is not None else math.nan
        result.rows.append(EvalRow(
            case=case.name, variant=label, inter_node_bytes_per_token=r.inter_node_bytes_per_token,
            reduction_vs_eplb=1 - r.inter_node_bytes_per_token / eplb_best, locality=r.locality,
            expert_imbalance_mean=r.expert_imbalance_mean, expert_imbalance_worst=r.expert_imbalance_worst,
            attention_imbalance=r.attention_imbalance, plan_seconds=seconds,
            in_sample_bytes_per_token=in_bytes, in_sample_reduction_vs_eplb=1 - in_bytes / eplb_in,
            predicted_tpot_ms=r.step_time["tpot_p50_ms"] if r.step_time else None,
            predicted_tpot_p99_ms=r.step_time["tpot_p99_ms"] if r.step_time else None,
        ))
    return result


def _replays(reader, case: EvalCase, topology, plan_range, replay_range, balanced, options: PlanOptions,
             batch_tokens: int, log: Log, steps: dict | None = None) -> tuple[list[tuple[str, object, float]], dict, str]:
    """(label, replay report, plan seconds) of every row, planned on plan_range, replayed on replay_range
    (with `steps`, replay's step-time arguments, each also predicting its TPOT); the locality plan's
    planning summary; the grouper row's arrival model."""
    steps = steps or {}
    variants = [("round_robin", "round_robin", None), ("eplb", "eplb", None)]
    if case.expert_groups:
        variants.append((f"eplb (hierarchical, {case.expert_groups} groups)", "eplb", case.expert_groups))
    rule = options.dispatch or DEFAULT_RULE
    reports = []
    for label, name, groups in variants:
        # EPLB's rows route by EPLB's own rule whatever the evaluation's (planner_rule), so the table reads the same
        # with --dispatch given or not
        planned = make_plan(name, reader, topology, plan_range,
                            dataclasses.replace(options, expert_groups=groups,
                                                dispatch=None if name == "eplb" else options.dispatch),
                            trace=case.trace)
        report = replay(reader, planned.plan, topology, balanced, batch_tokens=batch_tokens, **steps)
        reports.append((label, report, planned.summary.plan_seconds))
        log(f"  {case.name}: {label}: {report.inter_node_bytes_per_token:,.0f} B/token")
        if label == "eplb" and planned.plan.dispatch != rule:
            # the same plan under the other rows' rule: the like-for-like byte comparison
            planned.plan.dispatch = rule
            report = replay(reader, planned.plan, topology, balanced, batch_tokens=batch_tokens, **steps)
            reports.append((f"eplb, {rule} rule", report, planned.summary.plan_seconds))
            log(f"  {case.name}: eplb, {rule} rule: {report.inter_node_bytes_per_token:,.0f} B/token")

    planned = make_plan("locality", reader, topology, plan_range, options, trace=case.trace)
    report = replay(reader, planned.plan, topology, balanced, batch_tokens=batch_tokens, **steps)
    reports.append(("locality placement only (balanced assignment)", report, planned.summary.plan_seconds))
    log(f"  {case.name}: locality, balanced: {report.inter_node_bytes_per_token:,.0f} B/token")
    live = simulate_live(planned.plan, reader, *replay_range)  # `locus replay --assign grouper`'s defaults
    report = replay(reader, planned.plan, topology, live.assignment, batch_tokens=batch_tokens, **steps)
    reports.append(("locality placement + grouper", report, planned.summary.plan_seconds))
    log(f"  {case.name}: locality + grouper (live admission, {describe_arrivals(live.arrivals)}): "
        f"{report.inter_node_bytes_per_token:,.0f} B/token")
    if steps.get("hardware") is not None:
        reports.append(_step_time_row(reader, case, topology, plan_range, replay_range, balanced, options,
                                      batch_tokens, log, steps))
    return reports, planned.summary.to_dict(), live.arrivals


def _step_time_row(reader, case: EvalCase, topology, plan_range, replay_range, balanced, options: PlanOptions,
                   batch_tokens: int, log: Log, steps: dict) -> tuple[str, object, float]:
    """The step-time objective's plan (step_objective.py) on the same planning half, scored at the
    evaluation's requests in flight, replayed as the other rows: its grouper admitting live where it
    kept a grouping, else balanced assignment."""
    objective = StepObjective(steps["hardware"], steps["model_shape"], steps["concurrency"])
    t0 = time.perf_counter()
    stepped = plan_for_step_time(reader, topology, plan_range, options, objective, trace=case.trace)
    seconds = time.perf_counter() - t0
    plan = stepped.result.plan
    assignment = simulate_live(plan, reader, *replay_range).assignment if plan.grouping else balanced
    report = replay(reader, plan, topology, assignment, batch_tokens=batch_tokens, **steps)
    log(f"  {case.name}: step-time objective ({stepped.chosen}): {report.inter_node_bytes_per_token:,.0f} B/token")
    return (f"{STEP_ROW} ({stepped.chosen})", report, seconds)


def format_markdown(results: list[CaseResult], settings: dict) -> str:
    lines = ["# Planner evaluation (`locus plan evaluate`)", ""]
    lines.append(f"Plan on the first half of each trace's requests, replay the second half. Expert-load cap "
                 f"{cap_note(settings)}, attention cap {settings['caps']['attention']:.2f}, seed "
                 f"{settings['seed']}, replay steps of {settings['batch_tokens']} tokens, {rule_note(settings)}. "
                 "Imbalances are whole-replay "
                 f"max/mean over ranks; the reduction is against the eplb row with the fewest inter-node bytes. "
                 "In-sample: the same planner planned on the replayed half itself and replayed there (what a perfect "
                 "forecast gives this heuristic under the same caps; not a result, and not a bound: docs/traces.md).")
    if "hardware" in settings:
        lines.append("")
        lines.append(tpot_note(settings))
    lines.append("")
    for res in results:
        c = res.case
        lines.append(f"## {c.name}: {c.topology}, {c.slots} slots/GPU")
        lines.append("")
        lines.append(f"Trace `{c.trace}` ({c.source}): {res.requests:,} requests, {res.tokens:,} tokens; planned on "
                     f"{res.plan_range[0]}:{res.plan_range[1]}, replayed {res.replay_range[0]}:{res.replay_range[1]}. "
                     f"The grouper row: {grouper_note([res])}.")
        lines.append("")
        tpot = "hardware" in settings
        lines.append("| plan | inter-node B/token | vs eplb | locality | expert imb. mean / worst | attention imb. "
                     "| plan s | in-sample B/token (vs eplb) |" + (" predicted TPOT p50 / p99 |" if tpot else ""))
        lines.append("|---|---|---|---|---|---|---|---|" + ("---|" if tpot else ""))
        for r in res.rows:
            lines.append(
                f"| {r.variant} | {r.inter_node_bytes_per_token:,.0f} | {_pct(-r.reduction_vs_eplb)} | "
                f"{100 * r.locality:.1f} % | {r.expert_imbalance_mean:.3f} / {r.expert_imbalance_worst:.3f} | "
                f"{r.attention_imbalance:.3f} | {r.plan_seconds:.1f} | {_in_sample_text(r)} |" + (f" {tpot_text(r)} |" if tpot else ""))
        lines.append("")
    return "\n".join(lines) + "\n"


def grouper_note(results: list[CaseResult]) -> str:
    """What the grouper rows of `results` are, for the tables' headers: the live admission, and the
    arrivals `locus replay --assign grouper` defaults to for each case's trace."""
    arrivals = sorted({r.arrivals for r in results})
    models = "; ".join(describe_arrivals(a) + (f" ({', '.join(r.case.name for r in results if r.arrivals == a)})"
                                               if len(arrivals) > 1 else "") for a in arrivals)
    return (f"the plan's grouper admitting requests as a live expert-parallel server does (`locus replay --assign "
            f"grouper`, no moves after prefill), {models}")


def cap_note(settings: dict) -> str:
    """The locality plans' expert cap, for the tables' headers: the number, or the mode as given
    (settings["expert_cap"], absent from results written before the modes were taken)."""
    text = settings.get("expert_cap")
    cap, auto, share = parse_expert_cap_mode(text) if text is not None else (settings["caps"]["expert"], False, None)
    if share is not None:
        return (f"`{text}` (each layer searched at 1 + {share:g} x (EPLB's figure there - 1), at most {cap:.2f}; "
                "one the search misses placed at the better of its own figure and EPLB's)")
    if auto:
        return f"`{text}` (each layer at the tightest cap the search meets, at least {cap:.2f}, at most EPLB's figure)"
    return f"{cap:.2f}"


def tpot_note(settings: dict) -> str:
    """What the predicted-TPOT column is, for the tables' headers."""
    link = f" with its inter-node link at {settings['inter_gbps']:g} GB/s" if settings.get("inter_gbps") else ""
    return (f"Predicted TPOT: the step-time model (docs/replay.md, \"Predicted step time\") on `{settings['hardware']}`{link}, "
            f"each row replayed in the decode step order with {settings['concurrency']} requests in flight; p50 / p99 "
            "over the decoding steps, in ms.")


def tpot_text(row: EvalRow) -> str:
    if row.predicted_tpot_ms is None:
        return "-"
    return f"{row.predicted_tpot_ms:.2f} / {row.predicted_tpot_p99_ms:.2f}"


def rule_note(settings: dict) -> str:
    """Which dispatch rule the rows route by, for the tables' headers."""
    rule, own = settings.get("dispatch", DEFAULT_RULE), PLANNER_RULES["eplb"]
    if rule == own:
        return f"dispatch rule `{rule}` for every row"
    return (f"dispatch rule `{rule}` for every row but EPLB's, which route by `{own}`, the rule EPLB is made for "
            f"(`eplb, {rule} rule`: the same EPLB plan routed by `{rule}`)")


def write_results(results: list[CaseResult], settings: dict, out_dir: str | Path) -> list[Path]:
    """results.json (every row, the settings, the machine) and results.md, each written atomically."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    doc = {
        "settings": settings,
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "numpy": np.__version__},
        "cases": [
            {"case": asdict(r.case), "requests": r.requests, "tokens": r.tokens, "plan_range": list(r.plan_range),
             "replay_range": list(r.replay_range), "planning_summary": r.planning_summary,
             "rows": [_row_dict(x) for x in r.rows]}
            for r in results
        ],
    }
    paths = [out_dir / "results.json", out_dir / "results.md"]
    write_text_atomic(paths[0], json.dumps(json_safe(doc), indent=1) + "\n")
    write_text_atomic(paths[1], format_markdown(results, settings))
    return paths


def _row_dict(row: EvalRow) -> dict:
    """A row as JSON; the predicted TPOT only where the evaluation predicted it."""
    doc = asdict(row)
    if row.predicted_tpot_ms is None:
        del doc["predicted_tpot_ms"], doc["predicted_tpot_p99_ms"]
    return doc


def _in_sample_text(row: EvalRow) -> str:
    if math.isnan(row.in_sample_bytes_per_token):
        return "-"
    return f"{row.in_sample_bytes_per_token:,.0f} ({_pct(-row.in_sample_reduction_vs_eplb)})"


def _pct(x: float) -> str:
    return f"{100 * x:+.1f} %"

