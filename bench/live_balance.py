"""Does the live admission keep the balance the plan was made for? (issue 54, item 3)

Per case (a trace, NODESxGPUS, slots per GPU): plan `eplb` and `locality` (once per `--expert-cap`,
default the fixed 1.10 and `eplb`, the mode for plans a live server admits by) on the first half of the
trace's requests, replay the second half:

  eplb, balanced                 EPLB's plan, balanced assignment (each request to the rank with the
                                 fewest tokens so far, knowing every request's length: the reference)
  locality placement only        the locality plan, balanced assignment
  locality, planned grouping     the locality plan, requests admitted by the planner's own grouper
                                 (every request in trace order, none finishing, no stream cap, moves
                                 after prefill: the grouping the plan's placement was made for)
  locality + grouper             the locality plan, requests admitted by its grouper as a live
                                 expert-parallel server admits them (`locus replay --assign grouper`)
                                 with N requests in flight: 16 (the replay's default client), 16 per
                                 rank (a closed-loop client), every request at once (`--arrivals batch`)

and prints inter-node bytes per token, the whole-replay attention imbalance (tokens per rank, max /
mean), the mean and worst per-step attention imbalance, the expert imbalance (mean / worst layer) and
whether the grouper's attention imbalance is within EPLB's + 0.05 and its expert imbalance at most
EPLB's (the issue's targets; the planned-grouping row shows what the live admission would reach by
following the plan's domain weights exactly). Replay steps: the trace order, 4096 tokens a step
(`locus replay`'s default). Deterministic: the same trace gives the same table.

    python bench/live_balance.py --trace mini-2x2=results/tmp/mini_trace450/mini,2x2,3 \\
        --trace mini-4x2=results/tmp/mini_trace450/mini,4x2,2 \\
        --trace maverick-8x8=results/tmp/traces/llama4-maverick-8000-seed0,8x8,3 --out results/live_balance.json

The target's expert imbalance is the mean over layers (the issue's figure); `expert_within_target` also
asks the worst layer to be at most EPLB's, and `expert_mean_within_target` the mean alone. Each judged
row also gives its expert imbalance minus EPLB's with a 95 % interval over `--draws` resamples of the
held-out requests, the same draw for both (locus/routing/replay/load_bootstrap.py): how far the verdict
would move on another held-out set of the same size.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from locus.errors import LocusError  # noqa: E402
from locus.routing.grouping.grouper import Grouper  # noqa: E402
from locus.routing.grouping.live import simulate_live  # noqa: E402
from locus.routing.grouping.simulation import run_grouper, trace_prefill_chunks  # noqa: E402
from locus.routing.plan.caps import Caps  # noqa: E402
from locus.routing.plan.placement import PlacementPlan  # noqa: E402
from locus.routing.plan.topology import Topology, parse_topology  # noqa: E402
from locus.routing.planners.layer_caps import parse_expert_cap_mode  # noqa: E402
from locus.routing.planners.planner import PlanOptions, make_plan  # noqa: E402
from locus.routing.replay.assignment import assign_balanced  # noqa: E402
from locus.routing.replay.load_bootstrap import DEFAULT_DRAWS, paired_bootstrap, request_rank_loads  # noqa: E402
from locus.routing.replay.simulator import parse_request_range, replay  # noqa: E402
from locus.traces.reader import TraceReader  # noqa: E402

ATTENTION_MARGIN = 0.05  # the target: the grouper's attention imbalance at most EPLB's + this
EXPERT_CAPS = ("1.10", "eplb")  # the locality plans compared, by `--expert-cap`


@dataclass
class Row:
    case: str
    assignment: str
    in_flight: str
    inter_node_bytes_per_token: float
    attention_imbalance: float
    step_attention_imbalance_mean: float
    step_attention_imbalance_worst: float
    expert_imbalance_mean: float
    expert_imbalance_worst: float
    attention_within_target: bool | None = None  # grouper rows: <= EPLB's + ATTENTION_MARGIN
    expert_within_target: bool | None = None  # grouper rows: mean and worst <= EPLB's
    expert_mean_within_target: bool | None = None  # grouper rows: mean over layers <= EPLB's
    expert_cap: str = "-"  # the locality plan's `--expert-cap` ("-": EPLB's row)
    # grouper rows: this row's expert imbalance (mean over layers) minus EPLB's, on the held-out requests and
    # its spread over resamples of them (load_bootstrap.paired_bootstrap: point, ci95, sd)
    expert_difference: dict | None = None


def parse_case(spec: str) -> tuple[str, str, str, int]:
    try:
        name, rest = spec.split("=", 1)
        path, topology, slots = rest.split(",")
        return name.strip(), path.strip(), topology.strip(), int(slots)
    except ValueError:
        raise LocusError(f"--trace {spec!r} is not NAME=DIR,NODESxGPUS,SLOTS (e.g. mini=results/tmp/mini,2x2,3)") from None


@dataclass
class Case:
    """A case's trace, its planning and held-out halves, and its plans (made once, for the table and the
    served sets)."""

    name: str
    reader: TraceReader
    topology: Topology
    start: int  # the held-out half: requests start..stop
    stop: int
    eplb: PlacementPlan
    locality: dict[str, PlacementPlan]  # by `--expert-cap`


def plan_case(name: str, path: str, topology_text: str, slots: int, expert_caps=EXPERT_CAPS) -> Case:
    """EPLB's plan and a locality plan per expert cap, on the first half of the trace's requests."""
    reader = TraceReader(path)
    count = len(reader.requests)
    plan_range, (start, stop) = parse_request_range("0:0.5", count), parse_request_range("0.5:1", count)
    topology = parse_topology(topology_text, reader.meta.num_experts, slots)
    eplb = make_plan("eplb", reader, topology, plan_range, PlanOptions(caps=Caps(), seed=0), trace=path).plan
    locality = {}
    for cap_text in expert_caps:
        cap, auto, share = parse_expert_cap_mode(cap_text)
        options = PlanOptions(caps=Caps(expert=cap), seed=0, expert_cap_auto=auto, expert_cap_eplb_share=share)
        locality[cap_text] = make_plan("locality", reader, topology, plan_range, options, trace=path).plan
    return Case(name, reader, topology, start, stop, eplb, locality)


def run_case(case: Case, draws: int = DEFAULT_DRAWS) -> list[Row]:
    reader, topology, start, stop = case.reader, case.topology, case.start, case.stop
    tokens = [r.tokens for r in reader.requests[start:stop]]
    balanced = assign_balanced(tokens, topology.ranks, request_start=start)

    def row(label: str, in_flight: str, plan, assignment, cap: str = "-") -> Row:
        r = replay(reader, plan, topology, assignment)
        return Row(case.name, label, in_flight, r.inter_node_bytes_per_token, r.attention_imbalance,
                   r.step_attention_imbalance_mean, r.step_attention_imbalance_worst, r.expert_imbalance_mean,
                   r.expert_imbalance_worst, expert_cap=cap)

    reference_loads = request_rank_loads(reader, case.eplb, balanced)  # [Q, L, R]

    def judged(label: str, in_flight: str, plan, assignment, cap: str) -> Row:
        r = _judged(row(label, in_flight, plan, assignment, cap), reference)
        r.expert_difference = paired_bootstrap(request_rank_loads(reader, plan, assignment), reference_loads,
                                               draws=draws).as_dict()
        return r

    reference = row("eplb, balanced", "-", case.eplb, balanced)
    rows = [reference]
    held_out = reader.requests[start:stop]
    clients = [("closed", 16, "16"), ("closed", 16 * topology.ranks, f"16 per rank ({16 * topology.ranks})"),
               ("batch", 16, f"every request ({stop - start})")]
    for cap_text, locality in case.locality.items():
        rows.append(row("locality placement only", "-", locality, balanced, cap_text))
        planned = run_grouper(Grouper.from_plan(locality, moe_layers=reader.meta.moe_layers),
                              [r.id for r in held_out], [r.domain for r in held_out], tokens,
                              [r.prompt_tokens for r in held_out], trace_prefill_chunks(reader, start, stop),
                              request_start=start)
        rows.append(judged("locality, planned grouping", f"every request ({stop - start}), offline", locality,
                           planned, cap_text))
        for arrivals, concurrency, label in clients:
            live = simulate_live(locality, reader, start, stop, arrivals=arrivals, concurrency=concurrency)
            rows.append(judged("locality + grouper", label, locality, live.assignment, cap_text))
    return rows


@dataclass
class SetsRow:
    """One plan's grouper against EPLB over disjoint served sets of the held-out requests."""

    case: str
    expert_cap: str
    set_size: int
    in_flight: int
    differences: list[float]  # per set: the grouper's expert imbalance (mean over layers) minus EPLB's
    bootstrap_sd: list[float]  # per set: the paired bootstrap's estimate of that difference's spread

    @property
    def over(self) -> int:
        return sum(d > 0 for d in self.differences)


