"""What `locus route` costs: the same load sent to four `locus serve --model mini` backends (two nodes of
two data-parallel ranks, behind a locality plan made from a mini recording) through the router, and
directly in round robin, side by side: the two targets alternate within every round (their order
flips from round to round), on the same backends, with the same prompts. Prints a table, writes JSON.

    python bench/route.py --concurrency 1,16 --rounds 3 --num-prompts 64 --output-len 32 --out results/route.json

Issue 56's targets: the router adds at most 1 ms to TTFT at p50, and keeps at least 95% of the direct
output throughput. Beside the side-by-side TTFT difference the table gives the router's own time on
each stream's first token (its `locus_route_overhead_seconds` histogram: reading, tokenizing,
admitting, writing the request to the backend's socket; then reading the first chunk and handing it
on), which on a busy
machine is the part of the difference the router's code is responsible for, and the mean TTFT the
backends measured themselves (Locus's `locus_time_to_first_token_seconds`): what the engines saw. Prompts are held-out text of mini's domains (--input-len tokens), half of them tagged
with their domain (`"domain"` in the body), half untagged (placed by the plan's prompt predictor); the
backends ignore no tag (Locus records it). The load client is bench/serve.py's raw client (a connection
per request, reads recorded and parsed after the run), timing TTFT and throughput client-side.

On a small machine the client, the router and the four backends share the cores: the router's CPU is
taken from the backends' forward passes, which is what the throughput ratio measures.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from serve_lib.common import BenchError  # noqa: E402
from serve_lib.cpu import process_cpu_seconds  # noqa: E402
from serve_lib.domain_text import DomainText  # noqa: E402
from serve_lib.load import LoadReport, run_on_fastest_loop, settle, summarize  # noqa: E402
from serve_lib.raw_http import HttpTarget, send_request_raw  # noqa: E402
from serve_lib.report import source_revision  # noqa: E402
from serve_lib.server import free_port, wait_until_ready  # noqa: E402
from serve_lib.table import print_table  # noqa: E402

PROG = "bench route"
MINI = Path(__file__).resolve().parents[1] / "locus" / "assets" / "mini"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", default="2x2", help="NODESxGPUS of the plan: one mini backend per rank (default 2x2)")
    p.add_argument("--plan", help="a plan to use (default: one made here from a mini recording)")
    p.add_argument("--concurrency", default="1,16", help="comma-separated client widths, one run each (default 1,16)")
    p.add_argument("--rounds", type=int, default=3, help="rounds per width; each runs both targets (default 3)")
    p.add_argument("--num-prompts", type=int, default=64, help="requests per target per round (default 64)")
    p.add_argument("--input-len", type=int, default=48, help="prompt length in mini tokens (default 48)")
    p.add_argument("--output-len", type=int, default=32, help="new tokens per request, ignore_eos (default 32)")
    p.add_argument("--tagged", type=float, default=0.5, help="share of requests carrying their domain (default 0.5)")
    p.add_argument("--backend-threads", type=int, default=1, help="OMP_NUM_THREADS of each backend (default 1)")
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--out", default=None, help="write the JSON here")
    p.add_argument("--keep-logs", default=None, metavar="DIR", help="write the processes' logs here (default: a temp dir)")
    return p.parse_args(argv)


@dataclass
class Run:
    concurrency: int
    round: int
    target: str  # "direct" or "router"
    load: LoadReport
    router_cpu_s: float | None
    backends_cpu_s: float | None
    router_overhead_ms: dict | None = None  # the router's own time on the first token (its /metrics): p50, mean
    backend_ttft_ms: float | None = None  # mean TTFT the backends measured themselves (their /metrics)


def backend_ttft(urls: list[str]) -> tuple[float, float]:
    """(sum of seconds, count) of locus_time_to_first_token_seconds over the backends' /metrics."""
    import httpx

    total = count = 0.0
    for url in urls:
        for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
            if line.startswith("locus_time_to_first_token_seconds_sum"):
                total += float(line.rsplit(" ", 1)[1])
            elif line.startswith("locus_time_to_first_token_seconds_count"):
                count += float(line.rsplit(" ", 1)[1])
    return total, count


