"""`locus replay`: what a placement plan would cost on a trace (docs/replay.md); `locus plan`: make a
placement plan, and `locus plan evaluate`: compare planners (docs/planner.md)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from locus.errors import LocusError

BUILTIN_PLANS = ("round_robin", "eplb")
PAYLOAD_FORMATS = ("model", "mxfp8", "mxint8")  # locus.kernels.formats.PAYLOAD_FORMATS (not imported: no torch at parse time)
ASSIGN_HELP = ("request->rank assignment: balanced (default), round_robin, grouper (the plan's micro-batch grouper "
               "admitting requests as a live expert-parallel server does: needs a plan with a grouping; see "
               "--arrivals), recorded (the rank each request ran on, from a trace an expert-parallel server "
               "recorded), a {request_id: rank} JSON file, or the assignment log `locus route --assignment-log` wrote")


def register(subparsers) -> None:
    from locus.routing.planners.cli import register_plan

    register_plan(subparsers)
    p = subparsers.add_parser(
        "replay",
        help="replay a trace under a placement plan and report traffic and balance",
        description="Replay a trace's requests under a placement plan and a request->rank assignment; "
        "report inter/intra-node bytes, locality, load imbalance and estimated all-to-all time.",
    )
    p.add_argument("trace", help="trace directory (locus-trace v1)")
    p.add_argument("--plan", required=True,
                   help="placement plan JSON, a built-in planner (round_robin, eplb), or `embedded`: the plans a "
                        "trace recorded across live re-plans keeps, each row under its epoch's plan")
    p.add_argument("--plans", metavar="DIR",
                   help="one plan per placement epoch (DIR/epoch-<e>.json) for a trace with epochs; rows are "
                        "routed by their epoch's plan (--plan then names epoch 0's, or use --plan embedded)")
    p.add_argument("--topology", help="NODESxGPUS, e.g. 2x8 (required with a built-in planner)")
    p.add_argument("--slots", type=int, help="expert slots per GPU for a built-in planner (default: just enough)")
    p.add_argument("--expert-groups", type=int, help="the model's expert groups (DeepSeek-V3: 8; default: known from the "
                   "trace's model name): eplb's hierarchical policy, and the plan's split-groups figures")
    p.add_argument("--topk-group", type=int, help="groups a token is routed within (DeepSeek-V3: 4; default: known from "
                   "the model name), for the nodes-per-token bound")
    p.add_argument("--plan-requests", metavar="START:STOP",
                   help="request range a built-in planner counts loads on (default: the replayed range)")
    p.add_argument("--save-plan", metavar="FILE", help="write the plan used (useful with a built-in planner)")
    p.add_argument("--assign", default="balanced", help=ASSIGN_HELP)
    p.add_argument("--save-assignment", metavar="FILE", help="write the assignment used as {request_id: rank} JSON")
    g = p.add_argument_group("--assign grouper: the live admission (docs/planner.md, \"Replaying with the grouper\")")
    g.add_argument("--arrivals", choices=("recorded", "closed", "batch"),
                   help="the order requests arrive and finish in: recorded (the admissions and releases an "
                   "expert-parallel server logged in the trace; the default for such a trace), closed (a client "
                   "keeping --concurrency requests in flight, in trace order, lockstep steps; the default otherwise), "
                   "batch (all admitted in trace order, none finishing)")
    g.add_argument("--concurrency", type=int, default=16,
                   help="closed arrivals, and the decode step order: requests in flight (default 16)")
    g.add_argument("--client-delay", type=int, default=1, metavar="STEPS",
                   help="closed arrivals: steps between a request's end and the client's next request (default 1)")
    g.add_argument("--untagged", action="store_true",
                   help="withhold the requests' domain tags, as from a client that sends none")
    g.add_argument("--predictor", choices=("auto", "table", "none"), default="auto",
                   help="untagged requests: table (the plan's prompt predictor, on the token ids the trace "
                   "recorded), none (least loaded), auto (table where the plan and trace allow; default)")
    g.add_argument("--moves", action="store_true",
                   help="move a request after its prefill when the cost model says the saved decode bytes pay for "
                   "its KV cache (counted as migration bytes)")
    p.add_argument("--requests", metavar="START:STOP",
                   help="requests to replay: indices (100:200) or fractions (0.5:1.0); default all")
    p.add_argument("--batch-tokens", type=int, default=4096, help="tokens per replay step (default 4096)")
    p.add_argument("--step-order", choices=("trace", "ranks", "decode"), default="trace",
                   help="trace: a step is batch-tokens consecutive rows in trace order (default); ranks: every "
                   "rank takes batch-tokens/ranks rows of its own request queue per step (DP attention); decode: a "
                   "closed-loop client keeps --concurrency requests in flight, a step runs the next decode row of "
                   "each (and the prompts of those just admitted)")
    p.add_argument("--inter-gbps", type=float, default=None,
                   help="inter-node GB/s per GPU (default 50; with --hardware, replaces the profile's)")
    p.add_argument("--intra-gbps", type=float, default=None,
                   help="intra-node GB/s per GPU (default 450; with --hardware, replaces the profile's)")
    p.add_argument("--latency-us", type=float, default=None,
                   help="all-to-all latency in microseconds (default 5; with --hardware, replaces the profile's "
                   "per-collective latency)")
    h = p.add_argument_group("the decode step-time model (docs/replay.md, \"Predicted step time\")")
    h.add_argument("--hardware", metavar="PROFILE",
                   help="predict every step's time on a hardware profile (h200-ib400, h100-ib400, cpu-2core-tbf, or a "
                   "locus-hardware JSON file) and print TPOT p50 / p99 and its split; use with --step-order decode")
    h.add_argument("--model-shape", metavar="NAME|FILE",
                   help="the model's shape for --hardware (default: the trace's model name; llama4-maverick, "
                   "llama4-scout, deepseek-v3, qwen3-235b, mixtral-8x7b, mini, or a shape JSON file)")
    h.add_argument("--two-batch-overlap", action="store_true",
                   help="--hardware: the step runs two micro-batches, one's compute under the other's exchange "
                   "(the server's --ep-overlap)")
    p.add_argument("--dispatch", choices=("position", "node-aware"),
                   help="dispatch rule to route by (default: the plan's `dispatch` field, else node-aware; the "
                   "built-in eplb plan's is position, the rule EPLB is made for; docs/replay.md)")
    p.add_argument("--dispatch-format", choices=PAYLOAD_FORMATS, default="model",
                   help="what a dispatched row travels in, as the server's --ep-dispatch-format: model (hidden x the "
                   "trace's dtype bytes), mxfp8 / mxint8 (hidden + hidden/32 bytes: elements and E8M0 scales; "
                   "docs/formats.md). Default model")
    p.add_argument("--combine-format", choices=PAYLOAD_FORMATS, default="model",
                   help="what a combined row travels back in, as the server's --ep-combine-format (default model)")
    p.add_argument("--json", metavar="OUT", help="also write the report as JSON")
    p.add_argument("--chakra", metavar="OUT_PREFIX",
                   help="also write Chakra execution traces for ASTRA-sim, one per rank: OUT_PREFIX.<rank>.et "
                   "(point-to-point sends of both dispatch tiers with exact bytes; docs/replay.md)")
    p.add_argument("--chakra-us-per-pair", type=float, default=0.0, metavar="US",
                   help="Chakra compute model: microseconds of expert compute per (token, expert) pair a rank "
                   "computes; adds a COMP node per step, layer and rank (default 0: no compute nodes)")
    p.add_argument("--astra-intra-latency-ns", type=float, default=250.0, metavar="NS",
                   help="ASTRA-sim network written with --chakra: intra-node link latency in ns (default 250; a "
                   "message crosses two links of its switch). Bandwidths are --intra-gbps / --inter-gbps")
    p.add_argument("--astra-inter-latency-ns", type=float, default=1000.0, metavar="NS",
                   help="ASTRA-sim network written with --chakra: inter-node link latency in ns (default 1000)")
    p.add_argument("--progress", action="store_true", help="show a progress bar even when stderr is not a terminal")
    p.set_defaults(func=run_replay)


def run_replay(args: argparse.Namespace) -> int:
    from locus.routing.expert_groups import group_figures, trace_groups, trace_rows_over_limit
    from locus.routing.replay.assignment import save_assignment
    from locus.routing.plan.placement import load_plan
    from locus.routing.replay.simulator import replay, parse_request_range
    from locus.routing.replay.metrics import LinkModel
    from locus.traces.format import TraceFormatError

    if args.batch_tokens < 1:
        raise LocusError(f"--batch-tokens must be at least 1, got {args.batch_tokens}")
    given = {"inter": args.inter_gbps, "intra": args.intra_gbps, "latency": args.latency_us}
    args.inter_gbps = 50.0 if args.inter_gbps is None else args.inter_gbps
    args.intra_gbps = 450.0 if args.intra_gbps is None else args.intra_gbps
    args.latency_us = 5.0 if args.latency_us is None else args.latency_us
    if not (0 < args.inter_gbps < float("inf") and 0 < args.intra_gbps < float("inf")
            and 0 <= args.latency_us < float("inf")):
        raise LocusError("--inter-gbps and --intra-gbps must be positive, --latency-us non-negative")
    if args.concurrency < 1:
        raise LocusError(f"--concurrency must be at least 1, got {args.concurrency}")
    hardware = shape = None
    if args.hardware:
        from locus.routing.replay.hardware import load_hardware

        hardware = load_hardware(args.hardware).with_links(
            None if given["inter"] is None else given["inter"] * 1e9,
            None if given["intra"] is None else given["intra"] * 1e9,
            None if given["latency"] is None else given["latency"] * 1e-6)
    else:
        for flag, value in (("--model-shape", args.model_shape), ("--two-batch-overlap", args.two_batch_overlap)):
            if value:
                raise LocusError(f"{flag} applies to the step-time model: add --hardware PROFILE")
    if not 0 <= args.chakra_us_per_pair < float("inf"):
        raise LocusError(f"--chakra-us-per-pair must be a non-negative number, got {args.chakra_us_per_pair}")
    if args.chakra_us_per_pair and not args.chakra:
        raise LocusError("--chakra-us-per-pair applies to the Chakra traces: add --chakra OUT_PREFIX")
    astra_net = None
    if args.chakra:
        from locus.routing.replay.astra_config import AstraNetwork

        astra_net = AstraNetwork(args.intra_gbps, args.inter_gbps, args.astra_intra_latency_ns,
                                 args.astra_inter_latency_ns)  # refuses a bad latency before the replay runs
    try:
        from locus.traces.reader import TraceReader

        reader = TraceReader(args.trace)
    except TraceFormatError as exc:
        raise LocusError(str(exc)) from None
    start, stop = parse_request_range(args.requests, len(reader.requests))
    if hardware is not None:
        from locus.routing.replay.model_shape import load_model_shape

        shape = load_model_shape(args.model_shape or reader.meta.model)
        shape.check_trace(reader.meta)  # before the replay runs

    groups = trace_groups(reader.meta, args.expert_groups, args.topk_group)
    epoch_plans = None
    if args.plan == "embedded" or args.plans:
        epoch_plans = _epoch_plans(args, reader)
        plan, plan_range = epoch_plans[min(epoch_plans)], None
    elif args.plan in BUILTIN_PLANS:
        plan, plan_range = _builtin_plan(args, reader, (start, stop))
    else:
        if args.plan_requests is not None:
            raise LocusError("--plan-requests applies to a built-in planner, not to a plan file")
        plan, plan_range = load_plan(args.plan), None
        if args.slots is not None and args.slots != plan.topology.slots_per_gpu:
            raise LocusError(f"--slots {args.slots} contradicts the plan's {plan.topology.slots_per_gpu} slots per GPU")
        if args.topology:
            shape = f"{plan.topology.nodes}x{plan.topology.gpus_per_node}"
            if args.topology.strip().lower() != shape:
                raise LocusError(f"--topology {args.topology} contradicts the plan's {shape}")
    if args.dispatch:
        plan.dispatch = args.dispatch
    if args.save_plan:
        _write(args.save_plan, plan.save)

    assignment = _assignment(args, reader, plan, start, stop)
    if args.save_assignment:
        ids = [r.id for r in reader.requests[start:stop]]
        _write(args.save_assignment, lambda path: save_assignment(assignment, ids, path))

    links = LinkModel(args.inter_gbps, args.intra_gbps, args.latency_us)
    bar = ProgressBar() if args.progress or sys.stderr.isatty() else None
    pairs = None
    if args.chakra:
        from locus.routing.replay.chakra import PairTraffic

        pairs = PairTraffic()
    if epoch_plans is None and reader.epochs is not None and len(reader.plans()) > 1:
        print(f"note: the trace ran under {len(reader.plans())} placement epochs; every row is replayed under "
              f"{args.plan} (use --plan embedded for the plans it ran under)", file=sys.stderr)
    report = replay(reader, plan, plan.topology, assignment, batch_tokens=args.batch_tokens, links=links,
                    progress=bar, step_order=args.step_order, pair_sink=pairs, epoch_plans=epoch_plans,
                    dispatch_format=args.dispatch_format, combine_format=args.combine_format,
                    concurrency=args.concurrency, hardware=hardware, model_shape=shape,
                    two_batch_overlap=args.two_batch_overlap)
    if bar:
        bar.close()
    if groups is not None:
        report.expert_groups = group_figures(plan.slots, groups, plan.topology, reader.meta.top_k).to_dict()
        report.expert_groups["rows_over_limit"] = trace_rows_over_limit(reader, start, stop, groups)
    print(report.format_table())
    if pairs is not None:
        _write_chakra(args, reader.meta, plan.topology, pairs)
        _write_astra_configs(args.chakra, plan.topology, astra_net)
    if plan_range is not None and plan_range[0] < stop and start < plan_range[1]:
        print(f"note: the {plan.planner} plan was computed on requests {plan_range[0]}:{plan_range[1]}, which overlap "
              f"the replayed {start}:{stop}; figures on planning data are not results (see --plan-requests)",
              file=sys.stderr)
    if args.json:
        doc = {"trace": str(args.trace), "plan_requests": list(plan_range) if plan_range else None, **report.to_dict()}
        _write(args.json, lambda path: Path(path).write_text(json.dumps(doc, indent=1) + "\n"))
    return 0


def _write_chakra(args, meta, topology, pairs) -> None:
    """Write the Chakra traces of the replay just run and list them."""
    from locus.routing.replay.chakra import write_chakra

    traffic = pairs.finish()
    try:
        from locus.kernels.formats import payload_row_bytes

        row_bytes = tuple(payload_row_bytes(meta.hidden_size, fmt, meta.dtype_bytes)
                          for fmt in (args.dispatch_format, args.combine_format))
        files = write_chakra(args.chakra, traffic, topology, meta.moe_layers, row_bytes,
                             us_per_pair=args.chakra_us_per_pair)
    except OSError as exc:
        raise LocusError(f"cannot write Chakra traces {args.chakra}.<rank>.et: {exc.strerror or exc}") from None
    print(f"Chakra traces ({traffic.steps} steps x {len(meta.moe_layers)} MoE layers, one file per rank):")
    for path, nodes in files:
        print(f"  {path}  {nodes:,} nodes, {path.stat().st_size:,} bytes")


def _write_astra_configs(prefix, topology, net) -> None:
    """Write the ASTRA-sim network, system and remote-memory files beside the traces; print the command."""
    from locus.routing.replay.astra_config import astra_command, shell_command, write_astra_configs

    try:
        files = write_astra_configs(prefix, topology, net)
    except OSError as exc:
        raise LocusError(f"cannot write the ASTRA-sim configs {prefix}.*: {exc.strerror or exc}") from None
    print(f"ASTRA-sim configs ({topology.nodes}x{topology.gpus_per_node}): {files.network}, {files.system}, "
          f"{files.remote_memory}")
    print("run them with ASTRA-sim's analytical backend (docs/interop.md):")
    argv = astra_command("ASTRA_SIM_BIN", prefix, files)
    print('  "${ASTRA_SIM_BIN:-AstraSim_Analytical_Congestion_Unaware}" ' + shell_command(argv[1:]))


def _write(path: str, write) -> None:
    """Run write(path), reporting an unwritable path as one line rather than a traceback."""
    try:
        write(path)
    except OSError as exc:
        raise LocusError(f"cannot write {path}: {exc.strerror or exc}") from None


def _epoch_plans(args, reader) -> dict:
    """The plan of every epoch: from the trace itself (--plan embedded) or DIR/epoch-<e>.json (--plans)."""
    import numpy as np

    from locus.routing.plan.placement import PlanError, load_plan, plan_from_dict
    from locus.traces.format import plan_file

    if args.plans:
        folder = Path(args.plans)
        files = sorted(folder.glob("epoch-*.json"))
        if not files:
            raise LocusError(f"--plans {folder}: no epoch-<e>.json plan files there")
        plans = {}
        for path in files:
            try:
                plans[int(path.stem.removeprefix("epoch-"))] = load_plan(path)
            except ValueError:
                raise LocusError(f"{path}: the file name must be epoch-<number>.json") from None
    else:
        plans = {}
        for epoch, data in reader.plans().items():
            try:
                plans[epoch] = plan_from_dict(data)
            except PlanError as exc:
                raise LocusError(f"{Path(args.trace) / plan_file(epoch)}: {exc}") from None
        if not plans:
            raise LocusError(f"--plan embedded: {args.trace} keeps no plans (it was not recorded under expert parallelism)")
    if reader.epochs is not None and len(reader.epochs):
        missing = sorted(set(np.unique(np.asarray(reader.epochs)).tolist()) - set(plans))
        if missing:
            raise LocusError(f"the trace has rows of epoch(s) {missing} and no plan for them")
    if args.dispatch:
        for plan in plans.values():
            plan.dispatch = args.dispatch
    return plans


def _builtin_plan(args, reader, replayed: tuple[int, int]):
    from locus.routing.dispatch_rule import planner_rule
    from locus.routing.planners.baselines import eplb, round_robin
    from locus.routing.replay.simulator import count_expert_loads, parse_request_range
    from locus.routing.plan.topology import parse_topology

    meta = reader.meta
    if not args.topology:
        raise LocusError(f"--plan {args.plan} needs --topology NODESxGPUS")
    if args.slots is not None and args.slots < 1:
        raise LocusError(f"--slots must be at least 1, got {args.slots}")
    topology = parse_topology(args.topology, meta.num_experts, args.slots)
    if args.plan == "round_robin":
        plan = round_robin(meta.num_experts, meta.moe_layers, topology, model=meta.model)
        plan_range = None  # round_robin does not look at the trace
    else:
        plan_range = parse_request_range(args.plan_requests, len(reader.requests)) if args.plan_requests else replayed
        loads = count_expert_loads(reader, *plan_range)
        plan = eplb(loads, meta.moe_layers, topology, groups=args.expert_groups, model=meta.model)
        plan.dispatch = planner_rule("eplb")  # as `locus plan --planner eplb` makes it
        plan.provenance.update(trace=str(args.trace), requests=f"{plan_range[0]}:{plan_range[1]}")
    return plan, plan_range


def _assignment(args, reader, plan, start: int, stop: int):
    from locus.routing.replay.assignment import assign_balanced, assign_recorded, assign_round_robin, load_assignment

    num_ranks = plan.topology.ranks
    if args.assign in ("grouper", "plan"):
        from locus.routing.grouping.live import simulate_live
        from locus.routing.plan.placement import validate

        validate(plan, num_experts=reader.meta.num_experts, moe_layers=reader.meta.moe_layers)
        sim = simulate_live(plan, reader, start, stop, args.arrivals, args.concurrency, args.untagged, args.predictor,
                            args.moves, client_delay=args.client_delay)
        arrivals = (f"closed loop, {args.concurrency} in flight" if sim.arrivals == "closed" else
                    {"recorded": "as the server recorded them", "batch": "all at once, none finishing"}[sim.arrivals])
        untagged = (f"; {sim.untagged:,} untagged, placed by " +
                    ("the plan's prompt predictor" if sim.predictor == "table" else "least load")) if sim.untagged else ""
        print(f"grouper: live admission, arrivals {arrivals}{untagged}; {sim.overflowed:,} overflowed to the least "
              f"loaded rank{f', {sim.assignment.migrations:,} moves' if args.moves else ''}", file=sys.stderr)
        return sim.assignment
    for flag, given in (("--arrivals", args.arrivals), ("--untagged", args.untagged), ("--moves", args.moves),
                        ("--predictor", args.predictor != "auto"),
                        ("--concurrency", args.concurrency != 16 and args.step_order != "decode"),
                        ("--client-delay", args.client_delay != 1)):
        if given:
            raise LocusError(f"{flag} applies to --assign grouper")
    if args.assign == "balanced":
        tokens = [r.tokens for r in reader.requests[start:stop]]
        return assign_balanced(tokens, num_ranks, request_start=start)
    if args.assign == "round_robin":
        return assign_round_robin(stop - start, num_ranks, request_start=start)
    if args.assign == "recorded":
        return assign_recorded(reader.requests[start:stop], num_ranks, request_start=start,
                               kv_bytes_per_token=reader.meta.kv_bytes_per_token,
                               gpus_per_node=plan.topology.gpus_per_node)
    ids = [r.id for r in reader.requests[start:stop]]
    return load_assignment(args.assign, ids, num_ranks, request_start=start)


class ProgressBar:
    """A one-line bar on stderr, redrawn at most every 0.2 s (a progress callback for replay)."""

    def __init__(self, width: int = 30):
        self.width, self.last = width, 0.0

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if done < total and now - self.last < 0.2:
            return
        self.last = now
        filled = self.width * done // max(total, 1)
        bar = "#" * filled + "." * (self.width - filled)
        print(f"\rreplay [{bar}] {100 * done / max(total, 1):5.1f}% {done:,}/{total:,} tokens",
              end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        print(file=sys.stderr, flush=True)
