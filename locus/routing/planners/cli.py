"""`locus plan TRACE ...` (make a placement plan), `locus plan evaluate` (compare planners) and
`locus plan export` / `locus plan import` (to and from SGLang, vLLM and DeepSeek EPLB expert maps).

`plan` takes either a trace or a subcommand word first, which argparse's subparsers cannot express
next to a positional; so the `plan` parser hands its whole argument list (prefix '+', so that '-h'
and '--x' pass through untouched) to one of the inner parsers.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from locus.errors import LocusError
from locus.routing.plan.predictor import DEFAULT_TOKENS, DEFAULT_TOP_EXPERTS

STANDARD_CASES = ("llama4-maverick", "deepseek-v3")
WORKDIR = "results/tmp/traces"  # git-ignored


def register_plan(subparsers) -> None:
    p = subparsers.add_parser(
        "plan", add_help=False, prefix_chars="+",
        help="make a placement plan from a trace (locus plan -h); compare planners (locus plan evaluate -h); "
        "bytes against slots per GPU (locus plan sweep -h); "
        "convert plans to and from SGLang/vLLM/DeepSeek maps (locus plan export -h, locus plan import -h)",
        description="locus plan TRACE --topology NxG --slots S -o plan.json | locus plan evaluate | "
        "locus plan sweep TRACE --topology NxG --slots LO:HI | locus plan export PLAN --to FORMAT -o OUT | locus plan import SRC --from FORMAT ... -o plan.json",
    )
    p.add_argument("argv", nargs=argparse.REMAINDER)
    p.set_defaults(func=run_plan_command)


def run_plan_command(args: argparse.Namespace) -> int:
    argv = list(args.argv)
    if argv and argv[0] == "evaluate":
        return run_evaluate(evaluate_parser().parse_args(argv[1:]))
    if argv and argv[0] == "sweep":
        return run_sweep(sweep_parser().parse_args(argv[1:]))
    if argv and argv[0] == "export":
        return run_export(export_parser().parse_args(argv[1:]))
    if argv and argv[0] == "import":
        return run_import(import_parser().parse_args(argv[1:]))
    return run_plan(plan_parser().parse_args(argv))


def _caps_arguments(p: argparse.ArgumentParser, auto: bool = False) -> None:
    if auto:  # parsed by run_plan (layer_caps.parse_expert_cap)
        p.add_argument("--expert-cap", default="1.10", metavar="CAP|auto[:FLOOR]|eplb[:SHARE]",
                       help="max/mean expert load per layer (default 1.10); auto: each layer at the tightest cap "
                       "the search meets there, at least FLOOR (default 1.10) and at most EPLB's figure, instead of "
                       "failing where the cap cannot be met; eplb: each layer searched at EPLB's figure there with "
                       "SHARE (default 0.5) of its slack over 1.0, at most 1.10, then settled as auto: for plans a "
                       "live server admits by, whose balance moves with the request mix (docs/planner.md)")
    else:
        p.add_argument("--expert-cap", type=float, default=1.10, help="max/mean expert load per layer (default 1.10)")
    p.add_argument("--attention-cap", type=float, default=1.10, help="max/mean tokens per rank (default 1.10)")
    p.add_argument("--seed", type=int, default=0, help="seed (clustering of untagged requests; default 0)")


def _dispatch_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dispatch", choices=("position", "node-aware"),
                   help="dispatch rule the plans are made for and replayed under (default node-aware, but position, the "
                   "rule EPLB is made for, for `locus plan --planner eplb` and evaluate's EPLB rows; docs/replay.md)")
    p.add_argument("--replica-budget", choices=("top", "marginal"), default="top",
                   help="locality: top = each node holds its requests' most used experts (default); marginal = each "
                   "expert once, then spare slots by expected node crossings saved under node-aware dispatch "
                   "(docs/planner.md)")
    p.add_argument("--load-model", choices=("dispatch", "even"),
                   help="locality: the expected expert loads the cap search balances; dispatch = under the plan's "
                   "dispatch rule (node-aware: measured by routing a sample of the planning requests with it); "
                   "even = the position rule's even spread over replicas. Default: dispatch with --replica-budget "
                   "marginal, even with top (docs/planner.md)")


def _load_model(args: argparse.Namespace) -> str:
    from locus.routing.planners.planner import PlanOptions, load_model_for

    return load_model_for(PlanOptions(replica_budget=args.replica_budget, load_model=args.load_model))


def plan_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="locus plan",
        description="Plan expert placement (and, for locality, the micro-batch grouping) from a trace. "
        "Prints expected figures on the planning data; replay another part of the trace for results.",
    )
    p.add_argument("trace", help="trace directory (locus-trace v1)")
    p.add_argument("--topology", required=True, help="NODESxGPUS, e.g. 8x8")
    p.add_argument("--slots", type=int, help="expert slots per GPU (default: just enough for one copy of each "
                   "expert; locality needs spare slots for replicas)")
    p.add_argument("--planner", default="locality", choices=("locality", "eplb", "round_robin"))
    p.add_argument("-o", "--output", required=True, help="plan JSON to write (atomically)")
    p.add_argument("--requests", metavar="START:STOP", help="requests to plan on, e.g. 0:0.5 (default: all)")
    _caps_arguments(p, auto=True)
    p.add_argument("--expert-groups", type=int, help="the model's expert groups (DeepSeek-V3: 8; default: known "
                   "from the trace's model name): eplb's hierarchical policy, --align-groups, the split-groups figure")
    p.add_argument("--topk-group", type=int, help="groups a token is routed within (DeepSeek-V3: 4; default: known "
                   "from the model name), for the nodes-per-token bound")
    p.add_argument("--align-groups", action="store_true",
                   help="locality: every replica of each expert group on one node, then locality within that "
                   "(bounds the nodes a token reaches by --topk-group; docs/planner.md)")
    p.add_argument("--rounds", type=int, default=2, help="locality: placement <-> grouper rounds (default 2)")
    p.add_argument("--workers", type=int, metavar="N",
                   help="locality: worker processes placing a round's layers side by side (1: in this process; "
                   "default: the CPUs this process may use, 1 for a small plan); the plan is the same for any N")
    p.add_argument("--kv-bytes-per-token", type=int, help="KV cache bytes per token for the grouper's move cost "
                   "(default: the trace's recorded figure, else from the model name; see docs/planner.md)")
    p.add_argument("--predictor-tokens", type=int, default=DEFAULT_TOKENS, metavar="N",
                   help="locality: store a prompt predictor with the plan, for clients that send no domain tag: the N "
                   f"most frequent token ids of the planning rows (needs a trace with token ids; 0: none; default "
                   f"{DEFAULT_TOKENS})")
    p.add_argument("--predictor-experts", type=int, default=DEFAULT_TOP_EXPERTS, metavar="M",
                   help=f"the prompt predictor keeps each token's M largest expert shares per layer (default "
                   f"{DEFAULT_TOP_EXPERTS})")
    p.add_argument("--json", metavar="OUT", help="also write the summary as JSON")
    p.add_argument("--hardware", metavar="PROFILE",
                   help="locality: plan for the decode step time on this hardware profile (a name: "
                   f"{', '.join(_profile_names())}; or a file; docs/replay.md); turns on --objective step-time")
    p.add_argument("--objective", choices=("step-time", "bytes"),
                   help="step-time: of EPLB's and the locality planner's candidate plans, the one whose predicted TPOT "
                   "is lowest (needs --hardware; its default then); bytes: the locality plan under the caps (the "
                   "default without --hardware)")
    p.add_argument("--model-shape", metavar="NAME|FILE",
                   help="step-time: the model's shape (default: the trace's model name in model_shapes.json)")
    p.add_argument("--concurrency", type=int,
                   help="step-time: requests in flight while scoring the candidates (default: 16 per rank)")
    p.add_argument("--inter-gbps", type=float, metavar="GBPS",
                   help="step-time: the inter-node GB/s per GPU (or per node, where the profile's link is the node's) "
                   "instead of the profile's, e.g. a shaped link's rate")
    _dispatch_argument(p)
    return p


def _profile_names() -> list[str]:
    from locus.routing.replay.hardware import profile_names

    return profile_names()


def _step_objective(args: argparse.Namespace, reader, topology):
    """The step-time objective the flags ask for (None: --objective bytes), checked before any work."""
    objective = args.objective or ("step-time" if args.hardware else "bytes")
    if objective == "bytes":
        for flag, value in (("--model-shape", args.model_shape), ("--concurrency", args.concurrency),
                            ("--inter-gbps", args.inter_gbps)):
            if value is not None:
                raise LocusError(f"{flag} applies to the step-time objective: add --hardware PROFILE")
        return None
    if not args.hardware:
        raise LocusError("--objective step-time needs --hardware PROFILE (the step time is predicted on a profile)")
    if args.planner != "locality":
        raise LocusError(f"--objective step-time chooses among EPLB's and the locality planner's plans: use "
                         f"--planner locality (the default), not {args.planner}, or drop --hardware")
    if args.concurrency is not None and args.concurrency < 1:
        raise LocusError(f"--concurrency must be at least 1, got {args.concurrency}")
    if args.inter_gbps is not None and not 0 < args.inter_gbps < float("inf"):
        raise LocusError(f"--inter-gbps must be a positive number, got {args.inter_gbps}")
    from locus.routing.planners.step_objective import StepObjective
    from locus.routing.replay.hardware import load_hardware
    from locus.routing.replay.model_shape import load_model_shape

    shape = load_model_shape(args.model_shape or reader.meta.model)
    shape.check_trace(reader.meta)
    concurrency = args.concurrency if args.concurrency is not None else 16 * topology.ranks
    hardware = load_hardware(args.hardware)
    if args.inter_gbps is not None:
        hardware = hardware.with_links(args.inter_gbps * 1e9)
    return StepObjective(hardware, shape, concurrency)


def run_plan(args: argparse.Namespace) -> int:
    from locus.routing.plan.caps import Caps
    from locus.routing.planners.layer_caps import parse_expert_cap_mode
    from locus.routing.planners.planner import PlanOptions, make_plan
    from locus.routing.replay.simulator import parse_request_range
    from locus.routing.plan.topology import parse_topology

    for out in filter(None, (args.output, args.json)):  # fail before the work, not after it
        parent = Path(out).parent
        if not parent.is_dir():
            raise LocusError(f"cannot write {out}: directory {parent} does not exist")
    if args.slots is not None and args.slots < 1:
        raise LocusError(f"--slots must be at least 1, got {args.slots}")
    if args.rounds < 1:
        raise LocusError(f"--rounds must be at least 1, got {args.rounds}")
    if args.kv_bytes_per_token is not None and args.kv_bytes_per_token < 1:
        raise LocusError(f"--kv-bytes-per-token must be positive, got {args.kv_bytes_per_token}")
    if args.predictor_tokens < 0 or args.predictor_experts < 1:
        raise LocusError(f"--predictor-tokens must be >= 0 and --predictor-experts >= 1, got {args.predictor_tokens} "
                         f"and {args.predictor_experts}")
    expert_cap, auto, eplb_share = parse_expert_cap_mode(args.expert_cap)
    caps = Caps(expert_cap, args.attention_cap)
    reader = _open_trace(args.trace)
    topology = parse_topology(args.topology, reader.meta.num_experts, args.slots)
    requests = parse_request_range(args.requests, len(reader.requests))
    groups = _plan_groups(args, reader.meta, topology)
    options = PlanOptions(caps=caps, seed=args.seed, expert_groups=args.expert_groups, rounds=args.rounds,
                          kv_bytes_per_token=args.kv_bytes_per_token, dispatch=args.dispatch,
                          replica_budget=args.replica_budget, load_model=args.load_model,
                          predictor_tokens=args.predictor_tokens, predictor_experts=args.predictor_experts,
                          expert_cap_auto=auto, expert_cap_eplb_share=eplb_share,
                          align_groups=groups if args.align_groups else None, workers=args.workers)
    objective = _step_objective(args, reader, topology)
    if objective is not None and args.align_groups:
        raise LocusError("--align-groups is not a candidate of the step-time objective: drop --hardware, or "
                         "--align-groups")
    if objective is None:
        result = make_plan(args.planner, reader, topology, requests, options, trace=args.trace)
    else:
        from locus.routing.planners.step_objective import format_scores, plan_for_step_time

        stepped = plan_for_step_time(reader, topology, requests, options, objective, trace=args.trace,
                                     log=lambda line: print(line, file=sys.stderr, flush=True))
        result = stepped.result
        print(format_scores(stepped))
    figures = None
    if groups is not None:
        from locus.routing.expert_groups import group_figures

        figures = group_figures(result.plan.slots, groups, topology, reader.meta.top_k)
        result.plan.provenance["expert_groups"] = {"groups": groups.num_groups, "topk_group": groups.topk_group,
                                                   "aligned": bool(args.align_groups)}
    _write(args.output, result.plan.save)
    print(result.summary.format_table())
    if figures is not None:
        from locus.routing.expert_groups import trace_rows_over_limit

        over = trace_rows_over_limit(reader, *requests, groups)
        print(f"expert groups  {figures.describe()}" + (f"; not a bound on this trace: {over:,} planning (token, "
              f"layer) rows route outside {groups.topk_group} groups" if over else ""))
    predictor = (result.plan.grouping or {}).get("predictor")
    if predictor is not None:
        size = len(json.dumps(predictor))
        classes = f", a classifier of {len(predictor['domains'])} domains" if predictor.get("domains") else ""
        print(f"prompt predictor (untagged requests)  {predictor['tokens']:,} tokens x {predictor['top_experts']} experts"
              f"{classes}, {size:,} bytes in the plan")
    elif args.planner == "locality" and args.predictor_tokens > 0:
        print("prompt predictor (untagged requests)  none: the trace has no token ids (record it with this Locus)")
    print(f"wrote {args.output}")
    if args.json:
        from locus.files import write_text_atomic

        doc = result.summary.to_dict()
        if figures is not None:
            doc["expert_groups"] = figures.to_dict()
        _write(args.json, lambda path: write_text_atomic(Path(path), json.dumps(doc, indent=1) + "\n"))
    return 0


def _plan_groups(args: argparse.Namespace, meta, topology):
    """The trace model's expert groups (None when unknown), checked against the flags before any work."""
    from locus.routing.expert_groups import trace_groups
    from locus.routing.planners.group_alignment import check_alignable

    groups = trace_groups(meta, args.expert_groups, args.topk_group)
    if args.align_groups:
        if args.planner != "locality":
            raise LocusError(f"--align-groups applies to --planner locality (EPLB's own aligned policy is --planner "
                             f"eplb --expert-groups G), not {args.planner}")
        if groups is None:
            raise LocusError(f"--align-groups needs the expert groups: the trace records none and its model "
                             f"{meta.model!r} is not one whose groups Locus knows; give --expert-groups G (and "
                             f"--topk-group K)")
        check_alignable(groups, topology)
    return groups


