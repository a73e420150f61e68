"""Replay simulator throughput: (token, layer, k) routings per second, single process.

A synthetic DeepSeek-V3-shaped trace (256 experts, top-8, 58 MoE layers, hidden 7168) is generated
with locus.traces.synth's `deepseek-v3` preset (or, with --random, plain Zipf-random ids), written
to a temporary trace directory, and replayed end to end (memory-mapped reads, dispatch rule, every
metric) under several plans. Each replay runs --repeats times; the best time counts (the machine is
shared, and the best run is the one least disturbed by others).

    python bench/replay.py --requests 120 --out results/replay_bench.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from locus.routing.dispatch_rule import DEFAULT_RULE, RULES
from locus.routing.replay.assignment import assign_balanced
from locus.routing.planners.baselines import eplb, round_robin
from locus.routing.replay.simulator import count_expert_loads, replay
from locus.routing.plan.topology import parse_topology
from locus.traces.format import TraceMeta
from locus.traces.reader import TraceReader
from locus.traces.writer import TraceWriter


def make_trace(path: Path, requests: int, seed: int, random_ids: bool) -> str:
    if not random_ids:
        from locus.traces.presets import preset_config
        from locus.traces.synth import synthesize

        synthesize(preset_config("deepseek-v3", requests=requests, seed=seed), path)
        return "synth preset deepseek-v3"
    rng = np.random.default_rng(seed)
    E, K, layers = 256, 8, tuple(range(3, 61))
    meta = TraceMeta("deepseek-v3", E, K, layers, hidden_size=7168, dtype_bytes=2, source="bench random")
    p = 1.0 / np.arange(1, E + 1)
    p /= p.sum()
    with TraceWriter(path, meta) as writer:
        for i in range(requests):
            n = int(rng.integers(64, 512))
            writer.add_request(f"r{i}", "general", n // 2, rng.choice(E, (n, len(layers), K), p=p))
    return "zipf-random ids (not distinct per token)"


def time_replay(reader, plan, assignment, batch_tokens: int, repeats: int, order: str):
    best, report = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        report = replay(reader, plan, plan.topology, assignment, batch_tokens=batch_tokens, step_order=order)
        best = min(best, time.perf_counter() - t0)
    return best, report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=120, help="synthetic requests (about 290 tokens each)")
    ap.add_argument("--topology", default="4x8")
    ap.add_argument("--slots", type=int, default=9, help="slots per GPU (9 x 32 = 256 experts + 32 replicas)")
    ap.add_argument("--batch-tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--random", action="store_true", help="random ids instead of the synth preset")
    ap.add_argument("--dispatch", choices=RULES, default=DEFAULT_RULE,
                    help=f"dispatch rule the plans run under (default {DEFAULT_RULE}; docs/replay.md)")
    ap.add_argument("--out", default="results/replay_bench.json")
    args = ap.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="locus-replay-bench-"))
    try:
        t0 = time.perf_counter()
        source = make_trace(workdir / "trace", args.requests, args.seed, args.random)
        gen_s = time.perf_counter() - t0
        reader = TraceReader(workdir / "trace")
        meta = reader.meta
        L, K, N, R = len(meta.moe_layers), meta.top_k, reader.num_tokens, len(reader.requests)
        topology = parse_topology(args.topology, meta.num_experts, args.slots)
        half = R // 2
        assignment = assign_balanced([r.tokens for r in reader.requests[half:]], topology.ranks, request_start=half)
        replayed = int(reader.offsets[R] - reader.offsets[half])

        t0 = time.perf_counter()
        loads = count_expert_loads(reader, 0, half)  # plan on the first half, replay the second
        count_s = time.perf_counter() - t0
        plans = {"round_robin": round_robin(meta.num_experts, meta.moe_layers, topology)}
        for name, groups in (("eplb", None), ("eplb-hier8", 8)):
            t0 = time.perf_counter()
            plans[name] = eplb(loads, meta.moe_layers, topology, groups=groups)
            plans[name].provenance["plan_seconds"] = time.perf_counter() - t0

        rows = []
        for plan in plans.values():
            plan.dispatch = args.dispatch
        runs = [(name, plan, "trace") for name, plan in plans.items()] + [("eplb", plans["eplb"], "ranks")]
        for name, plan, order in runs:
            seconds, report = time_replay(reader, plan, assignment, args.batch_tokens, args.repeats, order)
            routings = replayed * L * K
            rows.append({
                "plan": name,
                "step_order": order,
                "dispatch": args.dispatch,
                "seconds": seconds,
                "routings": routings,
                "routings_per_s": routings / seconds,
                "plan_seconds": plan.provenance.get("plan_seconds"),
                "inter_node_bytes_per_token": report.inter_node_bytes_per_token,
                "locality": report.locality,
                "expert_imbalance_mean": report.expert_imbalance_mean,
                "step_expert_imbalance_mean": report.step_expert_imbalance_mean,
                "a2a_ms_per_step": report.a2a_ms_per_step,
            })
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    print(f"trace: {source}, {R} requests, {N:,} tokens ({gen_s:.1f} s to generate); "
          f"replayed the second half: {replayed:,} tokens x {L} layers x top-{K}")
    print(f"topology {args.topology}, {args.slots} slots/GPU, batch {args.batch_tokens} tokens, "
          f"best of {args.repeats}; load counting {count_s:.2f} s")
    header = f"{'plan':<12} {'order':<6} {'replay s':>9} {'M routings/s':>13} {'inter B/tok':>12} {'locality':>9} {'imbalance':>10} {'step imb.':>10} {'a2a ms/step':>12}"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(f"{r['plan']:<12} {r['step_order']:<6} {r['seconds']:>9.3f} {r['routings_per_s'] / 1e6:>13.1f} "
              f"{r['inter_node_bytes_per_token']:>12,.0f} {r['locality']:>9.3f} {r['expert_imbalance_mean']:>10.3f} "
              f"{r['step_expert_imbalance_mean']:>10.3f} {r['a2a_ms_per_step']:>12.2f}")

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "bench": "replay",
        "trace": {"source": source, "requests": R, "tokens": N, "replayed_tokens": replayed, "layers": L, "top_k": K,
                  "experts": meta.num_experts, "hidden_size": meta.hidden_size},
        "topology": args.topology, "slots_per_gpu": args.slots, "batch_tokens": args.batch_tokens,
        "repeats": args.repeats, "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                                             "numpy": np.__version__},
        "results": rows,
    }
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
