"""The server event loop's CPU per streamed token and per request, for one or more source trees side by side.

    python bench/serve_cpu.py --src /path/to/old/checkout --src . --pairs 3

For each tree in turn (alternating, --pairs times) it starts `locus serve --model small` from that
tree, pinned with the load client to one core (--core) with one torch thread, and reads the main
(event-loop) thread's CPU time from /proc/PID/task/PID/schedstat around two bench/serve.py runs:
64 requests x 2 tokens and 64 x 64 (concurrency 32). The difference divided by 64 x 62 is the CPU
per streamed token; what is left of the short run, per request. Linux only.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent


def loop_cpu_s(pid: int) -> float:
    return int(Path(f"/proc/{pid}/task/{pid}/schedstat").read_text().split()[0]) / 1e9


def measure(src: str, core: str, port: int, runs: int, seed: int) -> tuple[float, float]:
    env = dict(os.environ, PYTHONPATH=src, OMP_NUM_THREADS="1")
    server = subprocess.Popen(["taskset", "-c", core, sys.executable, "-m", "locus.cli", "serve", "--model", "small",
                               "--host", "127.0.0.1", "--port", str(port), "--max-num-seqs", "256",
                               "--max-num-batched-tokens", "2048", "--kv-cache-memory", "1GiB", "--seed", "0"],
                              env=env, cwd=src, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(300):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
                break
            except OSError:
                time.sleep(1)
        cpu = {2: [], 64: []}
        for r in range(runs):
            for out_len in (2, 64):
                before = loop_cpu_s(server.pid)
                subprocess.run(["taskset", "-c", core, sys.executable, str(HERE / "serve.py"), "--base-url",
                                f"http://127.0.0.1:{port}", "--model", "small", "--num-prompts", "64", "--input-len", "64",
                                "--output-len", str(out_len), "--concurrency", "32", "--request-rate", "inf", "--warmup", "0",
                                "--seed", str(seed + r), "--out", os.devnull], check=True, capture_output=True,
                               env=dict(os.environ, OMP_NUM_THREADS="1"))
                cpu[out_len].append(loop_cpu_s(server.pid) - before)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)
    short, long = statistics.median(cpu[2]), statistics.median(cpu[64])
    per_token = (long - short) / (64 * 62)
    return per_token, (short - 64 * 2 * per_token) / 64


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", action="append", required=True, help="a source checkout (repeat to compare)")
    ap.add_argument("--pairs", type=int, default=3, help="alternations over the trees")
    ap.add_argument("--runs", type=int, default=3, help="load runs of each length per measurement")
    ap.add_argument("--core", default="0")
    ap.add_argument("--port", type=int, default=18980)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    results: dict[str, list[tuple[float, float]]] = {src: [] for src in args.src}
    for pair in range(args.pairs):
        for src in args.src:
            results[src].append(measure(str(Path(src).resolve()), args.core, args.port, args.runs, seed=100 * pair))
            print(f"pair {pair + 1} {src}: {results[src][-1][0] * 1e6:.1f} us/token, {results[src][-1][1] * 1e3:.2f} ms/request",
                  flush=True)
    print("| source | loop CPU per streamed token (us) | per request (ms) |\n|---|---|---|")
    for src, rows in results.items():
        tok, req = [r[0] * 1e6 for r in rows], [r[1] * 1e3 for r in rows]
        print(f"| {src} | {statistics.median(tok):.1f} ({min(tok):.1f}-{max(tok):.1f}) | {statistics.median(req):.2f} |")
    if args.out:
        Path(args.out).write_text(json.dumps({src: [{"us_per_token": t * 1e6, "ms_per_request": q * 1e3} for t, q in rows]
                                              for src, rows in results.items()}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