def evaluate_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="locus plan evaluate",
        description="Plan on the first half of each trace's requests, replay the second half: round_robin, eplb, "
        "locality placement with balanced assignment, locality placement with the grouper. Synthetic traces "
        "(the trace presets) are generated into --workdir unless already there.",
    )
    p.add_argument("--cases", default=",".join(STANDARD_CASES),
                   help=f"synthetic presets to evaluate, comma-separated (default {','.join(STANDARD_CASES)}; "
                   "8x8 GPUs, one spare slot per GPU); 'none' for only --trace cases")
    p.add_argument("--synth-requests", type=int, default=8000, help="requests per synthetic trace (default 8000)")
    p.add_argument("--synth-knob", action="append", default=[], metavar="KNOB=VALUE",
                   help="override a preset's routing knob, e.g. domain_skew=1.5 (repeatable; for sensitivity runs)")
    p.add_argument("--workdir", default=WORKDIR, help=f"where synthetic traces are generated (default {WORKDIR})")
    p.add_argument("--trace", action="append", default=[], metavar="NAME=DIR,NxG,SLOTS",
                   help="also evaluate an existing trace, e.g. engine=traces/rec,2x2,3 (repeatable)")
    p.add_argument("--out", default="results/plan_eval", help="directory for results.json and results.md")
    p.add_argument("--batch-tokens", type=int, default=4096, help="tokens per replay step (default 4096)")
    p.add_argument("--readme", metavar="FILE", help="also rewrite the planner table between the plan-eval markers of "
                   "FILE (e.g. README.md)")
    p.add_argument("--hardware", metavar="PROFILE",
                   help="add a predicted-TPOT column: every row replayed in the decode step order through the step-time "
                   "model on this hardware profile (h200-ib400, h100-ib400, cpu-2core-tbf or a locus-hardware file)")
    p.add_argument("--model-shape", metavar="NAME|FILE",
                   help="--hardware: the model's shape (default: each trace's model name; docs/replay.md)")
    p.add_argument("--concurrency", type=int, default=16,
                   help="--hardware: requests in flight of the decode step order (default 16)")
    p.add_argument("--inter-gbps", type=float, metavar="GBPS",
                   help="predicted TPOT: the inter-node GB/s instead of the profile's (a shaped link's rate)")
    _dispatch_argument(p)
    _caps_arguments(p, auto=True)  # the locality plans' cap, as `locus plan` takes it (eplb: the balance-first plan)
    return p


