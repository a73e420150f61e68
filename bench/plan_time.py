"""Locality planner time: DeepSeek-V3 shape (58 MoE layers x 256 experts, top-8) on 8 x 8 GPUs with one
spare slot per GPU, planned from about 1M trace tokens. Target: <= 60 s on the 2-core dev machine.

The trace is a synthetic preset (--preset, default `deepseek-v3`), generated once into --workdir (or any
trace given with --trace); the planner reads the first requests holding --tokens tokens. The time is
make_plan's own `plan_seconds` (wall): reading the trace (memory-mapped), signatures, grouping, placement of
every layer, the grouper simulation rounds; not the summary figures computed afterwards. CPU seconds are
the planning process's and its layer workers' (`--workers`, layer_pool.py; RUSAGE_CHILDREN, so they count
once the plan has stopped its workers) over the plan and its summary figures; on a shared machine they
say more than wall seconds, which are the target figure on a quiet one. Peak RSS is the largest of the
process's and any one worker's (a forked worker's RSS counts the planner's pages it shares, so it is not
added to the process's).

    python bench/plan_time.py --out results/plan_eval/plan_time.json

--table plans every preset of --presets on every topology of --topologies (default 2x8 .. 32x8, one
spare slot per GPU: ceil(experts / GPUs) + 1), each case in its own process (its own peak RSS), and
prints and writes one table: time, peak RSS, expected inter-node bytes per token against EPLB's, expert
imbalance, or the error where the cap cannot be met.

    python bench/plan_time.py --table --out results/plan_eval/plan_time_scale.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import math
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from locus.errors import LocusError
from locus.routing.plan.caps import Caps
from locus.routing.planners.layer_caps import parse_expert_cap
from locus.routing.planners.layer_pool import pool_workers
from locus.routing.planners.planner import PlanOptions, load_model_for, make_plan
from locus.routing.plan.topology import parse_topology
from locus.traces.presets import preset_config
from locus.traces.reader import TraceReader
from locus.traces.synth import synthesize


def trace_path(args) -> Path:
    if args.trace:
        return Path(args.trace)
    path = Path(args.workdir) / f"{args.preset}-{args.synth_requests}-seed{args.seed}"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        print(f"generating {path} ...", file=sys.stderr, flush=True)
        synthesize(preset_config(args.preset, requests=args.synth_requests, seed=args.seed), path)
    return path


TABLE_PRESETS = "deepseek-v3,qwen3-235b"
TABLE_TOPOLOGIES = "2x8,4x8,8x8,16x8,32x8"


def spare_slot(num_experts: int, topology: str) -> int:
    """One spare slot per GPU over the fewest that hold every expert once."""
    nodes, gpus = (int(x) for x in topology.split("x"))
    return math.ceil(num_experts / (nodes * gpus)) + 1


def run_table(args) -> None:
    """Every (preset, topology) case in a child process of this script; one table and one JSON."""
    rows = []
    for preset in args.presets.split(","):
        args.preset = preset
        trace = trace_path(args)
        experts = TraceReader(trace, check_ids=False).meta.num_experts
        for topology in args.topologies.split(","):
            slots = spare_slot(experts, topology)
            with tempfile.TemporaryDirectory() as tmp:
                out = Path(tmp) / "case.json"
                cmd = [sys.executable, __file__, "--trace", str(trace), "--topology", topology, "--slots", str(slots),
                       "--tokens", str(args.tokens), "--expert-cap", args.expert_cap, "--seed", str(args.seed),
                       "--replica-budget", args.replica_budget, "--out", str(out)]
                if args.workers is not None:
                    cmd += ["--workers", str(args.workers)]
                if args.load_model:
                    cmd += ["--load-model", args.load_model]
                print(f"{preset} {topology} {slots} slots/GPU ...", file=sys.stderr, flush=True)
                try:
                    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.case_timeout)
                except subprocess.TimeoutExpired:  # a row that says so, not a table that never ends
                    rows.append({"preset": preset, "topology": topology, "slots_per_gpu": slots,
                                 "timed_out_seconds": args.case_timeout})
                    continue
                if done.returncode != 0 and not out.exists():
                    raise SystemExit(f"{preset} {topology}: {done.stderr.strip()[-2000:]}")
                case = json.loads(out.read_text())
            rows.append({"preset": preset, **case})
    print(format_table(rows))
    write_json(Path(args.out), {
        "bench": "plan_time_table", "planner": "locality", "expert_cap": args.expert_cap, "tokens": args.tokens,
        "target_seconds": 60.0, "cases": rows, "machine": machine(),
    })


def format_table(rows: list[dict]) -> str:
    head = ("| preset | topology | slots/GPU | workers | plan time (s) | CPU (s, with workers) | "
            "peak RSS (MiB, max of process and a worker) | inter-node bytes/token | "
            "EPLB's | vs EPLB | expert imbalance (mean / worst) |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        first = f"| {r['preset']} | {r['topology']} | {r['slots_per_gpu']} | {r.get('workers', '')} "
        if r.get("timed_out_seconds"):
            lines.append(first + f"| not done in {r['timed_out_seconds']} s | | | | | | |")
            continue
        if r.get("error"):
            lines.append(first + f"| {r['plan_seconds']:.1f} | {r['cpu_seconds']:.1f} | {r['peak_rss_mib']:,.0f} | "
                         f"error: {r['error']} | | | |")
            continue
        s = r["summary"]
        lines.append(first + f"| {r['plan_seconds']:.1f} | {r['cpu_seconds']:.1f} | {r['peak_rss_mib']:,.0f} | "
                     f"{s['inter_node_bytes_per_token']:,.0f} | {s['eplb_inter_node_bytes_per_token']:,.0f} | "
                     f"{-100 * s['expected_reduction_vs_eplb']:+.1f} % | "
                     f"{s['expert_imbalance_mean']:.3f} / {s['expert_imbalance_worst']:.3f} |")
    return "\n".join(lines)


def machine() -> dict:
    return {"cpus": os.cpu_count(), "python": platform.python_version(), "numpy": np.__version__,
            "load_average": os.getloadavg()}


def write_json(out: Path, doc: dict) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, out)
    print(f"wrote {out}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", help="an existing trace (default: generate --preset)")
    ap.add_argument("--preset", default="deepseek-v3", help="trace preset to generate (locus trace synth --help)")
    ap.add_argument("--table", action="store_true", help="every preset of --presets on every topology of --topologies")
    ap.add_argument("--presets", default=TABLE_PRESETS, help=f"--table's presets (default {TABLE_PRESETS})")
    ap.add_argument("--topologies", default=TABLE_TOPOLOGIES, help=f"--table's topologies (default {TABLE_TOPOLOGIES})")
    ap.add_argument("--case-timeout", type=float, default=1800.0, help="--table: wall seconds a case may take")
    ap.add_argument("--expert-cap", default="1.10", help="a number or auto[:FLOOR] (locus plan --expert-cap)")
    ap.add_argument("--workdir", default="results/tmp/traces", help="where the trace is generated (git-ignored)")
    ap.add_argument("--synth-requests", type=int, default=2400, help="requests to generate (~430 tokens each)")
    ap.add_argument("--tokens", type=int, default=1_000_000, help="plan on the first requests holding this many")
    ap.add_argument("--topology", default="8x8")
    ap.add_argument("--slots", type=int, default=5, help="256 experts / 64 GPUs + 1 spare (default 5)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--replica-budget", choices=("top", "marginal"), default="top",
                    help="the locality planner's replica budget (docs/planner.md)")
    ap.add_argument("--workers", type=int, help="layer worker processes (locus plan --workers; default: the CPUs "
                                                 "this process may use, 1 for a small plan)")
    ap.add_argument("--load-model", choices=("dispatch", "even"),
                    help="the locality planner's load model (default: dispatch with marginal, even with top)")
    ap.add_argument("--out", default="results/plan_eval/plan_time.json")
    args = ap.parse_args()
    if args.table:
        run_table(args)
        return

    reader = TraceReader(trace_path(args), check_ids=False)
    meta = reader.meta
    stop = min(int(np.searchsorted(reader.offsets, args.tokens, side="left")), len(reader.requests))
    tokens = int(reader.offsets[stop])
    topology = parse_topology(args.topology, meta.num_experts, args.slots)
    expert_cap, auto = parse_expert_cap(args.expert_cap)
    options = PlanOptions(caps=Caps(expert=expert_cap), seed=args.seed, replica_budget=args.replica_budget,
                          load_model=args.load_model, expert_cap_auto=auto, workers=args.workers)
    case = {"bench": "plan_time", "planner": "locality", "trace": str(reader.path), "model": meta.model,
            "layers": len(meta.moe_layers), "experts": meta.num_experts, "top_k": meta.top_k,
            "requests": stop, "tokens": tokens, "topology": args.topology, "slots_per_gpu": args.slots,
            "expert_cap": args.expert_cap, "replica_budget": args.replica_budget, "load_model": load_model_for(options),
            "workers": pool_workers(args.workers, len(meta.moe_layers), topology.ranks, meta.num_experts)}
    runs = []
    for _ in range(args.repeats):
        t0, c0 = time.perf_counter(), cpu_seconds()
        try:
            result = make_plan("locality", reader, topology, (0, stop), options, trace=str(reader.path))
        except LocusError as exc:  # the cap cannot be met: how long it took to say so is the figure
            print(f"error: {exc}")
            write_json(Path(args.out), {**case, "error": str(exc), "plan_seconds": time.perf_counter() - t0,
                                        "cpu_seconds": cpu_seconds() - c0, "peak_rss_mib": peak_rss_mib(),
                                        "machine": machine()})
            raise SystemExit(1)
        cpu = cpu_seconds() - c0  # plan_seconds' span plus the summary figures', workers included
        runs.append({"plan_seconds": result.summary.plan_seconds, "with_summary_seconds": time.perf_counter() - t0,
                     "cpu_seconds_with_summary": cpu})
    best = min(runs, key=lambda r: r["plan_seconds"])
    s = result.summary
    rows = [
        ("trace", f"{reader.path} ({meta.model}: {len(meta.moe_layers)} MoE layers x {meta.num_experts} experts, "
                  f"top-{meta.top_k})"),
        ("planned on", f"requests 0:{stop} ({tokens:,} tokens)"),
        ("topology", f"{args.topology}, {args.slots} slots/GPU, expert cap {args.expert_cap}"),
        ("plan time (best of %d)" % args.repeats, f"{best['plan_seconds']:.1f} s (target <= 60 s)"),
        ("workers", str(case["workers"])),
        ("incl. summary figures", f"{best['with_summary_seconds']:.1f} s, CPU {best['cpu_seconds_with_summary']:.1f} s "
                                  "(with the workers')"),
        ("peak RSS", f"{peak_rss_mib():,.0f} MiB (max of the process and a worker)"),
        ("planning locality", f"{100 * s.locality:.1f} %"),
        ("expert imbalance (mean / worst)", f"{s.expert_imbalance_mean:.3f} / {s.expert_imbalance_worst:.3f}"),
    ]
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows))
    write_json(Path(args.out), {
        **case, "runs": runs, "plan_seconds": best["plan_seconds"],
        "cpu_seconds": best["cpu_seconds_with_summary"], "target_seconds": 60.0, "peak_rss_mib": peak_rss_mib(),
        "summary": s.to_dict(), "machine": machine(),
    })


def cpu_seconds() -> float:
    """User and system CPU seconds of this process and of its finished (waited-for) children: the layer
    workers, which a plan stops before it returns."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total


def peak_rss_mib() -> float:
    """The larger of this process's peak RSS and its largest finished child's (Linux reports KiB)."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return max(own, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss) / 1024


if __name__ == "__main__":
    main()