def overhead_snapshot(router_url: str) -> tuple[list[tuple[float, float]], float, float]:
    """locus_route_overhead_seconds from the router's /metrics: ([(le, cumulative count)], sum, count)."""
    import httpx

    buckets, total, count = [], 0.0, 0.0
    for line in httpx.get(f"{router_url}/metrics", timeout=10).text.splitlines():
        if line.startswith("locus_route_overhead_seconds_bucket"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            buckets.append((float("inf") if le == "+Inf" else float(le), float(line.rsplit(" ", 1)[1])))
        elif line.startswith("locus_route_overhead_seconds_sum"):
            total = float(line.rsplit(" ", 1)[1])
        elif line.startswith("locus_route_overhead_seconds_count"):
            count = float(line.rsplit(" ", 1)[1])
    return buckets, total, count


def overhead_between(before, after) -> dict | None:
    """The p50 (linear within its histogram bucket) and the mean of the observations between two snapshots, ms."""
    (b0, s0, c0), (b1, s1, c1) = before, after
    count = c1 - c0
    if count <= 0:
        return None
    cumulative = [(le, n1 - n0) for (le, n1), (_, n0) in zip(b1, b0)]
    lo_edge, lo_count = 0.0, 0.0
    p50 = None
    for le, n in cumulative:
        if n >= count / 2:
            top = le if le != float("inf") else lo_edge
            p50 = lo_edge + (top - lo_edge) * ((count / 2 - lo_count) / max(n - lo_count, 1e-9))
            break
        lo_edge, lo_count = le, n
    return {"p50": 1000 * p50 if p50 is not None else None, "mean": 1000 * (s1 - s0) / count}


# --- processes -------------------------------------------------------------------------------------
def start(args: list[str], log: Path, threads: int = 1) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "locus.cli", *args], stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "OMP_NUM_THREADS": str(threads)}, start_new_session=True)


def stop(proc: subprocess.Popen) -> None:
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
        except subprocess.TimeoutExpired:
            pass


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float = 300) -> None:
    import httpx

    with httpx.Client(timeout=2) as client:
        wait_until_ready(client, url, timeout, proc, str(log))