def run_sets(case: Case, sets: int, draws: int = DEFAULT_DRAWS) -> list[SetsRow]:
    """The held-out half cut into `sets` disjoint served sets in trace order, each served alone by a
    closed-loop client of 16 requests per rank: how the grouper-minus-EPLB expert imbalance spreads over
    served sets of one size (what a live run of that many requests draws one value of)."""
    reader, topology, start = case.reader, case.topology, case.start
    size = (case.stop - start) // sets
    if size < 1:
        raise LocusError(f"{case.name}: {case.stop - start} held-out requests cannot make {sets} served sets")
    in_flight = 16 * topology.ranks
    out = []
    for cap_text, locality in case.locality.items():
        diffs, sds = [], []
        for lo in range(start, start + sets * size, size):
            hi = lo + size
            live = simulate_live(locality, reader, lo, hi, arrivals="closed", concurrency=in_flight)
            balanced = assign_balanced([r.tokens for r in reader.requests[lo:hi]], topology.ranks, request_start=lo)
            d = paired_bootstrap(request_rank_loads(reader, locality, live.assignment),
                                 request_rank_loads(reader, case.eplb, balanced), draws=draws)
            diffs.append(d.point)
            sds.append(d.sd)
        out.append(SetsRow(case.name, cap_text, size, in_flight, diffs, sds))
    return out


