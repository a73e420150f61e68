"""The grouper as the live server runs it, on a recorded trace: tagged against untagged requests, the
prompt predictor's accuracy, and where the replay's old grouper gain goes live (issue 46).

Per case (topology, slots): plan eplb and locality on the first half of the trace's requests (with
their domain tags; the locality plan learns its prompt predictor from the same rows' token ids),
replay the second half:

  eplb / locality placement only   balanced assignment (the baselines)
  offline grouper                  the replay's grouper before issue 46: every request admitted in trace
                                   order, none finishing, no stream cap, moves after prefill
  live, ...                        the live admission (locus/routing/grouping/live.py): stream cap,
                                   attention cap, a closed-loop client of --concurrency requests;
                                   tagged, untagged by the prompt predictor, untagged least loaded, and
                                   each with moves after prefill (KV migration bytes counted)
  ablation                         from the offline grouper to the live one, one change at a time

and the predictor candidates' accuracy on the replayed requests (predicted against measured node cost,
locus/routing/grouping/accuracy.py): the token table (at a few sizes), a router probe (the prompt's
routing at the first MoE layer, what running the layers up to the first router would give), the domain
classifier (the classified domain's mean decode signature on the planning half; what placing the
request as that domain's tag would cost), the true tag (a perfect classifier), and the prefill
signature itself (known only after prefill: the move's input).

    python bench/grouper_live.py --trace results/tmp/mini_trace450/mini --cases 2x2:3,4x2:2 \\
        --out results/grouper_live_mini
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from locus.routing.grouping.accuracy import node_cost_accuracy  # noqa: E402
from locus.routing.grouping.grouper import Grouper  # noqa: E402
from locus.routing.grouping.live import live_grouper, simulate_live  # noqa: E402
from locus.routing.plan.predictor import TokenAffinity  # noqa: E402
from locus.routing.grouping.simulation import simulate_grouper  # noqa: E402
from locus.routing.plan.grouping_spec import spec_of  # noqa: E402
from locus.routing.plan.topology import parse_topology  # noqa: E402
from locus.routing.planners.planner import make_plan  # noqa: E402
from locus.routing.grouping.signatures import collect_signatures  # noqa: E402
from locus.routing.replay.assignment import assign_balanced  # noqa: E402
from locus.routing.replay.simulator import parse_request_range, replay  # noqa: E402
from locus.traces.reader import TraceReader  # noqa: E402


def untagged_reader(reader: TraceReader) -> TraceReader:
    """The same trace with every domain tag withheld (what the planner sees of untagged traffic)."""
    blind = copy.copy(reader)
    blind.requests = [dataclasses.replace(r, domain="") for r in reader.requests]
    return blind


def row(name: str, report, eplb: float) -> dict:
    kv = report.migrated_kv_bytes_per_token
    return {"row": name, "inter_per_token": report.inter_node_bytes_per_token,
            "vs_eplb": report.inter_node_bytes_per_token / eplb - 1,
            "kv_migration_per_token": kv, "vs_eplb_incl_migration": (report.inter_node_bytes_per_token + kv) / eplb - 1,
            "migrations": report.migrations, "attention_imbalance": report.attention_imbalance,
            "expert_imbalance_mean": report.expert_imbalance_mean, "expert_imbalance_worst": report.expert_imbalance_worst}


def accuracy_rows(plan, planning: tuple[int, int], replayed: tuple[int, int], reader: TraceReader) -> list[dict]:
    """Every candidate's predicted node cost of the replayed requests against their measured one."""
    meta = reader.meta
    spec = spec_of(plan)
    grouper = live_grouper(plan, moe_layers=meta.moe_layers)
    cost = grouper.cost
    exact = dataclasses.replace(cost, prior_tokens=0.0)
    sig = collect_signatures(reader, *replayed)
    prefill, decode = np.asarray(sig.prefill), np.asarray(sig.decode)  # dense float32 [R, L, E]
    measured = exact.expected_bytes(decode)  # [R, N]
    lo, hi = replayed
    prompts = [np.asarray(reader.token_ids[int(reader.offsets[i]): int(reader.offsets[i]) + reader.requests[i].prompt_tokens])
               for i in range(lo, hi)]
    out = []

    def add(name: str, predicted: np.ndarray, note: str, seconds: float | None = None) -> None:
        acc = node_cost_accuracy(predicted, measured)
        out.append({"candidate": name, "note": note, **acc.to_dict(),
                    **({"us_per_prompt": 1e6 * seconds / len(prompts)} if seconds is not None else {})})

    for tokens in (spec.predictor.num_tokens, 1024, 256, 64):
        table = spec.predictor if tokens == spec.predictor.num_tokens else TokenAffinity.learn(
            reader, *planning, max_tokens=tokens, top_experts=spec.predictor.experts.shape[-1])
        t0 = time.perf_counter()
        predicted = np.stack([cost.expected_bytes(table.signature(p)) for p in prompts])
        seconds = time.perf_counter() - t0
        size = len(json.dumps(table.to_dict()))
        add(f"(a) token table, {table.num_tokens} tokens x {table.experts.shape[-1]} experts", predicted,
            f"before prefill, {size:,} bytes in the plan", seconds)
    probe = np.zeros_like(prefill)
    probe[:, 0] = prefill[:, 0]  # the first MoE layer's routing of the prompt; later layers: the prior
    add(f"(b) router probe (MoE layer {meta.moe_layers[0]})", cost.expected_bytes(probe),
        f"before prefill, runs layers 0..{meta.moe_layers[0]} of the prompt on rank 0")
    planning_sig = collect_signatures(reader, *planning)
    domains = sorted(set(planning_sig.domains))
    planning_decode = np.asarray(planning_sig.decode)
    mean = {d: planning_decode[[x == d for x in planning_sig.domains]].mean(0) for d in domains}
    prior = planning_decode.mean(0)
    by_tag = np.stack([mean.get(d, prior) for d in sig.domains])
    add("domain tag (a perfect classifier)", exact.expected_bytes(by_tag), "the tag's mean decode signature")
    if spec.predictor.domains:
        table = np.stack([cost.expected_bytes(spec.predictor.signature(p)) for p in prompts])
        guess = [spec.predictor.classify(p, confidence=0.0) for p in prompts]
        hits = float(np.mean([g == d for g, d in zip(guess, sig.domains)]))
        add("(c) domain classifier (naive Bayes)", exact.expected_bytes(np.stack([mean[g] for g in guess])),
            f"before prefill: the classified domain's mean decode signature; domain right for {100 * hits:.1f} %")
        sure = [spec.predictor.classify(p) for p in prompts]
        combined = np.stack([exact.expected_bytes(mean[g]) if g is not None else t for g, t in zip(sure, table)])
        right = float(np.mean([g == d for g, d in zip(sure, sig.domains) if g is not None]))
        add("(c) where sure, else (a): what admission uses", combined,
            f"classifier sure for {100 * np.mean([g is not None for g in sure]):.1f} % (right for {100 * right:.1f} % of them)")
    add("prefill signature", cost.expected_bytes(prefill), "after prefill: what a move decides by")
    return out