def start_router(plan: Path, urls: list[str], logs: Path, procs: list,
                 extra: list[str] = ()) -> tuple[subprocess.Popen, str]:
    """`locus route` under `plan` on a free port in front of the backends at `urls`, once healthy, and
    appended to `procs` (stopped with them); returns the process and its URL. `extra`: more route flags."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    router = start(["route", "--plan", str(plan), "--port", str(port), "--log-level", "warning", *extra,
                    *(arg for u in urls for arg in ("--backend", u))], logs / "router.log")
    procs.append(router)
    wait_healthy(url, router, logs / "router.log")
    return router, url


def make_plan(root: Path, topology: str, text: DomainText) -> Path:
    """A locality plan from a mini recording of the planning prompts (never the measured ones)."""
    from locus.engine.frontend.llm import LLM
    from locus.engine.sampling.sampler import SamplingParams

    llm = LLM("mini", seed=0)
    core = llm.engine
    trace = root / "planning"
    core.start_recording(trace, "mini")
    for i, (domain, prompt) in enumerate(text.take(8 * len(text.planning), 0, planning=True)):
        core.add_request(f"plan-{i}", llm.tokenizer.encode(prompt), SamplingParams(max_tokens=8, temperature=0),
                         domain=domain)
    while core.has_unfinished():
        core.step()
    core.dump_recording()
    plan = root / "plan.json"
    done = subprocess.run([sys.executable, "-m", "locus.cli", "plan", str(trace), "--topology", topology, "--planner",
                           "locality", "-o", str(plan)], capture_output=True, text=True)
    if done.returncode != 0:
        raise BenchError(f"locus plan failed: {done.stderr.strip()}")
    return plan


# --- the load ---------------------------------------------------------------------------------------
def bodies_of(text: DomainText, count: int, output_len: int, tagged: float, offset: int) -> list[dict]:
    out = []
    for i, (domain, prompt) in enumerate(text.take(count, offset)):
        body = {"model": "mini", "prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        if int((i + 1) * tagged) > int(i * tagged):  # the tagged share, spread evenly
            body["domain"] = domain
        out.append(body)
    return out


async def send_all(targets: list[HttpTarget], bodies: list[dict], width: int, timeout: float):
    """Every body, at most `width` in flight; request i to targets[i % len(targets)]. Returns
    (results, seconds)."""
    gate = asyncio.Semaphore(width)

    async def one(i: int, body: dict):
        async with gate:
            try:
                return await asyncio.wait_for(send_request_raw(targets[i % len(targets)], body, False, None), timeout)
            except asyncio.TimeoutError:
                from serve_lib.load import RequestResult

                return RequestResult(False, error=f"no complete response within {timeout:.0f}s")

    start = time.perf_counter()
    results = await asyncio.gather(*(one(i, b) for i, b in enumerate(bodies)))
    return results, time.perf_counter() - start


def measure(targets: list[HttpTarget], bodies: list[dict], width: int, timeout: float, router_pid: int | None,
            backend_pids: list[int]) -> tuple[LoadReport, float | None, float | None]:
    def cpu(pids):
        values = [process_cpu_seconds(p) for p in pids]
        return None if any(v is None for v in values) else sum(values)

    r0, b0, c0 = cpu([router_pid]) if router_pid else None, cpu(backend_pids), time.process_time()
    (raw, seconds), loop = run_on_fastest_loop(send_all(targets, bodies, width, timeout))
    client = time.process_time() - c0
    r1, b1 = cpu([router_pid]) if router_pid else None, cpu(backend_pids)
    results = [settle(r) for r in raw]
    report = summarize(results, seconds, client, None, None, loop)
    if report.failed:
        raise BenchError(f"{report.failed} request(s) failed: {report.errors}")
    return report, (r1 - r0 if r0 is not None and r1 is not None else None), (b1 - b0 if b0 is not None and b1 is not None else None)


# --- main ---------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        widths = [int(w) for w in args.concurrency.split(",")]
        nodes, gpus = (int(x) for x in args.backends.lower().split("x"))
    except ValueError:
        print(f"{PROG}: error: --concurrency takes integers like 1,16 and --backends NODESxGPUS", file=sys.stderr)
        return 2
    loadavg = os.getloadavg()
    logs = Path(args.keep_logs or tempfile.mkdtemp(prefix="locus-bench-route-"))
    logs.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen] = []
    try:
        text = DomainText.load(MINI, None, args.input_len)
        plan = Path(args.plan) if args.plan else make_plan(logs, args.backends, text)
        urls = []
        for i in range(nodes * gpus):
            port = free_port()
            urls.append(f"http://127.0.0.1:{port}")
            procs.append(start(["serve", "--model", "mini", "--host", "127.0.0.1", "--port", str(port), "--log-level",
                                "warning"], logs / f"backend-{i}.log", args.backend_threads))
        for i, (url, proc) in enumerate(zip(urls, procs)):
            wait_healthy(url, proc, logs / f"backend-{i}.log")
        router, router_url = start_router(plan, urls, logs, procs)
        direct = [HttpTarget.of(f"{u}/v1/completions") for u in urls]
        routed = [HttpTarget.of(f"{router_url}/v1/completions")]
        backend_pids = [p.pid for p in procs[:-1]]
        warm = bodies_of(text, 2 * len(urls), 4, args.tagged, 10_000)
        measure(direct, warm, len(urls), args.request_timeout, None, backend_pids)
        measure(routed, warm, len(urls), args.request_timeout, router.pid, backend_pids)
        runs: list[Run] = []
        offset = 0
        for width in widths:
            for k in range(args.rounds):
                bodies = bodies_of(text, args.num_prompts, args.output_len, args.tagged, offset)
                offset += args.num_prompts
                order = ("direct", "router") if k % 2 == 0 else ("router", "direct")
                for target in order:
                    snapshot = overhead_snapshot(router_url) if target == "router" else None
                    engines0 = backend_ttft(urls)
                    report, router_cpu, backends_cpu = measure(
                        direct if target == "direct" else routed, bodies, width, args.request_timeout,
                        router.pid if target == "router" else None, backend_pids)
                    own = overhead_between(snapshot, overhead_snapshot(router_url)) if snapshot else None
                    engines1 = backend_ttft(urls)
                    engine_ttft = (1000 * (engines1[0] - engines0[0]) / (engines1[1] - engines0[1])
                                   if engines1[1] > engines0[1] else None)
                    runs.append(Run(width, k, target, report, router_cpu, backends_cpu, own, engine_ttft))
                    print(f"{PROG}: concurrency {width} round {k} {target}: TTFT p50 {report.ttft_ms.median:.2f} ms, "
                          f"{report.output_throughput:.0f} tok/s", file=sys.stderr)
    except BenchError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    finally:
        for proc in reversed(procs):
            stop(proc)
    summary = summarise(runs, widths)
    report_tables(runs, summary)
    if args.out:
        write_json(Path(args.out), args, runs, summary, loadavg)
    return 0


def summarise(runs: list[Run], widths: list[int]) -> list[dict]:
    """Per width: medians over rounds of each target's TTFT p50 and throughput, and of the per-round
    differences and ratios (each round's two runs saw the same machine)."""
    out = []
    for width in widths:
        pairs = {}
        for r in runs:
            if r.concurrency == width:
                pairs.setdefault(r.round, {})[r.target] = r
        rounds = [p for p in pairs.values() if len(p) == 2]
        ttft_d = [p["direct"].load.ttft_ms.median for p in rounds]
        ttft_r = [p["router"].load.ttft_ms.median for p in rounds]
        thr_d = [p["direct"].load.output_throughput for p in rounds]
        thr_r = [p["router"].load.output_throughput for p in rounds]
        router_cpu = [p["router"].router_cpu_s for p in rounds if p["router"].router_cpu_s is not None]
        own = [p["router"].router_overhead_ms["p50"] for p in rounds
               if p["router"].router_overhead_ms and p["router"].router_overhead_ms["p50"] is not None]
        requests = [p["router"].load.successful for p in rounds]
        out.append({
            "concurrency": width, "rounds": len(rounds),
            "ttft_p50_ms_direct": float(np.median(ttft_d)), "ttft_p50_ms_router": float(np.median(ttft_r)),
            "ttft_p50_added_ms": float(np.median(np.subtract(ttft_r, ttft_d))),
            "throughput_direct": float(np.median(thr_d)), "throughput_router": float(np.median(thr_r)),
            "throughput_ratio": float(np.median(np.divide(thr_r, thr_d))),
            "router_cpu_ms_per_request": float(np.median(router_cpu) / np.median(requests) * 1000) if router_cpu else None,
            "router_own_ttft_ms_p50": float(np.median(own)) if own else None,
            "backend_ttft_ms_mean_direct": _median([p["direct"].backend_ttft_ms for p in rounds]),
            "backend_ttft_ms_mean_router": _median([p["router"].backend_ttft_ms for p in rounds]),
        })
    return out


def _median(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return float(np.median(values)) if values else None


def report_tables(runs: list[Run], summary: list[dict]) -> None:
    print_table(("concurrency", "round", "target", "TTFT p50 ms", "TTFT p90 ms", "backends' own TTFT mean ms",
                 "TPOT p50 ms", "output tok/s", "router CPU s", "backends CPU s"),
                [(str(r.concurrency), str(r.round), r.target, f"{r.load.ttft_ms.median:.2f}", f"{r.load.ttft_ms.p90:.2f}",
                  f"{r.backend_ttft_ms:.2f}" if r.backend_ttft_ms is not None else "-",
                  f"{r.load.tpot_ms.median:.2f}" if r.load.tpot_ms.median is not None else "-",
                  f"{r.load.output_throughput:.0f}", f"{r.router_cpu_s:.2f}" if r.router_cpu_s is not None else "-",
                  f"{r.backends_cpu_s:.2f}" if r.backends_cpu_s is not None else "-") for r in runs])
    print()
    print_table(("concurrency", "TTFT p50 direct ms", "TTFT p50 router ms", "added ms (median of rounds)",
                 "router's own ms p50", "throughput router / direct", "router CPU ms / request"),
                [(str(s["concurrency"]), f"{s['ttft_p50_ms_direct']:.2f}", f"{s['ttft_p50_ms_router']:.2f}",
                  f"{s['ttft_p50_added_ms']:+.2f}",
                  f"{s['router_own_ttft_ms_p50']:.3f}" if s["router_own_ttft_ms_p50"] is not None else "-",
                  f"{s['throughput_ratio']:.3f}",
                  f"{s['router_cpu_ms_per_request']:.2f}" if s["router_cpu_ms_per_request"] is not None else "-")
                 for s in summary])


def write_json(path: Path, args: argparse.Namespace, runs: list[Run], summary: list[dict],
               loadavg: tuple[float, float, float]) -> None:
    result = {"bench": "route", "args": vars(args), "summary": summary,
              "runs": [{"concurrency": r.concurrency, "round": r.round, "target": r.target, "load": asdict(r.load),
                        "router_cpu_s": r.router_cpu_s, "backends_cpu_s": r.backends_cpu_s,
                        "router_overhead_ms": r.router_overhead_ms, "backend_ttft_ms": r.backend_ttft_ms} for r in runs],
              "machine": {"cpus": os.cpu_count(), "loadavg_before": loadavg, "loadavg_after": os.getloadavg(),
                          "python": platform.python_version()},
              "source": source_revision()}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    sys.exit(main())