def run_evaluate(args: argparse.Namespace) -> int:
    from locus.routing.plan.caps import Caps
    from locus.routing.dispatch_rule import DEFAULT_RULE
    from locus.routing.planners.evaluate import evaluate_case, format_markdown, write_results
    from locus.routing.planners.layer_caps import parse_expert_cap_mode

    expert_cap, auto, eplb_share = parse_expert_cap_mode(args.expert_cap)
    caps = Caps(expert_cap, args.attention_cap)
    if args.readme:  # fail before the work, not after it
        from locus.routing.planners.eval_readme import check_readme

        check_readme(args.readme)
    if args.synth_requests < 4:
        raise LocusError(f"--synth-requests must be at least 4, got {args.synth_requests}")
    cases = [_parse_trace_case(spec) for spec in args.trace]
    names = [] if args.cases.strip() in ("", "none") else [c.strip() for c in args.cases.split(",")]
    cases = [_synthetic_case(name, args) for name in names] + cases
    if not cases:
        raise LocusError("nothing to evaluate: give --cases or --trace")
    settings = {"caps": caps.to_dict(), "expert_cap": args.expert_cap, "seed": args.seed,
                "batch_tokens": args.batch_tokens, "synth_requests": args.synth_requests, "synth_knobs": _knobs(args.synth_knob),
                "dispatch": args.dispatch or DEFAULT_RULE, "replica_budget": args.replica_budget,
                "load_model": _load_model(args)}
    tpot = _tpot_model(args)
    if tpot is not None:
        settings.update(hardware=tpot.hardware.name, model_shape=args.model_shape, concurrency=args.concurrency)
        if args.inter_gbps is not None:
            settings.update(inter_gbps=args.inter_gbps)
    log = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731
    results = []
    for case in cases:
        log(f"{case.name}: {case.trace}")
        results.append(evaluate_case(case, caps, seed=args.seed, batch_tokens=args.batch_tokens, log=log,
                                     dispatch=args.dispatch, replica_budget=args.replica_budget,
                                     load_model=args.load_model, tpot=tpot, expert_cap_auto=auto,
                                     expert_cap_eplb_share=eplb_share))
    paths = _write(args.out, lambda out: write_results(results, settings, out))
    if args.readme:
        from locus.routing.planners.eval_readme import readme_table, update_readme

        update_readme(args.readme, readme_table(results, settings))
        paths.append(Path(args.readme))
    print(format_markdown(results, settings))
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


