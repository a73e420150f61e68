"""Elastic expert parallelism, measured: a live re-plan after the workload's domain mix shifts, and the
loss of a rank mid-stream.

(a) Shift. A locality plan made from mix A (mostly `code`) serves `small` on 4 ranks as 2x2 with
--replan-api. Phase 1 serves mix A, phase 2 mix B (`math` and `chat`), then POST /ep/replan moves the
placement while mix-B streams decode, and phase 3 serves mix B again. Printed: inter-node bytes per
token of each phase (measured by the ranks), the bytes the move sent, the largest gap a client saw
between two tokens during the move; and, for reference, the replay of phase 3's requests under a plan
made offline from mix B (`locus plan` on a mix-B trace, the plan's grouper assigning): the live
re-plan should land within 10% of it.

(b) Loss. --ep-elastic on 4 ranks, 16 streams decoding; one rank is SIGKILLed. Printed: requests
completed and lost (errors), every stream's longest wait for a token from the kill on (the failed
iteration, the regroup, the re-admitted requests' recompute), and the server's own regrouping time.

    python bench/ep_elastic.py --out results/ep_elastic.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from ep import locus, record_planning_trace, workload
from serve_lib.server import free_port, start_server, stop_server, wait_until_ready
from serve_lib.table import print_table

PROG = "bench/ep_elastic.py"
MIX_A = ("code", "code", "code", "chat")
MIX_B = ("math", "chat", "math", "chat")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small")
    p.add_argument("--slots", type=int, default=6)
    p.add_argument("--requests", type=int, default=32, help="requests per phase (default 32)")
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--kill-streams", type=int, default=16)
    p.add_argument("--kill-output-len", type=int, default=96)
    p.add_argument("--parts", default="shift,loss")
    p.add_argument("--out")
    p.add_argument("--keep", action="store_true")
    return p.parse_args(argv)


def stream(base: str, family: str, prompt: str, tokens: int) -> dict:
    """One greedy stream: its tokens, the time of each, and whether it ended in an error."""
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    times, error, usage = [], None, None
    with httpx.stream("POST", f"{base}/v1/completions", json=body, headers={"x-locus-domain": family}, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                error = chunk["error"]["message"]
                break
            if chunk.get("usage"):
                usage = chunk["usage"]
            if chunk.get("choices"):
                times.append(time.monotonic())
    return {"times": times, "error": error, "tokens": usage["completion_tokens"] if usage else 0}


def run_phase(base: str, jobs: list[tuple[str, str]], tokens: int, concurrency: int) -> list[dict]:
    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(lambda job: stream(base, job[0], job[1], tokens), jobs))


def ep_stats(base: str) -> dict:
    return httpx.get(f"{base}/ep/stats", timeout=30).json()


def per_token(after: dict, before: dict) -> float:
    return (after["inter_node_bytes"] - before["inter_node_bytes"]) / max(1, after["tokens"] - before["tokens"])


def launch(args, work: Path, name: str, *flags: str):
    port = free_port()
    cmd = [sys.executable, "-m", "locus.cli", "serve", "--model", args.model, "--ep-ranks", "4", "--gpus-per-node", "2",
           "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", *flags]
    server = start_server(cmd, threads=1, log_path=str(work / f"{name}.log"))
    base = f"http://127.0.0.1:{port}"
    with httpx.Client(timeout=10.0, trust_env=False) as client:
        wait_until_ready(client, base, 300.0, server.proc, str(work / f"{name}.log"))
    return server, base


def shift(args, work: Path) -> dict:
    record_planning_trace(args.model, work / "trace-a", 48, args.output_len, families=MIX_A)
    record_planning_trace(args.model, work / "trace-b", 48, args.output_len, families=MIX_B)
    topo = ["--topology", "2x2", "--slots", str(args.slots), "--planner", "locality"]
    locus("plan", str(work / "trace-a"), *topo, "-o", str(work / "plan-a.json"))
    locus("plan", str(work / "trace-b"), *topo, "-o", str(work / "plan-b.json"))
    trace = work / "served"
    server, base = launch(args, work, "shift", "--plan", str(work / "plan-a.json"), "--replan-api",
                          "--record-trace", str(trace), "--replan-window", "2048")
    try:
        s0 = ep_stats(base)
        run_phase(base, workload(args.requests, 0, MIX_A), args.output_len, args.concurrency)
        s1 = ep_stats(base)
        run_phase(base, workload(args.requests, 1000, MIX_B), args.output_len, args.concurrency)
        s2 = ep_stats(base)
        with ThreadPoolExecutor(args.concurrency + 1) as pool:  # mix-B streams decode through the move
            during = [pool.submit(stream, base, f, p, args.output_len * 3) for f, p in workload(args.concurrency, 2000, MIX_B)]
            time.sleep(1.0)
            decision = httpx.post(f"{base}/ep/replan", json={"force": True}, timeout=600).json()
            moved_during = [f.result() for f in during]
        while ep_stats(base)["replan"]["state"] != "idle":
            time.sleep(0.2)
        s3 = ep_stats(base)
        phase3 = run_phase(base, workload(args.requests, 3000, MIX_B), args.output_len, args.concurrency)
        s4 = ep_stats(base)
    finally:
        stop_server(server, grace=120.0)
    total_requests = 3 * args.requests + args.concurrency
    first3 = total_requests - args.requests
    reference = work / "reference.json"
    locus("replay", str(trace), "--plan", str(work / "plan-b.json"), "--requests", f"{first3}:{total_requests}",
          "--assign", "grouper", "--json", str(reference))
    offline = json.loads(reference.read_text())
    gaps = [max(b - a for a, b in zip(r["times"], r["times"][1:])) for r in moved_during if len(r["times"]) > 1]
    result = {
        "phase1_mix_a": per_token(s1, s0), "phase2_mix_b_stale_plan": per_token(s2, s1),
        "phase3_mix_b_live_replan": per_token(s4, s3), "offline_plan_for_mix_b": offline["inter_node_bytes_per_token"],
        "decision": decision, "moved": s4["replan"]["moved"], "max_gap_during_move_s": max(gaps) if gaps else None,
        "errors": sum(1 for r in moved_during + phase3 if r["error"]),
    }
    result["live_vs_offline"] = result["phase3_mix_b_live_replan"] / max(result["offline_plan_for_mix_b"], 1e-9) - 1
    return result


def loss(args, work: Path) -> dict:
    server, base = launch(args, work, "loss", "--ep-elastic")
    try:
        jobs = workload(args.kill_streams, 5000)
        with ThreadPoolExecutor(args.kill_streams) as pool:
            futures = [pool.submit(stream, base, f, p, args.kill_output_len) for f, p in jobs]
            time.sleep(2.0)
            victim = rank_pid(server.proc.pid, 2)
            killed = time.monotonic()
            os.kill(victim, signal.SIGKILL)
            results = [f.result() for f in futures]
        stats = ep_stats(base)
    finally:
        stop_server(server, grace=120.0)
    gaps = []  # per stream: its longest wait for a token from the kill on (the last token before it, or the kill)
    for r in results:
        before = [t for t in r["times"] if t <= killed]
        after = [t for t in r["times"] if t > killed]
        points = (before[-1:] or [killed]) + after
        if after:
            gaps.append(max(b - a for a, b in zip(points, points[1:])))
    return {"streams": len(results), "completed": sum(1 for r in results if not r["error"] and r["tokens"] == args.kill_output_len),
            "lost": sum(1 for r in results if r["error"]), "recovery_gap_max_s": max(gaps), "recovery_gap_p50_s":
            sorted(gaps)[len(gaps) // 2], "server_regroup_s": stats["recoveries"][0]["seconds"] if stats["recoveries"] else None,
            "readmitted": stats["recoveries"][0]["readmitted"] if stats["recoveries"] else 0}


def rank_pid(parent: int, rank: int) -> int:
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":\t", 1) for line in status.read_text().splitlines() if ":\t" in line)
            if fields.get("PPid", "").strip() != str(parent):
                continue
            environ = (status.parent / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ:
            return int(status.parent.name)
    raise SystemExit(f"{PROG}: no rank {rank} among the server's processes")


def main(argv=None) -> int:
    args = parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    work = Path(tempfile.mkdtemp(prefix="locus-bench-elastic-"))
    print(f"{PROG}: {args.model} on 2x2 ranks; work dir {work}", flush=True)
    out = {}
    if "shift" in parts:
        out["shift"] = r = shift(args, work)
        print_table(("phase", "inter-node B/token"), [
            ("1: mix A, plan for A", f"{r['phase1_mix_a']:.1f}"), ("2: mix B, plan for A", f"{r['phase2_mix_b_stale_plan']:.1f}"),
            ("3: mix B, after the live re-plan", f"{r['phase3_mix_b_live_replan']:.1f}"),
            ("reference: replay under a plan made offline for B", f"{r['offline_plan_for_mix_b']:.1f}")])
        print(f"live vs offline: {100 * r['live_vs_offline']:+.1f}%; the move filled {r['moved']['experts']} slots, "
              f"{r['moved']['inter_node_bytes'] + r['moved']['intra_node_bytes']:,} bytes; the largest gap between two "
              f"tokens of a stream during it: {r['max_gap_during_move_s']:.3f} s; stream errors: {r['errors']}", flush=True)
    if "loss" in parts:
        out["loss"] = r = loss(args, work)
        print(f"SIGKILL of rank 2 of 4: {r['completed']}/{r['streams']} streams completed, {r['lost']} lost; "
              f"recovery gap max {r['recovery_gap_max_s']:.2f} s (p50 {r['recovery_gap_p50_s']:.2f} s); the server "
              f"regrouped in {r['server_regroup_s']:.2f} s and re-admitted {r['readmitted']} requests", flush=True)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"bench": "ep_elastic", "args": vars(args), "machine": {
            "cpus": os.cpu_count(), "python": platform.python_version()}, **out}, indent=1) + "\n")
        print(f"wrote {args.out}")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    ok = all(part.get("errors", 0) == 0 and part.get("lost", 0) == 0 for part in out.values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