def print_sets(rows: list[SetsRow]) -> None:
    print("| case | expert cap | served sets x requests | in flight | expert mean - eplb's, per set | mean | "
          "sd over sets | bootstrap sd (mean) | sets over eplb |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        d = np.asarray(r.differences)
        spread = f"{d.std(ddof=1):.4f}" if len(d) > 1 else "-"
        print(f"| {r.case} | {r.expert_cap} | {len(d)} x {r.set_size} | {r.in_flight} | "
              f"{', '.join(f'{x:+.4f}' for x in d)} | {d.mean():+.4f} | {spread} | {np.mean(r.bootstrap_sd):.4f} | "
              f"{r.over} of {len(d)} |")


def _judged(r: Row, reference: Row) -> Row:
    """`r` with the issue's two targets checked against EPLB's row."""
    r.attention_within_target = r.attention_imbalance <= reference.attention_imbalance + ATTENTION_MARGIN
    r.expert_mean_within_target = r.expert_imbalance_mean <= reference.expert_imbalance_mean
    r.expert_within_target = r.expert_mean_within_target and r.expert_imbalance_worst <= reference.expert_imbalance_worst
    return r


def print_table(rows: list[Row]) -> None:
    print("| case | expert cap | assignment | in flight | inter-node B/token | attention imb. whole | per step mean / "
          f"worst | expert imb. mean / worst | attention <= eplb + {ATTENTION_MARGIN} | expert mean / also worst "
          "<= eplb | expert mean - eplb's [95% over resampled requests] |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        mark = {None: "", True: "yes", False: "**no**"}
        expert = "" if r.expert_within_target is None else (
            f"{mark[r.expert_mean_within_target]} / {mark[r.expert_within_target]}")
        d = r.expert_difference
        spread = "" if d is None else f"{d['point']:+.4f} [{d['ci95'][0]:+.4f}, {d['ci95'][1]:+.4f}]"
        print(f"| {r.case} | {r.expert_cap} | {r.assignment} | {r.in_flight} | {r.inter_node_bytes_per_token:,.1f} | "
              f"{r.attention_imbalance:.3f} | {r.step_attention_imbalance_mean:.3f} / "
              f"{r.step_attention_imbalance_worst:.3f} | {r.expert_imbalance_mean:.3f} / "
              f"{r.expert_imbalance_worst:.3f} | {mark[r.attention_within_target]} | {expert} | {spread} |")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", action="append", required=True, metavar="NAME=DIR,NODESxGPUS,SLOTS",
                   help="a case: a trace directory, the topology and the expert slots per GPU (repeatable)")
    p.add_argument("--expert-cap", action="append", metavar="CAP|auto[:FLOOR]|eplb[:SHARE]",
                   help=f"a locality plan's expert cap, as `locus plan --expert-cap` (repeatable; default "
                   f"{' and '.join(EXPERT_CAPS)})")
    p.add_argument("--draws", type=int, default=DEFAULT_DRAWS,
                   help=f"resamples of the held-out requests behind each expert difference's interval (default {DEFAULT_DRAWS})")
    p.add_argument("--served-sets", type=int, default=0, metavar="N",
                   help="also cut each case's held-out half into N disjoint served sets and give the grouper-minus-"
                   "EPLB expert imbalance of each (16 requests in flight per rank)")
    p.add_argument("--out", help="write the rows as JSON")
    args = p.parse_args(argv)
    if args.served_sets < 0:
        p.error(f"--served-sets must be at least 0, got {args.served_sets}")
    if args.draws < 1:
        p.error(f"--draws must be at least 1, got {args.draws}")
    specs = [parse_case(spec) for spec in args.trace]
    expert_caps = tuple(args.expert_cap or EXPERT_CAPS)
    for text in expert_caps:
        parse_expert_cap_mode(text)  # a bad one refused before any case runs
    rows: list[Row] = []
    started = time.perf_counter()
    cases = []
    for spec in specs:
        cases.append(plan_case(*spec, expert_caps=expert_caps))
        rows += run_case(cases[-1], draws=args.draws)
    print_table(rows)
    sets: list[SetsRow] = []
    if args.served_sets:
        for case in cases:
            sets += run_sets(case, sets=args.served_sets, draws=args.draws)
        print()
        print_sets(sets)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        doc = {"benchmark": "live_balance", "attention_margin": ATTENTION_MARGIN, "expert_caps": list(expert_caps),
               "draws": args.draws,
               "seconds": round(time.perf_counter() - started, 1), "rows": [asdict(r) for r in rows],
               "served_sets": [{**asdict(r), "over": r.over} for r in sets]}
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except LocusError as e:
        sys.exit(f"error: {e}")
