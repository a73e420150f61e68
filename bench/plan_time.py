"""Locality planner time: DeepSeek-V3 shape (58 MoE layers x 256 experts, top-8) on 8 x 8 GPUs with one
spare slot per GPU, planned from about 1M trace tokens. Target: <= 60 s on the 2-core dev machine.

The trace is the `deepseek-v3` synthetic preset, generated once into --workdir (or any trace given with
--trace); the planner reads the first requests holding --tokens tokens. The time is make_plan's own
`plan_seconds`: reading the trace (memory-mapped), signatures, grouping, placement of every layer, the
grouper simulation rounds; not the summary figures computed afterwards.

    python bench/plan_time.py --out results/plan_eval/plan_time.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import time
from pathlib import Path

import numpy as np

from locus.routing.planners.planner import PlanOptions, load_model_for, make_plan
from locus.routing.plan.topology import parse_topology
from locus.traces.presets import preset_config
from locus.traces.reader import TraceReader
from locus.traces.synth import synthesize


def trace_path(args) -> Path:
    if args.trace:
        return Path(args.trace)
    path = Path(args.workdir) / f"deepseek-v3-{args.synth_requests}-seed{args.seed}"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        print(f"generating {path} ...", file=sys.stderr, flush=True)
        synthesize(preset_config("deepseek-v3", requests=args.synth_requests, seed=args.seed), path)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", help="an existing trace (default: generate the deepseek-v3 preset)")
    ap.add_argument("--workdir", default="results/tmp/traces", help="where the trace is generated (git-ignored)")
    ap.add_argument("--synth-requests", type=int, default=2400, help="requests to generate (~430 tokens each)")
    ap.add_argument("--tokens", type=int, default=1_000_000, help="plan on the first requests holding this many")
    ap.add_argument("--topology", default="8x8")
    ap.add_argument("--slots", type=int, default=5, help="256 experts / 64 GPUs + 1 spare (default 5)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--replica-budget", choices=("top", "marginal"), default="top",
                    help="the locality planner's replica budget (docs/planner.md)")
    ap.add_argument("--load-model", choices=("dispatch", "even"),
                    help="the locality planner's load model (default: dispatch with marginal, even with top)")
    ap.add_argument("--out", default="results/plan_eval/plan_time.json")
    args = ap.parse_args()

    reader = TraceReader(trace_path(args), check_ids=False)
    meta = reader.meta
    stop = min(int(np.searchsorted(reader.offsets, args.tokens, side="left")), len(reader.requests))
    tokens = int(reader.offsets[stop])
    topology = parse_topology(args.topology, meta.num_experts, args.slots)
    runs = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        options = PlanOptions(seed=args.seed, replica_budget=args.replica_budget, load_model=args.load_model)
        result = make_plan("locality", reader, topology, (0, stop), options, trace=str(reader.path))
        runs.append({"plan_seconds": result.summary.plan_seconds, "with_summary_seconds": time.perf_counter() - t0})
    best = min(runs, key=lambda r: r["plan_seconds"])
    s = result.summary
    rows = [
        ("trace", f"{reader.path} ({meta.model}: {len(meta.moe_layers)} MoE layers x {meta.num_experts} experts, "
                  f"top-{meta.top_k})"),
        ("planned on", f"requests 0:{stop} ({tokens:,} tokens)"),
        ("topology", f"{args.topology}, {args.slots} slots/GPU"),
        ("plan time (best of %d)" % args.repeats, f"{best['plan_seconds']:.1f} s (target <= 60 s)"),
        ("incl. summary figures", f"{best['with_summary_seconds']:.1f} s"),
        ("peak RSS", f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:,.0f} MiB"),
        ("planning locality", f"{100 * s.locality:.1f} %"),
        ("expert imbalance (mean / worst)", f"{s.expert_imbalance_mean:.3f} / {s.expert_imbalance_worst:.3f}"),
    ]
    width = max(len(k) for k, _ in rows)
    print("\n".join(f"{k:<{width}}  {v}" for k, v in rows))

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "bench": "plan_time", "planner": "locality", "trace": str(reader.path), "model": meta.model,
        "layers": len(meta.moe_layers), "experts": meta.num_experts, "top_k": meta.top_k,
        "requests": stop, "tokens": tokens, "topology": args.topology, "slots_per_gpu": args.slots,
        "replica_budget": args.replica_budget, "load_model": load_model_for(options),
        "runs": runs, "plan_seconds": best["plan_seconds"], "target_seconds": 60.0,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "summary": s.to_dict(),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "numpy": np.__version__,
                    "load_average": os.getloadavg()},
    }
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