def _tpot_model(args: argparse.Namespace):
    """The evaluation's predicted-TPOT settings (None without --hardware), checked before any work."""
    if not args.hardware:
        if args.model_shape or args.concurrency != 16 or args.inter_gbps is not None:
            flag = "--model-shape" if args.model_shape else "--concurrency" if args.concurrency != 16 else "--inter-gbps"
            raise LocusError(f"{flag} applies to the predicted TPOT: add --hardware PROFILE")
        return None
    from locus.routing.planners.evaluate import TpotModel
    from locus.routing.replay.hardware import load_hardware
    from locus.routing.replay.model_shape import load_model_shape

    if args.concurrency < 1:
        raise LocusError(f"--concurrency must be at least 1, got {args.concurrency}")
    if args.model_shape:
        load_model_shape(args.model_shape)  # a bad shape fails before the traces are made
    hardware = load_hardware(args.hardware)
    if args.inter_gbps is not None:
        if not 0 < args.inter_gbps < float("inf"):
            raise LocusError(f"--inter-gbps must be a positive number, got {args.inter_gbps}")
        hardware = hardware.with_links(args.inter_gbps * 1e9)
    return TpotModel(hardware, args.model_shape, args.concurrency)


def sweep_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="locus plan sweep",
        description="The memory-for-traffic curve: for every slot count per GPU, plan eplb and locality on the first "
        "half of the trace's requests and replay the second half (eplb balanced, locality with its grouper); print "
        "inter-node bytes/token and imbalance, write sweep.json, sweep.md and sweep.png (with the `plots` extra).",
    )
    p.add_argument("trace", help="trace directory (locus-trace v1)")
    p.add_argument("--topology", required=True, help="NODESxGPUS, e.g. 8x8")
    p.add_argument("--slots", default="2:8", help="slot counts per GPU: LO:HI (both included) or a list, e.g. 5,6,9 "
                   "(default 2:8; counts too small for one copy of every expert are skipped)")
    p.add_argument("--out", default="results/plan_sweep", help="directory for sweep.json, sweep.md, sweep.png")
    p.add_argument("--batch-tokens", type=int, default=4096, help="tokens per replay step (default 4096)")
    _dispatch_argument(p)
    _caps_arguments(p, auto=True)  # as `locus plan` takes it: auto and eplb plan every slot count
    return p


