"""The replay's all-to-all traffic through ASTRA-sim: simulated time per placement plan, beside the bytes.

For a synthetic trace of a preset (llama4-scout by default) and each topology, this makes four plans
with the Locus CLI on the first half of the requests and replays the second half under each:

    round_robin          locus plan --planner round_robin, requests assigned balanced
    eplb                 locus plan --planner eplb
    locality             locus plan --planner locality, requests assigned balanced
    locality + grouper   the same plan, requests assigned by its grouper (--assign grouper)

Each replay writes its Chakra traces and ASTRA-sim configs (`locus replay ... --chakra PREFIX`:
PREFIX.<rank>.et, PREFIX.network.yml, PREFIX.system.json, PREFIX.memory.json), and the ASTRA-sim
binary runs them: the analytical congestion-unaware backend (tools/build_astra_sim.sh builds it), given
by --astra-bin or the environment variable ASTRA_SIM_BIN. Without one, the script says so and exits 0.

Printed per plan and topology: inter-node bytes of the replay, Locus's own all-to-all time estimate
(the replay's a2a_seconds: per step and layer the busiest rank's link time, plus latency), and
ASTRA-sim's simulated time (the last rank to finish, in ms; ASTRA-sim ticks are ns). The JSON adds
every rank's finish time and exposed communication.

    export ASTRA_SIM_BIN=/work/astra/src/astra-sim/build/astra_analytical/build/bin/AstraSim_Analytical_Congestion_Unaware
    python bench/astra.py --requests 400 --topologies 2x4,8x8 --out results/astra.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PROG = "bench/astra.py"
ENV_BIN = "ASTRA_SIM_BIN"
PLANS = ("round_robin", "eplb", "locality", "locality+grouper")
FINISHED = re.compile(r"sys\[(\d+)\] finished, (\d+) cycles, exposed communication (\d+) cycles")


class BenchError(Exception):
    pass


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--astra-bin", help=f"ASTRA-sim analytical binary (default: ${ENV_BIN})")
    p.add_argument("--preset", default="llama4-scout", help="synthetic trace preset (default: llama4-scout)")
    p.add_argument("--requests", type=int, default=80,
                   help="requests in the trace: the first half plans, the second half is replayed (default: 80)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--topologies", default="2x4", help="comma-separated NODESxGPUS (default: 2x4)")
    p.add_argument("--slots", type=int, help="expert slots per GPU, every plan (default: one copy of each expert "
                   "plus one spare slot, at least 3)")
    p.add_argument("--expert-cap", type=float, help="locality: max/mean expert load per layer (default: the "
                   "planner's, 1.10); many GPUs per expert need a looser cap")
    p.add_argument("--plans", default=",".join(PLANS), help=f"comma-separated subset of {','.join(PLANS)}")
    p.add_argument("--batch-tokens", type=int, default=4096, help="tokens per replay step (default: 4096)")
    p.add_argument("--intra-gbps", type=float, default=450.0, help="intra-node GB/s per GPU (default: 450)")
    p.add_argument("--inter-gbps", type=float, default=50.0, help="inter-node GB/s per GPU (default: 50)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per ASTRA-sim run (default: 900)")
    p.add_argument("--out", default="results/astra.json", help="JSON results (default: results/astra.json)")
    p.add_argument("--keep", metavar="DIR", help="write the trace, plans, ET and logs under DIR and keep them")
    return p.parse_args(argv)


def find_binary(arg: str | None, env=os.environ) -> str | None:
    """The ASTRA-sim binary: --astra-bin, else $ASTRA_SIM_BIN; None when neither is set."""
    value = arg or env.get(ENV_BIN)
    return value or None


def parse_astra_output(text: str) -> dict[int, tuple[int, int]]:
    """{rank: (finish tick, exposed communication ticks)} from the workload layer's "sys[N] finished" lines."""
    out = {}
    for m in FINISHED.finditer(text):
        out[int(m.group(1))] = (int(m.group(2)), int(m.group(3)))
    return out


def simulated_summary(ranks: dict[int, tuple[int, int]], expected: int) -> dict:
    """Simulated time (the last rank's finish), refusing output that does not cover every rank."""
    if sorted(ranks) != list(range(expected)):
        missing = sorted(set(range(expected)) - set(ranks))
        raise BenchError(f"ASTRA-sim reported {len(ranks)} of {expected} ranks finished (missing {missing[:8]})")
    finish = [ranks[r][0] for r in range(expected)]
    return {
        "simulated_ns": max(finish),
        "simulated_ms": max(finish) / 1e6,
        "mean_rank_ns": sum(finish) / expected,
        "rank_finish_ns": finish,
        "rank_exposed_comm_ns": [ranks[r][1] for r in range(expected)],
    }


