"""A third-party load tool through `locus route` (issue 56): guidellm against the router in front of four
`locus serve --model mini` backends (two nodes of two ranks, a locality plan made from a mini
recording, as bench/route.py makes it), then its figures checked against the backends' own counters.

    python bench/route_load_tool.py --guidellm /tmp/loadtool/bin/guidellm --requests 200 --concurrency 16 \
        --out results/route_guidellm.json

guidellm is not in the lock (`python3 -m venv /tmp/loadtool && /tmp/loadtool/bin/pip install guidellm`);
this script runs its command line as docs/load_tools.md gives it, with --backend's target the router,
and reads the JSON report it writes. What must hold: the tool saw 0 errored and 0 incomplete
requests, and its prompt and output token totals equal the sums of the backends'
`locus_prompt_tokens_total` and `locus_generation_tokens_total` over the run (the router's
`locus_route_requests_total` gives how many each backend was sent). Exit 0 when they hold, 1 when
not, 2 when the run could not be made. Prints a table, writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from route import MINI, make_plan, start, start_router, stop, wait_healthy  # noqa: E402
from serve_lib.common import BenchError  # noqa: E402
from serve_lib.domain_text import DomainText  # noqa: E402
from serve_lib.report import source_revision  # noqa: E402
from serve_lib.server import free_port  # noqa: E402
from serve_lib.table import print_table  # noqa: E402

PROG = "bench route_load_tool"
COUNTERS = ("locus_prompt_tokens_total", "locus_generation_tokens_total", "locus_request_success_total")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--guidellm", default="guidellm", help="the guidellm executable (default: guidellm on PATH)")
    p.add_argument("--backends", default="2x2", help="NODESxGPUS of the plan: one mini backend per rank (default 2x2)")
    p.add_argument("--requests", type=int, default=200, help="requests guidellm sends (default 200)")
    p.add_argument("--concurrency", type=int, default=16, help="guidellm's concurrent streams (default 16)")
    p.add_argument("--prompt-tokens", type=int, default=128, help="synthetic prompt length (default 128)")
    p.add_argument("--output-tokens", type=int, default=64, help="output tokens per request (default 64)")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                   help="the endpoint guidellm posts to (default completions: its prompt count is the text's)")
    p.add_argument("--out", help="write the JSON here")
    p.add_argument("--keep-logs", metavar="DIR", help="write the processes' logs and guidellm's report here")
    return p.parse_args(argv)


def counters(url: str) -> dict[str, float]:
    """The backend's COUNTERS from its /metrics."""
    import httpx

    out = dict.fromkeys(COUNTERS, 0.0)
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in out:
            out[name] += float(line.rsplit(" ", 1)[1])
    return out


def routed(router_url: str) -> dict[str, float]:
    """locus_route_requests_total per backend URL from the router's /metrics."""
    import httpx

    out = {}
    for line in httpx.get(f"{router_url}/metrics", timeout=10).text.splitlines():
        if line.startswith("locus_route_requests_total{"):
            backend = line.split('backend="', 1)[1].split('"', 1)[0]
            out[backend] = out.get(backend, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def guidellm_command(args: argparse.Namespace, target: str, report: Path) -> list[str]:
    backend = f"kind=openai_http,target={target},model=mini"
    if args.endpoint == "completions":
        backend += ",request_format=/v1/completions"
    return [args.guidellm, "run", "--backend", backend,
            "--tokenizer", f"kind=huggingface_auto,model={MINI}",
            "--data", f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},output_tokens={args.output_tokens}",
            "--profile", f"kind=concurrent,streams={args.concurrency}",
            "--constraint", f"kind=max_requests,count={args.requests}",
            "--output", f"kind=json,path={report}", "--disable-progress"]