def run_sweep(args: argparse.Namespace) -> int:
    from locus.routing.dispatch_rule import DEFAULT_RULE
    from locus.routing.plan.caps import Caps
    from locus.routing.planners.layer_caps import parse_expert_cap_mode
    from locus.routing.planners.sweep import format_sweep, parse_slot_range, sweep, write_sweep

    slot_counts = parse_slot_range(args.slots)
    expert_cap, auto, eplb_share = parse_expert_cap_mode(args.expert_cap)
    reader = _open_trace(args.trace)
    caps = Caps(expert_cap, args.attention_cap)
    log = lambda text: print(text, file=sys.stderr, flush=True)  # noqa: E731
    rows, skipped = sweep(reader, args.topology, slot_counts, caps, seed=args.seed, dispatch=args.dispatch,
                          batch_tokens=args.batch_tokens, log=log, replica_budget=args.replica_budget,
                          load_model=args.load_model, expert_cap_auto=auto, expert_cap_eplb_share=eplb_share)
    for slots, reason in skipped:
        print(f"note: skipped {slots} slots/GPU: {reason}", file=sys.stderr)
    if not rows:
        raise LocusError(f"no slot count in {args.slots} holds every expert on {args.topology}")
    rule = args.dispatch or DEFAULT_RULE
    title = (f"{reader.meta.model} ({args.trace}), {args.topology}: planned on the first half, replayed the second; "
             f"expert cap {args.expert_cap}, attention cap {caps.attention:.2f}, dispatch {rule}")
    settings = {"trace": str(args.trace), "topology": args.topology, "caps": caps.to_dict(),
                "expert_cap": args.expert_cap, "seed": args.seed,
                "dispatch": rule, "batch_tokens": args.batch_tokens, "replica_budget": args.replica_budget,
                "load_model": _load_model(args)}
    paths = _write(args.out, lambda out: write_sweep(rows, title, out, settings))
    print(format_sweep(rows, title))
    if not any(p.suffix == ".png" for p in paths):
        print("note: no plot: install the `plots` extra (matplotlib) for sweep.png", file=sys.stderr)
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


