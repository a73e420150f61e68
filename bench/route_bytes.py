"""What routing saves, measured through `locus route` (issue 56): four `locus serve --model mini` backends
(two nodes of two ranks, recording traces), a locality plan made from a mini recording of other
prompts (bench/route.py's), and held-out mini text sent through the router, part of it tagged with its
domain and the rest placed by the plan's prompt predictor. The backends' traces are merged with the
router's assignment log (`locus trace merge --route-log`) and replayed under the plan twice: with the
ranks the router chose (`--assign LOG`) and with round robin over the same requests
(`--assign round_robin`). The difference is what the routing saved: the same tokens, the same
placement, only the request-to-rank assignment differs.

    python bench/route_bytes.py --requests 240 --concurrency 8 --tagged 0.5 --out results/route_bytes.json

Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from route import MINI, bodies_of, make_plan, measure, start, start_router, stop, wait_healthy  # noqa: E402
from serve_lib.common import BenchError  # noqa: E402
from serve_lib.domain_text import DomainText  # noqa: E402
from serve_lib.raw_http import HttpTarget  # noqa: E402
from serve_lib.report import source_revision  # noqa: E402
from serve_lib.server import free_port  # noqa: E402
from serve_lib.table import print_table  # noqa: E402

PROG = "bench route_bytes"
FIGURES = ("inter_node_bytes", "intra_node_bytes", "tokens")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", default="2x2", help="NODESxGPUS of the plan: one mini backend per rank (default 2x2)")
    p.add_argument("--requests", type=int, default=240, help="requests sent through the router (default 240)")
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight (default 8)")
    p.add_argument("--input-len", type=int, default=48, help="prompt length in mini tokens (default 48)")
    p.add_argument("--output-len", type=int, default=16, help="new tokens per request, ignore_eos (default 16)")
    p.add_argument("--tagged", type=float, default=0.5, help="share of requests carrying their domain (default 0.5)")
    p.add_argument("--out", help="write the JSON here")
    p.add_argument("--keep-logs", metavar="DIR", help="write the processes' logs, traces and replays here")
    return p.parse_args(argv)


def locus(*args: str) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "locus.cli", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise BenchError(f"locus {' '.join(args[:2])} failed: {done.stderr.strip()[-2000:]}")
    return done


def replay(merged: Path, plan: Path, assign: str, out: Path) -> dict:
    locus("replay", str(merged), "--plan", str(plan), "--assign", assign, "--json", str(out))
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    import httpx

    args = parse_args(argv)
    nodes, gpus = (int(x) for x in args.backends.lower().split("x"))
    logs = Path(args.keep_logs or tempfile.mkdtemp(prefix="locus-bench-route-bytes-"))
    logs.mkdir(parents=True, exist_ok=True)
    loadavg = os.getloadavg()
    procs: list[subprocess.Popen] = []
    try:
        text = DomainText.load(MINI, None, args.input_len)
        plan = make_plan(logs, args.backends, text)
        urls = []
        for i in range(nodes * gpus):
            port = free_port()
            urls.append(f"http://127.0.0.1:{port}")
            procs.append(start(["serve", "--model", "mini", "--host", "127.0.0.1", "--port", str(port), "--log-level",
                                "warning", "--enable-trace-api", "--trace-dir", str(logs / f"traces-{i}")],
                               logs / f"backend-{i}.log"))
        for i, (url, proc) in enumerate(zip(urls, procs)):
            wait_healthy(url, proc, logs / f"backend-{i}.log")
        route_log = logs / "route.jsonl"
        router, router_url = start_router(plan, urls, logs, procs, ["--assignment-log", str(route_log)])
        for url in urls:
            httpx.post(f"{url}/traces/start", json={"path": "routed"}, timeout=30).raise_for_status()
        bodies = bodies_of(text, args.requests, args.output_len, args.tagged, 0)
        report, _, _ = measure([HttpTarget.of(f"{router_url}/v1/completions")], bodies, args.concurrency, 600, None, [])
        traces = []
        for url in urls:
            dumped = httpx.post(f"{url}/traces/dump", timeout=60)
            dumped.raise_for_status()
            traces.append(dumped.json()["path"])
    except BenchError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    finally:
        for proc in reversed(procs):
            stop(proc)
    try:
        merged = logs / "merged"
        locus("trace", "merge", *traces, "-o", str(merged), "--route-log", str(route_log))
        figures = {"router": replay(merged, plan, str(route_log), logs / "replay-router.json"),
                   "round_robin": replay(merged, plan, "round_robin", logs / "replay-round_robin.json")}
    except BenchError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    admitted = [json.loads(line) for line in route_log.read_text().splitlines()[1:]]
    how = {}
    for event in admitted:
        if event.get("event") == "admit":
            how[event["how"]] = how.get(event["how"], 0) + 1
    router_fig, rr = figures["router"], figures["round_robin"]
    saved = {k: (1 - router_fig[k] / rr[k]) if rr[k] else None for k in ("inter_node_bytes", "intra_node_bytes")}
    print_table(("assignment", "inter-node bytes", "intra-node bytes", "tokens"),
                [(name, f"{f['inter_node_bytes']:,}", f"{f['intra_node_bytes']:,}", f"{f['tokens']:,}")
                 for name, f in figures.items()]
                + [("router against round robin", f"{-100 * saved['inter_node_bytes']:+.1f}%",
                    f"{-100 * saved['intra_node_bytes']:+.1f}%", "")])
    print(f"{report.successful} requests, {report.failed} failed; admissions by reason: {how}")
    if args.out:
        result = {"bench": "route_bytes", "args": vars(args), "requests": report.successful, "failed": report.failed,
                  "admissions": how, "figures": {n: {k: f[k] for k in FIGURES} for n, f in figures.items()},
                  "saved": saved, "machine": {"cpus": os.cpu_count(), "loadavg_before": loadavg,
                                              "loadavg_after": os.getloadavg()},
                  "source": source_revision()}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