def tool_totals(report: Path) -> dict:
    """Requests by status and the prompt / output token totals of the successful ones, from guidellm's
    JSON report (one benchmark: the concurrent profile)."""
    data = json.loads(report.read_text())
    benchmarks = data["benchmarks"]
    if len(benchmarks) != 1:
        raise BenchError(f"{report}: expected one benchmark, found {len(benchmarks)}")
    requests = benchmarks[0]["requests"]
    out = {status: len(requests.get(status) or []) for status in ("successful", "errored", "incomplete")}
    ok = requests.get("successful") or []
    out["prompt_tokens"] = sum(int(r["prompt_tokens"] or 0) for r in ok)
    out["output_tokens"] = sum(int(r["output_tokens"] or 0) for r in ok)
    out["errors"] = sorted({str(r.get("info", {}).get("error") or r.get("error")) for r in requests.get("errored") or []})[:5]
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if shutil.which(args.guidellm) is None:
        print(f"{PROG}: error: no guidellm at {args.guidellm!r}: install it in a venv of its own "
              "(python3 -m venv /tmp/loadtool && /tmp/loadtool/bin/pip install guidellm) and pass --guidellm",
              file=sys.stderr)
        return 2
    nodes, gpus = (int(x) for x in args.backends.lower().split("x"))
    logs = Path(args.keep_logs or tempfile.mkdtemp(prefix="locus-bench-route-tool-"))
    logs.mkdir(parents=True, exist_ok=True)
    loadavg = os.getloadavg()
    procs: list[subprocess.Popen] = []
    try:
        plan = make_plan(logs, args.backends, DomainText.load(MINI, None, 48))
        urls = []
        for i in range(nodes * gpus):
            port = free_port()
            urls.append(f"http://127.0.0.1:{port}")
            procs.append(start(["serve", "--model", "mini", "--host", "127.0.0.1", "--port", str(port), "--log-level",
                                "warning"], logs / f"backend-{i}.log"))
        for i, (url, proc) in enumerate(zip(urls, procs)):
            wait_healthy(url, proc, logs / f"backend-{i}.log")
        router, router_url = start_router(plan, urls, logs, procs)
        before = [counters(u) for u in urls]
        report = logs / "guidellm.json"
        command = guidellm_command(args, router_url, report)
        print(f"{PROG}: {' '.join(command)}", file=sys.stderr)
        began = time.monotonic()
        with open(logs / "guidellm.log", "w") as out:
            done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, cwd=logs)
        seconds = time.monotonic() - began
        if done.returncode != 0 or not report.is_file():
            raise BenchError(f"guidellm exited {done.returncode}: {(logs / 'guidellm.log').read_text()[-2000:]}")
        after = [counters(u) for u in urls]
        sent = routed(router_url)
    except BenchError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    finally:
        for proc in reversed(procs):
            stop(proc)
    tool = tool_totals(report)
    per_backend = [{"url": u, "routed": sent.get(u, 0.0), **{k: a[k] - b[k] for k in COUNTERS}}
                   for u, b, a in zip(urls, before, after)]
    served = {k: sum(b[k] for b in per_backend) for k in COUNTERS}
    checks = {
        "no errors": tool["errored"] == 0 and tool["incomplete"] == 0,
        "prompt tokens equal": tool["prompt_tokens"] == served["locus_prompt_tokens_total"],
        "output tokens equal": tool["output_tokens"] == served["locus_generation_tokens_total"],
        "requests equal": tool["successful"] == served["locus_request_success_total"] == sum(sent.values()),
    }
    print_table(("backend", "requests routed", "requests served", "prompt tokens", "output tokens"),
                [(b["url"], f"{b['routed']:.0f}", f"{b['locus_request_success_total']:.0f}",
                  f"{b['locus_prompt_tokens_total']:.0f}", f"{b['locus_generation_tokens_total']:.0f}")
                 for b in per_backend]
                + [("backends' sum", f"{sum(sent.values()):.0f}", f"{served['locus_request_success_total']:.0f}",
                    f"{served['locus_prompt_tokens_total']:.0f}", f"{served['locus_generation_tokens_total']:.0f}"),
                   ("guidellm", "-", f"{tool['successful']} ok, {tool['errored']} errored, {tool['incomplete']} incomplete",
                    str(tool["prompt_tokens"]), str(tool["output_tokens"]))])
    print()
    print_table(("check", "holds"), [(k, "yes" if v else "NO") for k, v in checks.items()])
    if args.out:
        result = {"bench": "route_load_tool", "args": vars(args), "command": command, "seconds": seconds,
                  "tool": tool, "backends": per_backend, "served": served, "checks": checks,
                  "machine": {"cpus": os.cpu_count(), "loadavg_before": loadavg, "loadavg_after": os.getloadavg()},
                  "source": source_revision()}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