MAP_FORMATS = ("sglang", "vllm", "deepseek")  # locus.routing.plan.interop.FORMATS, kept light for --help


def export_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="locus plan export",
        description="Write a placement plan as another engine's expert map (docs/interop.md): sglang = SGLang's "
        "--init-expert-location file; vllm = vLLM EPLB state (physical_to_logical_map, logical_to_physical_map, "
        "logical_replica_count); deepseek = DeepSeek EPLB's (phy2log, log2phy, logcnt). The file type follows "
        "the -o extension, .json or .pt.",
    )
    p.add_argument("plan", help="placement plan JSON (locus-placement v1)")
    p.add_argument("--to", dest="fmt", required=True, choices=MAP_FORMATS)
    p.add_argument("-o", "--output", required=True, help="file to write, .json or .pt")
    p.add_argument("--num-hidden-layers", type=int, help="sglang: model layers, dense ones included (SGLang keeps "
                   "a row per layer; default: the plan's last MoE layer + 1)")
    return p


def run_export(args: argparse.Namespace) -> int:
    from locus.routing.plan.engine_support import placement_warning
    from locus.routing.plan.interop import export_plan
    from locus.routing.plan.map_files import map_file_kind
    from locus.routing.plan.placement import load_plan

    map_file_kind(args.output)  # a bad extension fails before the plan is read
    if args.num_hidden_layers is not None and args.fmt != "sglang":
        raise LocusError("--num-hidden-layers applies to --to sglang only "
                         "(vLLM and DeepSeek maps hold MoE layers only)")
    plan = load_plan(args.plan)
    export_plan(plan, args.fmt, args.output, args.num_hidden_layers)
    ranks, P = plan.topology.ranks, plan.topology.total_slots
    print(f"wrote {args.output}: {args.fmt} map, {len(plan.moe_layers)} MoE layers, {P} physical experts "
          f"({plan.num_experts} experts + {P - plan.num_experts} redundant) on {ranks} ranks")
    if args.fmt == "sglang":
        print(f"SGLang: --ep-size {ranks} --ep-num-redundant-experts {P - plan.num_experts} "
              f"--init-expert-location {args.output}")
    elif args.fmt == "vllm":
        print(*vllm_flags(plan, args.output), sep="\n")
    warning = placement_warning(plan.model, args.fmt)
    if warning:
        print(warning, file=sys.stderr)
    return 0