def run_case(reader: TraceReader, topology_text: str, slots: int, concurrency: int, log) -> dict:
    meta = reader.meta
    R = len(reader.requests)
    planning, replayed = parse_request_range("0:0.5", R), parse_request_range("0.5:1", R)
    lo, hi = replayed
    topology = parse_topology(topology_text, meta.num_experts, slots)
    balanced = assign_balanced([r.tokens for r in reader.requests[lo:hi]], topology.ranks, request_start=lo)
    eplb = make_plan("eplb", reader, topology, planning).plan
    locality = make_plan("locality", reader, topology, planning).plan
    blind_plan = make_plan("locality", untagged_reader(reader), topology, planning).plan

    def bytes_of(plan, assignment):
        return replay(reader, plan, topology, assignment)

    base = bytes_of(eplb, balanced)
    e = base.inter_node_bytes_per_token
    rows = [row("eplb, balanced", base, e), row("locality placement only, balanced", bytes_of(locality, balanced), e)]
    offline = simulate_grouper(Grouper.from_plan(locality, moe_layers=meta.moe_layers), reader, lo, hi)
    rows.append(row("offline grouper (the replay before issue 46), tagged", bytes_of(locality, offline), e))
    live = [("tagged", {}), ("untagged, prompt predictor", {"untagged": True}),
            ("untagged, least loaded", {"untagged": True, "predictor": "none"})]
    for moves in (False, True):
        for label, options in live:
            sim = simulate_live(locality, reader, lo, hi, "closed", concurrency, moves=moves, **options)
            rows.append(row(f"live, {label}{', moves' if moves else ''}", bytes_of(locality, sim.assignment), e))
    sim = simulate_live(blind_plan, reader, lo, hi, "closed", concurrency, untagged=True)
    rows.append(row("live, untagged, planned without tags (clusters) + predictor", bytes_of(blind_plan, sim.assignment), e))
    log(f"  {topology_text}: {len(rows)} rows")
    ablation = []
    for label, arrivals, streams, moves in (("offline: batch, no stream cap, moves", "batch", False, True),
                                            ("+ stream cap", "batch", True, True),
                                            ("+ requests finish (closed loop)", "closed", True, True),
                                            ("- moves (= live, tagged)", "closed", True, False)):
        for tags, options in (("tagged", {}), ("untagged, prompt predictor", {"untagged": True})):
            sim = simulate_live(locality, reader, lo, hi, arrivals, concurrency, moves=moves, stream_cap=streams,
                                **options)
            ablation.append(row(f"{label}; {tags}", bytes_of(locality, sim.assignment), e))
    for c in (1, 4, 64):
        for label, options in live[:2]:
            sim = simulate_live(locality, reader, lo, hi, "closed", c, **options)
            ablation.append(row(f"live, {label}, concurrency {c}", bytes_of(locality, sim.assignment), e))
    return {"topology": topology_text, "slots": slots, "planning": list(planning), "replayed": list(replayed),
            "concurrency": concurrency, "rows": rows, "ablation": ablation,
            "accuracy": accuracy_rows(locality, planning, replayed, reader)}


