"""What `locus route` adds to one request's TTFT, request by request: the setup of bench/route.py (four
`locus serve --model mini` backends as 2x2 behind the router, a locality plan from a mini recording),
one client sending each prompt twice back to back, once straight to a backend (round robin) and once
through the router, the order flipping from pair to pair. Each pair saw the same machine within a
fraction of a second, so on a machine whose load drifts the per-pair differences are steadier than
bench/route.py's per-round ones; bench/route.py stays the measure of throughput.

    python bench/route_pairs.py --pairs 200 --output-len 16 --out results/route_pairs.json

Prints the median TTFT of each target, the median and quartiles of the per-pair difference, and the
router's own time on each first token (its locus_route_overhead_seconds histogram); writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from route import (MINI, bodies_of, make_plan, overhead_between, overhead_snapshot, start, start_router, stop,  # noqa: E402
                   wait_healthy)
from serve_lib.common import BenchError  # noqa: E402
from serve_lib.domain_text import DomainText  # noqa: E402
from serve_lib.load import run_on_fastest_loop, settle  # noqa: E402
from serve_lib.raw_http import HttpTarget, send_request_raw  # noqa: E402
from serve_lib.report import source_revision  # noqa: E402
from serve_lib.server import free_port  # noqa: E402
from serve_lib.table import print_table  # noqa: E402

PROG = "bench route_pairs"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", default="2x2", help="NODESxGPUS of the plan: one mini backend per rank (default 2x2)")
    p.add_argument("--pairs", type=int, default=200, help="prompts, each sent to both targets (default 200)")
    p.add_argument("--input-len", type=int, default=48, help="prompt length in mini tokens (default 48)")
    p.add_argument("--output-len", type=int, default=16, help="new tokens per request, ignore_eos (default 16)")
    p.add_argument("--tagged", type=float, default=0.5, help="share of requests carrying their domain (default 0.5)")
    p.add_argument("--out", help="write the JSON here")
    p.add_argument("--keep-logs", metavar="DIR", help="write the processes' logs here (default: a temp dir)")
    return p.parse_args(argv)


async def send_pairs(direct: list[HttpTarget], routed: HttpTarget, bodies: list[dict]) -> list[tuple[float, float]]:
    """(direct TTFT, router TTFT) in ms per body, one request at a time; a failure raises BenchError."""
    out = []
    for i, body in enumerate(bodies):
        order = ("direct", "router") if i % 2 == 0 else ("router", "direct")
        got = {}
        for target in order:
            recorded = await send_request_raw(direct[i % len(direct)] if target == "direct" else routed, body, False,
                                              None)
            result = settle(recorded)
            if not result.ok:
                raise BenchError(f"request {i} to the {target} failed: {result.error}")
            got[target] = 1000 * result.ttft
        out.append((got["direct"], got["router"]))
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    nodes, gpus = (int(x) for x in args.backends.lower().split("x"))
    logs = Path(args.keep_logs or tempfile.mkdtemp(prefix="locus-bench-route-pairs-"))
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
                                "warning"], logs / f"backend-{i}.log"))
        for i, (url, proc) in enumerate(zip(urls, procs)):
            wait_healthy(url, proc, logs / f"backend-{i}.log")
        router, router_url = start_router(plan, urls, logs, procs)
        direct = [HttpTarget.of(f"{u}/v1/completions") for u in urls]
        routed = HttpTarget.of(f"{router_url}/v1/completions")
        run_on_fastest_loop(send_pairs(direct, routed, bodies_of(text, 2 * len(urls), 4, args.tagged, 10_000)))
        before = overhead_snapshot(router_url)
        pairs, _ = run_on_fastest_loop(send_pairs(direct, routed, bodies_of(text, args.pairs, args.output_len,
                                                                           args.tagged, 0)))
        own = overhead_between(before, overhead_snapshot(router_url))
    except BenchError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    finally:
        for proc in reversed(procs):
            stop(proc)
    ttft, summary = summarise_pairs(pairs, own)
    print_table(("pairs", "TTFT p50 direct ms", "TTFT p50 router ms", "added ms p50 (per pair)", "added p25 / p75",
                 "router's own ms p50"),
                [(str(summary["pairs"]), f"{summary['ttft_p50_ms_direct']:.2f}", f"{summary['ttft_p50_ms_router']:.2f}",
                  f"{summary['added_ms_p50']:+.2f}", f"{summary['added_ms_p25']:+.2f} / {summary['added_ms_p75']:+.2f}",
                  f"{summary['router_own_ms_p50']:.3f}" if summary["router_own_ms_p50"] is not None else "-")])
    if args.out:
        write_pairs(args.out, "route_pairs", args, summary, ttft, loadavg, os.getloadavg())
    return 0


def summarise_pairs(pairs: list, own: dict | None) -> tuple[np.ndarray, dict]:
    """Per-pair TTFTs [P, 2] (direct, router) in ms and their summary: each target's median, the
    per-pair difference's median and quartiles, the router's own time on first tokens (`own`)."""
    ttft = np.array(pairs)
    added = ttft[:, 1] - ttft[:, 0]
    return ttft, {"pairs": len(pairs), "ttft_p50_ms_direct": float(np.median(ttft[:, 0])),
                  "ttft_p50_ms_router": float(np.median(ttft[:, 1])), "added_ms_p50": float(np.median(added)),
                  "added_ms_p25": float(np.percentile(added, 25)), "added_ms_p75": float(np.percentile(added, 75)),
                  "router_own_ms_p50": own["p50"] if own else None, "router_own_ms_mean": own["mean"] if own else None}


def write_pairs(path: str, bench: str, args: argparse.Namespace, summary: dict, ttft: np.ndarray,
                loadavg_before, loadavg_after) -> None:
    result = {"bench": bench, "args": vars(args), "summary": summary, "pairs_ms": ttft.tolist(),
              "machine": {"cpus": os.cpu_count(), "loadavg_before": loadavg_before, "loadavg_after": loadavg_after},
              "source": source_revision()}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