# vLLM rebalances every step_interval steps, replacing the plan with its own; the largest int32 outlasts any run
VLLM_KEEP_PLAN_STEPS = 2**31 - 1


def vllm_flags(plan, output: str) -> list[str]:
    """The `vllm serve` flags that size expert parallelism and EPLB for `plan`, and how the file gets in:
    vLLM (0.33.0 and main) has no flag that loads a placement (docs/interop.md, "Taking a Locus plan to vLLM")."""
    topology = plan.topology
    ranks, redundant = topology.ranks, topology.total_slots - plan.num_experts
    if ranks < 2:  # ParallelConfig refuses EPLB with TP x DP = 1
        return ["vLLM: EPLB needs an expert-parallel size above 1 (tensor x data parallel); this plan has 1 rank"]
    eplb = json.dumps({"num_redundant_experts": redundant, "step_interval": VLLM_KEEP_PLAN_STEPS},
                      separators=(",", ":"))
    local = f" --data-parallel-size-local {topology.gpus_per_node}" if topology.nodes > 1 else ""
    return [f"vLLM: --tensor-parallel-size 1 --data-parallel-size {ranks}{local} --enable-expert-parallel "
            f"--enable-eplb --eplb-config '{eplb}'",
            f"vLLM has no flag that loads {output}: load it on every EP rank with the patch in docs/interop.md "
            "(\"Taking a Locus plan to vLLM\")"]


def import_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="locus plan import",
        description="Make a placement plan from another engine's expert map (.json or .pt; docs/interop.md). "
        "Slots per GPU = physical experts / ranks; physical expert p lives on rank p // slots.",
    )
    p.add_argument("src", help="map file: SGLang --init-expert-location file, vLLM EPLB state, DeepSeek EPLB triple")
    p.add_argument("--from", dest="fmt", required=True, choices=MAP_FORMATS)
    p.add_argument("--topology", required=True, help="NODESxGPUS the map was made for, e.g. 4x8")
    p.add_argument("--model", required=True, help="model name to record in the plan; a Llama-4 checkpoint directory "
                   "(its config.json) or a trace preset name (llama4-maverick, deepseek-v3, ...) also gives the MoE "
                   "layers")
    p.add_argument("--moe-layers", help="the model's MoE layer indices, '1,3,5' or 'start:stop[:step]' (sglang: which "
                   "rows to take; vllm/deepseek: the layer of each row); required unless --model gives them: no "
                   "format says which layers are MoE layers")
    p.add_argument("--num-experts", type=int, help="expert count, to check the map against (default: from the map's "
                   "logical-side shapes, or the largest id + 1)")
    p.add_argument("-o", "--output", required=True, help="plan JSON to write (atomically)")
    return p