def locus(*args: str, timeout: float = 1200) -> str:
    done = subprocess.run([sys.executable, "-m", "locus.cli", *args], capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise BenchError(f"locus {' '.join(args)} failed:\n{done.stderr}")
    return done.stdout


def run_astra(binary: str, prefix: Path, ranks: int, timeout: float) -> dict:
    from locus.routing.replay.astra_config import AstraFiles, astra_command

    files = AstraFiles(network=Path(f"{prefix}.network.yml"), system=Path(f"{prefix}.system.json"),
                       remote_memory=Path(f"{prefix}.memory.json"))
    argv = astra_command(binary, prefix, files, logging_folder=prefix.parent / f"{prefix.name}.log")
    t0 = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=prefix.parent)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise BenchError(f"ASTRA-sim exited {done.returncode}: {' '.join(argv)}\n{(done.stdout + done.stderr)[-2000:]}")
    result = simulated_summary(parse_astra_output(done.stdout + done.stderr), ranks)
    result["astra_wall_s"] = round(wall, 2)
    return result


def default_slots(num_experts: int, ranks: int) -> int:
    return max(3, -(-num_experts // ranks) + 1)


def run_topology(args, binary: str, work: Path, trace: Path, shape: str, num_experts: int, plans: list[str]) -> list[dict]:
    nodes, gpus = (int(x) for x in shape.lower().split("x"))
    ranks = nodes * gpus
    slots = args.slots or default_slots(num_experts, ranks)
    half = args.requests // 2
    out = []
    for name in plans:
        planner, assign = ("locality", "grouper") if name == "locality+grouper" else (name, "balanced")
        plan = work / f"{shape}_plan_{planner}.json"
        if not plan.exists():
            cap = ["--expert-cap", str(args.expert_cap)] if args.expert_cap and planner == "locality" else []
            locus("plan", str(trace), "--topology", shape, "--slots", str(slots), "--planner", planner,
                  "--requests", f"0:{half}", "-o", str(plan), *cap)
        prefix = work / f"{shape}_{name.replace('+', '_')}" / "et"
        report = work / f"{shape}_replay_{name.replace('+', '_')}.json"
        locus("replay", str(trace), "--plan", str(plan), "--requests", f"{half}:{args.requests}", "--assign", assign,
              "--batch-tokens", str(args.batch_tokens), "--intra-gbps", str(args.intra_gbps),
              "--inter-gbps", str(args.inter_gbps), "--json", str(report), "--chakra", str(prefix))
        rep = json.loads(report.read_text())
        row = {"plan": name, "topology": shape, "gpus": ranks, "slots": slots,
               "inter_node_bytes": rep["inter_node_bytes"], "intra_node_bytes": rep["intra_node_bytes"],
               "steps": rep["steps"], "locus_a2a_ms": rep["a2a_seconds"] * 1e3}
        print(f"  {shape} {name}: replayed, running ASTRA-sim ...", file=sys.stderr, flush=True)
        row.update(run_astra(binary, prefix, ranks, args.timeout))
        out.append(row)
        if not args.keep:
            shutil.rmtree(prefix.parent, ignore_errors=True)
    return out


def print_table(rows: list[dict]) -> None:
    print("| plan | GPUs | inter-node GiB | intra-node GiB | Locus a2a est. (ms) | ASTRA-sim simulated (ms) |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['plan']} | {r['gpus']} ({r['topology']}) | {r['inter_node_bytes'] / 2**30:.3f} | "
              f"{r['intra_node_bytes'] / 2**30:.3f} | {r['locus_a2a_ms']:.2f} | {r['simulated_ms']:.2f} |")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    binary = find_binary(args.astra_bin)
    if binary is None:
        print(f"{PROG}: skipped: no ASTRA-sim binary (give --astra-bin or set {ENV_BIN}; "
              "tools/build_astra_sim.sh builds one, docs/interop.md)")
        return 0
    if not (Path(binary).is_file() and os.access(binary, os.X_OK)):
        print(f"{PROG}: {binary} is not an executable file", file=sys.stderr)
        return 2
    plans = [p.strip() for p in args.plans.split(",") if p.strip()]
    unknown = sorted(set(plans) - set(PLANS))
    if unknown:
        print(f"{PROG}: unknown plan(s) {unknown}; choose from {', '.join(PLANS)}", file=sys.stderr)
        return 2
    from locus.traces.presets import preset_config

    num_experts = preset_config(args.preset).num_experts
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="locus-astra-"))
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    try:
        trace = work / "trace"
        if not trace.exists():
            locus("trace", "synth", "--preset", args.preset, "--requests", str(args.requests), "--seed",
                  str(args.seed), "-o", str(trace), "--quiet")
        for shape in [s.strip() for s in args.topologies.split(",") if s.strip()]:
            rows += run_topology(args, binary, work, trace, shape, num_experts, plans)
    except BenchError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 1
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print_table(rows)
    doc = {
        "command": " ".join([PROG, *(argv if argv is not None else sys.argv[1:])]),
        "binary": binary, "preset": args.preset, "requests": args.requests, "seed": args.seed,
        "replayed_requests": f"{args.requests // 2}:{args.requests}", "planned_on": f"0:{args.requests // 2}",
        "batch_tokens": args.batch_tokens, "expert_cap": args.expert_cap, "intra_gbps": args.intra_gbps,
        "inter_gbps": args.inter_gbps,
        "machine": platform.platform(), "rows": rows,
    }
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
