"""What `locus route` itself adds to a first token, without the engines' noise: bench/route_pairs.py's
pairs (each prompt straight to a backend and through the router, back to back, the order flipping
from pair to pair) against four backends that answer at once: a stream's head and first token in
one write as soon as the request is read, the rest a millisecond later. A mini backend's own TTFT
moves by milliseconds from request to request on a busy machine, more than the router adds; here the
direct TTFT is a connection and a reply, and the difference per pair is the router's whole cost: its
work (reading, tokenizing, the grouper's choice, its client to the backend, the first chunk on), the
extra hop's sockets and its two process wake-ups.

    python bench/route_instant.py --pairs 400 --out results/route_instant.json

The router is the real one (`locus route` with a locality plan made from a mini recording, or
--plan); the backends do no work, so the grouper's choices make no difference to them. Prints the
median TTFT of each target, the median and quartiles of the per-pair difference, the router's own
time on each first token (its locus_route_overhead_seconds histogram) and its CPU time per request
(the whole request, all 16 chunks relayed); writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from route import MINI, bodies_of, make_plan, overhead_between, overhead_snapshot, start_router, stop  # noqa: E402
from route_pairs import send_pairs, summarise_pairs, write_pairs  # noqa: E402
from serve_lib.common import BenchError  # noqa: E402
from serve_lib.cpu import process_cpu_seconds  # noqa: E402
from serve_lib.domain_text import DomainText  # noqa: E402
from serve_lib.load import run_on_fastest_loop  # noqa: E402
from serve_lib.raw_http import HttpTarget  # noqa: E402
from serve_lib.server import free_port  # noqa: E402
from serve_lib.table import print_table  # noqa: E402

PROG = "bench route_instant"
MODELS = json.dumps({"object": "list", "data": [{"id": "mini", "object": "model", "max_model_len": 2048}]}).encode()
STREAM_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\ncache-control: no-cache\r\n"
               b"transfer-encoding: chunked\r\n\r\n")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=400, help="prompts, each sent to both targets (default 400)")
    p.add_argument("--input-len", type=int, default=48, help="prompt length in mini tokens (default 48)")
    p.add_argument("--output-len", type=int, default=16, help="token events per answer (default 16)")
    p.add_argument("--tagged", type=float, default=0.5, help="share of requests carrying their domain (default 0.5)")
    p.add_argument("--plan", help="a plan for 4 ranks with a grouping (default: one made here from a mini recording)")
    p.add_argument("--out", help="write the JSON here")
    p.add_argument("--keep-logs", metavar="DIR", help="write the processes' logs here (default: a temp dir)")
    p.add_argument("--serve-instant", metavar="PORTS", help=argparse.SUPPRESS)  # the backends' own process
    return p.parse_args(argv)


# --- the instant backends (their own process: `--serve-instant PORT,PORT,...`) ----------------------
def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


def token_event(i: int) -> bytes:
    return (b'data: {"id":"cmpl-i","object":"text_completion","created":0,"model":"mini","choices":[{"index":0,'
            b'"text":" t%d","logprobs":null,"finish_reason":null}]}\n\n' % i)


class InstantBackend(asyncio.Protocol):
    """/health and /v1/models as `locus serve` answers them; a generation as a stream of `tokens`
    events whose head and first event go out as soon as the request is read."""

    def __init__(self, tokens: int):
        import httptools

        self.tokens = tokens
        self.parser = httptools.HttpRequestParser(self)
        self.url, self.close = b"", False

    def connection_made(self, transport):
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        import httptools

        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.close = self.close or (name.lower() == b"connection" and value.lower() == b"close")

    def on_message_complete(self) -> None:
        url, self.url = self.url, b""
        if url.startswith(b"/v1/"):
            if url.startswith(b"/v1/models"):
                self.reply(MODELS)
                return
            self.transport.write(STREAM_HEAD + chunk(token_event(0)))
            asyncio.get_running_loop().call_later(0.001, self.rest)
        else:
            self.reply(b'{"status":"ok"}')

    def reply(self, body: bytes) -> None:
        self.transport.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s"
                             % (len(body), body))
        if self.close:
            self.transport.close()

    def rest(self) -> None:
        if self.transport.is_closing():
            return
        usage = (b'data: {"id":"cmpl-i","object":"text_completion","created":0,"model":"mini","choices":[],'
                 b'"usage":{"prompt_tokens":0,"completion_tokens":%d,"total_tokens":%d}}\n\n' % (self.tokens, self.tokens))
        self.transport.write(b"".join(chunk(token_event(i)) for i in range(1, self.tokens)) + chunk(usage)
                             + chunk(b"data: [DONE]\n\n") + b"0\r\n\r\n")
        if self.close:
            self.transport.close()


async def serve_instant(ports: list[int], tokens: int) -> None:
    loop = asyncio.get_running_loop()
    for port in ports:
        await loop.create_server(lambda: InstantBackend(tokens), "127.0.0.1", port, backlog=1024)
    print("ready", flush=True)
    await asyncio.Event().wait()


# --- the run ----------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.serve_instant:
        import uvloop

        uvloop.run(serve_instant([int(p) for p in args.serve_instant.split(",")], args.output_len))
        return 0
    if args.pairs < 1 or args.output_len < 1:
        print(f"{PROG}: error: --pairs and --output-len must be at least 1", file=sys.stderr)
        return 2
    logs = Path(args.keep_logs or tempfile.mkdtemp(prefix="locus-bench-route-instant-"))
    logs.mkdir(parents=True, exist_ok=True)
    procs: list[subprocess.Popen] = []
    try:
        text = DomainText.load(MINI, None, args.input_len)
        plan = Path(args.plan) if args.plan else make_plan(logs, "2x2", text)
        ports = [free_port() for _ in range(4)]
        with open(logs / "backends.log", "w") as out:
            backends = subprocess.Popen([sys.executable, __file__, "--serve-instant", ",".join(map(str, ports)),
                                         "--output-len", str(args.output_len)], stdout=subprocess.PIPE, stderr=out,
                                        text=True, start_new_session=True)
        procs.append(backends)
        if backends.stdout.readline().strip() != "ready":
            raise BenchError(f"the instant backends did not start: {(logs / 'backends.log').read_text()[-2000:]}")
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        router, router_url = start_router(plan, urls, logs, procs)
        direct = [HttpTarget.of(f"{u}/v1/completions") for u in urls]
        routed = HttpTarget.of(f"{router_url}/v1/completions")
        run_on_fastest_loop(send_pairs(direct, routed, bodies_of(text, 16, args.output_len, args.tagged, 10_000)))
        loadavg = os.getloadavg()
        before, cpu0 = overhead_snapshot(router_url), process_cpu_seconds(router.pid)
        pairs, _ = run_on_fastest_loop(send_pairs(direct, routed, bodies_of(text, args.pairs, args.output_len,
                                                                           args.tagged, 0)))
        cpu1 = process_cpu_seconds(router.pid)
        own = overhead_between(before, overhead_snapshot(router_url))
        loadavg_after = os.getloadavg()
    except BenchError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    finally:
        for proc in reversed(procs):
            stop(proc)
    ttft, summary = summarise_pairs(pairs, own)
    cpu = 1000 * (cpu1 - cpu0) / len(pairs) if cpu0 is not None and cpu1 is not None else None
    summary["router_cpu_ms_per_request"] = cpu
    print_table(("pairs", "TTFT p50 direct ms", "TTFT p50 router ms", "added ms p50 (per pair)", "added p25 / p75",
                 "router's own ms p50", "router CPU ms / request", "load average"),
                [(str(summary["pairs"]), f"{summary['ttft_p50_ms_direct']:.3f}", f"{summary['ttft_p50_ms_router']:.3f}",
                  f"{summary['added_ms_p50']:+.3f}", f"{summary['added_ms_p25']:+.3f} / {summary['added_ms_p75']:+.3f}",
                  f"{summary['router_own_ms_p50']:.3f}" if summary["router_own_ms_p50"] is not None else "-",
                  f"{cpu:.2f}" if cpu is not None else "-", f"{loadavg[0]:.1f} -> {loadavg_after[0]:.1f}")])
    if args.out:
        write_pairs(args.out, "route_instant", args, summary, ttft, loadavg, loadavg_after)
    return 0


if __name__ == "__main__":
    sys.exit(main())