def run_import(args: argparse.Namespace) -> int:
    from locus.routing.plan.interop import import_plan
    from locus.traces.format import TraceFormatError
    from locus.traces.importers.common import parse_layers

    parent = Path(args.output).parent
    if not parent.is_dir():
        raise LocusError(f"cannot write {args.output}: directory {parent} does not exist")
    if args.moe_layers is not None:
        try:
            layers = parse_layers(args.moe_layers)
        except TraceFormatError as exc:
            raise LocusError(str(exc)) from None
    else:
        layers = _model_moe_layers(args.model, args.fmt)
    result = import_plan(args.src, args.fmt, args.topology, args.model, layers, args.num_experts)
    for note in result.notes:
        print(f"note: {note}", file=sys.stderr)
    _write(args.output, result.plan.save)
    plan = result.plan
    print(f"wrote {args.output}: {plan.num_experts} experts, MoE layers {list(plan.moe_layers)}, topology "
          f"{plan.topology}")
    return 0


def _model_moe_layers(model: str, fmt: str) -> tuple[int, ...]:
    """The MoE layers --model gives (a checkpoint directory or a trace preset); without them an import would
    have to guess 0..L-1, which puts a Llama-4 Maverick plan (MoE on odd layers) on the wrong layers."""
    from locus.routing.plan.model_layers import model_moe_layers

    layers = model_moe_layers(model)
    if layers is None:
        raise LocusError(f"--from {fmt} maps do not say which model layers are MoE layers: pass --moe-layers, or "
                         f"--model as a Llama-4 checkpoint directory or trace preset that gives them ({model!r} is "
                         "neither)")
    return layers


def _knobs(specs: list[str]) -> dict:
    fields = {"zipf_exponent", "layer_skew_spread", "decode_zipf_scale", "domain_skew", "request_spread",
              "prefill_decode_corr", "layer_affinity"}
    out = {}
    for spec in specs:
        key, _, value = spec.partition("=")
        if key not in fields:
            raise LocusError(f"--synth-knob {spec!r}: knob must be one of {', '.join(sorted(fields))}")
        try:
            out[key] = float(value)
        except ValueError:
            raise LocusError(f"--synth-knob {spec!r}: {value!r} is not a number") from None
    return out


def _synthetic_case(name: str, args):
    from locus.routing.planners.evaluate import EvalCase
    from locus.traces.presets import PRESETS, preset_config
    from locus.traces.synth import synthesize

    if name not in PRESETS:
        raise LocusError(f"unknown synthetic preset {name!r}; choose from {', '.join(PRESETS)}")
    knobs = _knobs(args.synth_knob)
    config = preset_config(name, requests=args.synth_requests, seed=args.seed, **knobs)
    tag = "".join(f"-{k}{v:g}" for k, v in sorted(knobs.items()))
    path = Path(args.workdir) / f"{name}-{args.synth_requests}-seed{args.seed}{tag}"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        print(f"generating {path} ...", file=sys.stderr, flush=True)
        synthesize(config, path)
    ranks = 64
    slots = -(-config.num_experts // ranks) + 1  # one spare slot per GPU for replicas
    source = (f"synth preset {name}{' with ' + ', '.join(f'{k}={v:g}' for k, v in knobs.items()) if knobs else ''}, "
              f"{args.synth_requests} requests, seed {args.seed}: zipf_exponent {config.zipf_exponent}, "
              f"domain_skew {config.domain_skew}, request_spread {config.request_spread}, "
              f"prefill_decode_corr {config.prefill_decode_corr}, layer_affinity {config.layer_affinity}")
    return EvalCase(name, str(path), "8x8", slots, expert_groups=8 if name == "deepseek-v3" else None, source=source)


def _parse_trace_case(spec: str):
    from locus.routing.planners.evaluate import EvalCase

    try:
        name, rest = spec.split("=", 1)
        path, topology, slots = rest.rsplit(",", 2)
        return EvalCase(name.strip(), path.strip(), topology.strip(), int(slots), source="given trace")
    except ValueError:
        raise LocusError(f"--trace {spec!r} is not NAME=DIR,NODESxGPUS,SLOTS (e.g. engine=traces/rec,2x2,3)") from None


def _open_trace(path: str):
    from locus.traces.format import TraceFormatError
    from locus.traces.reader import TraceReader

    try:
        return TraceReader(path)
    except TraceFormatError as exc:
        raise LocusError(str(exc)) from None


def _write(path: str, write):
    try:
        return write(path)
    except OSError as exc:
        raise LocusError(f"cannot write {path}: {exc.strerror or exc}") from None
