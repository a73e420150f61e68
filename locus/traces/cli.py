"""`locus trace ...`: synth, stats, import, export, validate, merge.

Kept light for `locus --help`: numpy and the rest load inside the handlers.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

PRESET_NAMES = ("llama4-scout", "llama4-maverick", "deepseek-v3", "qwen3-235b", "mixtral-8x7b")
KNOBS = (  # (flag, SynthConfig field, help)
    ("--zipf", "zipf_exponent", "per-layer popularity skew: expert weight ~ rank^-a"),
    ("--layer-skew-spread", "layer_skew_spread", "how much the skew varies between layers (lognormal sigma)"),
    ("--decode-zipf-scale", "decode_zipf_scale", "skew of decode tokens relative to prefill (<1 flatter)"),
    ("--domain-skew", "domain_skew", "task-family specificity (std of per-domain log-popularity offsets)"),
    ("--request-spread", "request_spread", "per-request affinity (std of per-request log-popularity offsets)"),
    ("--pd-corr", "prefill_decode_corr", "correlation of a request's prefill and decode affinity, 0..1"),
    ("--layer-affinity", "layer_affinity", "probability a draw follows the previous layer's hand-over map, 0..1"),
)


def register(subparsers) -> None:
    trace = subparsers.add_parser("trace", help="expert-activation traces: synthesize, import, inspect")
    sub = trace.add_subparsers(dest="trace_command", metavar="SUBCOMMAND")
    trace.set_defaults(func=lambda args: _usage(trace))

    p = sub.add_parser("synth", help="generate a synthetic trace from a preset")
    p.add_argument("--preset", required=True, choices=PRESET_NAMES)
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("-o", "--output", required=True, type=Path, help="trace directory to create")
    p.add_argument("--force", action="store_true", help="replace an existing trace at -o")
    p.add_argument("--weights", action="store_true", help="also write expert_weights.npy")
    for flag, _, text in KNOBS:
        p.add_argument(flag, type=float, help=text)
    p.add_argument("--domains", help="domain mix, e.g. code=0.3,math=0.2,chat=0.5")
    p.add_argument("--prompt-median", type=float, help="median prompt length (log-normal)")
    p.add_argument("--decode-median", type=float, help="median decode length (log-normal)")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=cmd_synth)

    p = sub.add_parser("stats", help="load imbalance, domain specificity, prefill->decode predictability, ...")
    p.add_argument("trace", type=Path)
    p.add_argument("--json", type=Path, help="also write the figures as JSON here")
    p.add_argument("--plots", type=Path, help="write PNG heatmaps into this directory (needs matplotlib)")
    p.add_argument("--top-n", type=int, help="experts per request for the prefill->decode coverage (default max(K, E/8))")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=cmd_stats)

    p = sub.add_parser("import", help="convert vLLM / SGLang / Megatron routing records to a trace")
    p.add_argument("--from", dest="source", required=True, choices=("vllm", "sglang", "megatron"))
    p.add_argument("src", type=Path, help="source file (or, for sglang, a directory of .pt dumps)")
    p.add_argument("-o", "--output", required=True, type=Path)
    p.add_argument("--force", action="store_true", help="replace an existing trace at -o")
    p.add_argument("--model", help="model name; a preset name also fills in the shapes below")
    p.add_argument("--hidden-size", type=int)
    p.add_argument("--num-experts", type=int)
    p.add_argument("--top-k", type=int, help="only for count-only sources")
    p.add_argument("--moe-layers", help="model layer indices of the MoE layers: '1,3,5' or '1:48:2'")
    p.add_argument("--domain", default="unknown", help="domain of requests whose record names none")
    p.set_defaults(func=cmd_import)

    p = sub.add_parser("export", help="write a trace's expert counts for another engine (SGLang EPLB)",
                       description="sglang-counts: per-layer expert token counts in the layout of SGLang's "
                       "expert-distribution recorder stat dump (logical_count [1, layers, experts]); SGLang's "
                       "--init-expert-location seeds its EPLB with it (docs/interop.md).")
    p.add_argument("trace", type=Path, help="token or count trace")
    p.add_argument("--to", dest="fmt", required=True, choices=("sglang-counts",))
    p.add_argument("-o", "--output", required=True, type=Path, help="file to write, .pt or .json")
    p.add_argument("--num-hidden-layers", type=int, help="model layers, dense ones included (SGLang counts every "
                   "layer; default: the trace's last MoE layer + 1)")
    p.add_argument("--force", action="store_true", help="replace an existing file at -o")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("validate", help="check a trace completely and print a summary")
    p.add_argument("trace", type=Path)
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("merge", help="merge the traces several engines recorded (say, `locus route`'s backends) "
                       "into one, each request marked with the rank it ran on",
                       description="Write the requests of every source trace into one trace. Each source's "
                       "requests are marked as run on its rank (--ranks); with --route-log they also carry the "
                       "admission and release the router logged for them and are written in admission order, so "
                       "that `locus replay --assign grouper` runs the grouper through the router's sequence.")
    p.add_argument("sources", nargs="+", type=Path, help="trace directories, one per rank")
    p.add_argument("-o", "--output", required=True, type=Path)
    p.add_argument("--ranks", help="the rank each source ran as, e.g. 0,1,2,3 (default: their order)")
    p.add_argument("--route-log", type=Path, help="the assignment log `locus route --assignment-log` wrote")
    p.add_argument("--force", action="store_true", help="replace an existing trace at -o")
    p.set_defaults(func=cmd_merge)


def _usage(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def _fail(message: str) -> int:
    print(f"locus: error: {message}", file=sys.stderr)
    return 2


def cmd_synth(args: argparse.Namespace) -> int:
    from locus.traces.format import TraceFormatError
    from locus.traces.presets import preset_config
    from locus.traces.progress import Progress
    from locus.traces.synth import LengthDist, synthesize

    overrides: dict = {"requests": args.requests, "seed": args.seed, "with_weights": args.weights}
    for flag, name, _ in KNOBS:
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is not None:
            overrides[name] = value
    try:
        if args.domains:
            overrides["domain_mix"] = _parse_domains(args.domains)
        config = preset_config(args.preset, **overrides)
        if args.prompt_median:
            config = _replace_median(config, "prompt_len", args.prompt_median, LengthDist)
        if args.decode_median:
            config = _replace_median(config, "decode_len", args.decode_median, LengthDist)
        progress = None if args.quiet else Progress(f"synth {args.preset}")
        result = synthesize(config, args.output, overwrite=args.force, progress=progress)
    except (TraceFormatError, ValueError) as exc:
        return _fail(str(exc))
    print(f"wrote {result.path}: {result.num_requests} requests, {result.num_tokens} tokens in {result.seconds:.1f}s")
    return 0


def cmd_merge(args: argparse.Namespace) -> int:
    import shutil

    from locus.traces.format import TraceFormatError
    from locus.traces.merge import merge_traces
    from locus.traces.reader import TraceReader
    from locus.traces.route_log import read_route_log

    try:
        ranks = [int(r) for r in args.ranks.split(",")] if args.ranks else list(range(len(args.sources)))
    except ValueError:
        return _fail(f"--ranks {args.ranks!r}: expected comma-separated integers, e.g. 0,1,2,3")
    if len(ranks) != len(args.sources):
        return _fail(f"--ranks names {len(ranks)} ranks for {len(args.sources)} source traces")
    if args.output.exists() and not args.force:
        return _fail(f"{args.output} exists (use --force to replace it)")
    try:
        admissions = None
        if args.route_log is not None:
            log = read_route_log(args.route_log)
            admissions = {}
            for source in args.sources:
                for record in TraceReader(source).requests:
                    found = log.match(record.id)
                    if found is None:
                        return _fail(f"{args.route_log}: the router logged no request for {record.id!r} of {source}")
                    admissions[record.id] = found.admission
        if args.output.exists():
            shutil.rmtree(args.output)
        count = merge_traces(args.sources, args.output, ranks, admissions)
    except TraceFormatError as exc:
        return _fail(str(exc))
    print(f"wrote {args.output}: {count} requests from {len(args.sources)} traces")
    return 0


def _parse_domains(spec: str) -> tuple[tuple[str, float], ...]:
    try:
        pairs = [item.split("=") for item in spec.split(",") if item.strip()]
        return tuple((name.strip(), float(weight)) for name, weight in pairs)
    except ValueError:
        raise ValueError(f"--domains: cannot parse {spec!r}; use name=weight,name=weight") from None


def _replace_median(config, field: str, median: float, cls):
    import dataclasses

    old = getattr(config, field)
    return dataclasses.replace(config, **{field: cls(median, old.sigma, old.min, old.max)})


def cmd_stats(args: argparse.Namespace) -> int:
    from locus.traces.counts import read_counts
    from locus.traces.format import KIND_COUNTS, TraceFormatError, trace_kind
    from locus.traces.progress import Progress
    from locus.traces.reader import TraceReader
    from locus.traces.report import render_stats, write_plots
    from locus.traces.stats import compute_stats

    try:
        if trace_kind(args.trace) == KIND_COUNTS:
            stats = compute_stats(read_counts(args.trace))
        else:
            reader = TraceReader(args.trace)
            stats = compute_stats(reader, top_n=args.top_n, progress=None if args.quiet else Progress("stats"))
    except TraceFormatError as exc:
        return _fail(str(exc))
    print(render_stats(stats))
    if args.json:
        args.json.write_text(json.dumps(stats.to_json(), indent=1) + "\n")
        print(f"wrote {args.json}")
    if args.plots:
        try:
            for path in write_plots(stats, args.plots):
                print(f"wrote {path}")
        except ImportError as exc:
            return _fail(str(exc))
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    from locus.traces.format import TraceFormatError
    from locus.traces.importers import ImportOptions, import_trace, parse_layers

    try:
        options = ImportOptions(
            model=args.model, hidden_size=args.hidden_size, num_experts=args.num_experts, top_k=args.top_k,
            moe_layers=parse_layers(args.moe_layers) if args.moe_layers else None, domain=args.domain,
            overwrite=args.force,
        )
        result = import_trace(args.source, args.src, args.output, options)
    except TraceFormatError as exc:
        return _fail(str(exc))
    for note in result.notes:
        print(f"note: {note}", file=sys.stderr)
    what = f"{result.num_requests} requests, {result.num_tokens} tokens" if result.kind == "tokens" else "expert counts"
    print(f"wrote {result.kind} trace {result.path}: {what}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from locus.traces.export import export_trace
    from locus.traces.format import TraceFormatError

    try:
        result = export_trace(args.trace, args.fmt, args.output, args.num_hidden_layers, overwrite=args.force)
    except TraceFormatError as exc:
        return _fail(str(exc))
    print(f"wrote {result.path}: logical_count [1, {result.num_hidden_layers}, {result.num_experts}], "
          f"{result.pairs} (token, expert) pairs")
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    from locus.traces.counts import read_counts
    from locus.traces.format import KIND_COUNTS, TraceFormatError, trace_kind
    from locus.traces.reader import TraceReader

    try:
        if trace_kind(args.trace) == KIND_COUNTS:
            c = read_counts(args.trace)
            m = c.meta
            print(f"{args.trace}: valid count trace")
            tokens = "unknown" if c.num_tokens is None else c.num_tokens
            print(f"  model {m.model}, {m.num_experts} experts, top-{m.top_k}, {m.num_layers} MoE layers, H={m.hidden_size}")
            print(f"  {int(c.counts.sum())} (token, expert) pairs, tokens {tokens}")
            return 0
        r = TraceReader(args.trace)
    except TraceFormatError as exc:
        return _fail(str(exc))
    m = r.meta
    prefill = sum(q.prompt_tokens for q in r.requests)
    domains: dict[str, int] = {}
    for q in r.requests:
        domains[q.domain] = domains.get(q.domain, 0) + 1
    size = sum(p.stat().st_size for p in args.trace.iterdir() if p.is_file())
    print(f"{args.trace}: valid locus-trace v1")
    print(f"  model {m.model}, {m.num_experts} experts, top-{m.top_k}, {m.num_layers} MoE layers "
          f"({m.moe_layers[0]}..{m.moe_layers[-1]}), H={m.hidden_size}, source {m.source or '-'}")
    print(f"  {r.num_requests} requests, {r.num_tokens} tokens (prefill {prefill}, decode {r.num_tokens - prefill})")
    print("  domains " + (", ".join(f"{d} {n}" for d, n in sorted(domains.items())) or "-"))
    print(f"  weights {'yes' if r.expert_weights is not None else 'no'}, {size / 2**20:.1f} MiB on disk")
    return 0