def print_case(case: dict) -> None:
    print(f"\n## {case['topology']}, {case['slots']} slots/GPU: planned on {case['planning'][0]}:{case['planning'][1]}, "
          f"replayed {case['replayed'][0]}:{case['replayed'][1]}, closed loop of {case['concurrency']}\n")
    head = "| assignment | inter-node B/token | vs eplb | KV migration B/token | vs eplb incl. migration | attention imb. | expert imb. mean / worst |"
    for title, rows in (("rows", case["rows"]), ("ablation", case["ablation"])):
        print(head)
        print("|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['row']} | {r['inter_per_token']:,.1f} | {100 * r['vs_eplb']:+.1f} % | {r['kv_migration_per_token']:,.1f} | "
                  f"{100 * r['vs_eplb_incl_migration']:+.1f} % | {r['attention_imbalance']:.3f} | "
                  f"{r['expert_imbalance_mean']:.3f} / {r['expert_imbalance_worst']:.3f} |")
        print()
    print("| predictor | agreement | regret B/token | blind B/token | captured | correlation | cost | note |")
    print("|---|---|---|---|---|---|---|---|")
    for a in case["accuracy"]:
        cost = f"{a['us_per_prompt']:.0f} us/prompt" if "us_per_prompt" in a else ""
        print(f"| {a['candidate']} | {100 * a['agreement']:.1f} % | {a['regret']:.1f} | {a['blind']:.1f} | "
              f"{100 * a['captured']:.1f} % | {a['correlation']:.3f} | {cost} | {a['note']} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", required=True, help="a trace with token ids (bench/mini_trace.py records one)")
    ap.add_argument("--cases", default="2x2:3,4x2:2", help="NxG:SLOTS,... (default 2x2:3,4x2:2)")
    ap.add_argument("--concurrency", type=int, default=16, help="the live rows' closed-loop client (default 16)")
    ap.add_argument("--out", help="directory for results.json")
    args = ap.parse_args(argv)
    reader = TraceReader(args.trace)
    if reader.token_ids is None:
        raise SystemExit(f"{args.trace}: no token ids; record it with this Locus (bench/mini_trace.py)")
    cases = []
    for item in args.cases.split(","):
        topology, slots = item.split(":")
        cases.append(run_case(reader, topology, int(slots), args.concurrency, lambda text: print(text, file=sys.stderr)))
        print_case(cases[-1])
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        doc = {"bench": "grouper_live", "trace": args.trace, "requests": len(reader.requests), "tokens": reader.num_tokens,
               "cases": cases}
        (out / "results.json").write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
