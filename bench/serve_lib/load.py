"""The HTTP load of bench/serve.py: streaming requests (raw_http.py or aiohttp), timing them, and their summary."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import time
from dataclasses import dataclass, field

import numpy as np
from serve_lib.common import BenchError
from serve_lib.cpu import machine_busy_seconds, others_cpu, process_cpu_seconds


# --- results --------------------------------------------------------------------------------------
@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0  # seconds
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


@dataclass
class Percentiles:
    mean: float | None  # None: nothing measured (e.g. every request failed)
    median: float | None
    p90: float | None
    p99: float | None

    @classmethod
    def of_ms(cls, seconds: list[float]) -> "Percentiles":
        if not seconds:
            return cls(None, None, None, None)
        ms = np.asarray(seconds) * 1000.0
        return cls(float(ms.mean()), float(np.median(ms)), float(np.percentile(ms, 90)), float(np.percentile(ms, 99)))


@dataclass
class LoadReport:
    successful: int
    failed: int
    duration_s: float
    prompt_tokens: int
    output_tokens: int
    request_throughput: float  # requests/s
    output_throughput: float  # output tokens/s
    total_token_throughput: float  # (prompt + output) tokens/s
    ttft_ms: Percentiles
    tpot_ms: Percentiles
    itl_ms: Percentiles
    e2e_ms: Percentiles
    client_cpu_s: float  # this process's CPU time during the run: the load client competes for the same cores
    client_loop: str  # the client's event loop: "uvloop" or "asyncio"
    server_cpu_s: float | None  # the launched server's CPU time during the run (None: not launched here)
    other_cpu_s: float | None  # CPU time of every other process meanwhile: > 0.1 x duration means a disturbed run
    errors: list[str]  # distinct failure messages, at most 10


def summarize(results: list[RequestResult], duration: float, client_cpu: float, server_cpu: float | None,
              other_cpu: float | None, client_loop: str) -> LoadReport:
    ok = [r for r in results if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    output = sum(r.output_tokens for r in ok)
    errors = list(dict.fromkeys(r.error for r in results if not r.ok and r.error))[:10]
    return LoadReport(
        successful=len(ok), failed=len(results) - len(ok), duration_s=duration, prompt_tokens=prompt,
        output_tokens=output, request_throughput=len(ok) / duration, output_throughput=output / duration,
        total_token_throughput=(prompt + output) / duration,
        ttft_ms=Percentiles.of_ms([r.ttft for r in ok]),
        tpot_ms=Percentiles.of_ms([t for r in ok if (t := r.tpot) is not None]),
        itl_ms=Percentiles.of_ms([g for r in ok for g in r.itl]),
        e2e_ms=Percentiles.of_ms([r.e2e for r in ok]),
        client_cpu_s=client_cpu, client_loop=client_loop, server_cpu_s=server_cpu, other_cpu_s=other_cpu, errors=errors)


# --- the load run ---------------------------------------------------------------------------------
def run_on_fastest_loop(coro) -> tuple[object, str]:
    """Run coro on uvloop when it is installed (it is with locus on Linux), else on asyncio's loop;
    return its result and the loop's name. On a small machine the client shares the cores with the
    server it measures, and under asyncio's own loop it spends ~43 us of CPU per streamed token
    against ~24 under uvloop."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro), "asyncio"
    return uvloop.run(coro), "uvloop"


def carries_token(chunk: dict, chat: bool) -> bool:
    """One engine output becomes one SSE chunk; chat's first chunk only announces the role."""
    choices = chunk.get("choices")
    if not choices:
        return False
    return not (chat and "role" in choices[0].get("delta", {}))


def plain_token_chunk(data: bytes, chat: bool) -> bool:
    """A chunk that can only be a generated token's: one choice, no usage, error or role key. Such
    chunks (all but a stream's first and last few) are not JSON-decoded, to keep the client's CPU,
    which the server it measures shares, low. Inside JSON strings quotes are escaped, so the byte
    patterns below only match keys."""
    if not data.startswith(b"{") or b'"usage":' in data or b'"error":' in data or (chat and b'"role":' in data):
        return False
    return b'"choices": [{' in data or b'"choices":[{' in data


class StreamTally:
    """One streamed response, read as its bytes arrive: SSE events are split on blank lines, each
    `data:` line is one chunk; token-carrying chunks are timed (TTFT, ITL) and counted, the usage
    chunk is kept, an error chunk ends the request. Both load clients feed it."""

    def __init__(self, chat: bool, start: float):
        self.chat, self.start = chat, start
        self.ttft: float | None = None
        self.last, self.itl, self.chunks, self.usage = start, [], 0, None
        self.pending = b""
        self.error: str | None = None  # a stream error chunk: the request failed

    def feed(self, received: bytes, now: float | None = None) -> None:
        """Whatever bytes have arrived, at once (one call per read, not per line), and when they
        arrived (default: now). Raises json.JSONDecodeError (a ValueError) on a chunk that is not JSON."""
        if now is None:
            now = time.perf_counter()
        *events, self.pending = (self.pending + received).split(b"\n\n")
        for event in events:
            for line in event.split(b"\n"):
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                if plain_token_chunk(data, self.chat):
                    token = True
                else:
                    chunk = json.loads(data)
                    if "error" in chunk:
                        self.error = f"stream error: {chunk['error'].get('message', chunk['error'])}"
                        return
                    if chunk.get("usage"):
                        self.usage = chunk["usage"]
                    token = carries_token(chunk, self.chat)
                if token:
                    if self.ttft is None:
                        self.ttft = now - self.start
                    else:
                        self.itl.append(now - self.last)
                    self.last, self.chunks = now, self.chunks + 1

    def result(self, prompt_len: int | None, end: float | None = None) -> RequestResult:
        """The request's result once its stream has ended (at `end`, default now)."""
        if self.error is not None:
            return RequestResult(False, error=self.error)
        e2e = (time.perf_counter() if end is None else end) - self.start
        if self.ttft is None:
            return RequestResult(False, error="the stream ended without a generated token")
        output = self.usage["completion_tokens"] if self.usage else self.chunks
        prompt = self.usage["prompt_tokens"] if self.usage else (prompt_len or 0)
        return RequestResult(True, prompt, output, self.ttft, e2e, self.itl)


async def send_request(session, url: str, body: dict, chat: bool, prompt_len: int | None) -> RequestResult:
    """One streamed request through aiohttp (`--client aiohttp`)."""
    import aiohttp

    tally = StreamTally(chat, time.perf_counter())
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                return RequestResult(False, error=f"HTTP {resp.status}: {error_message(await resp.read())}")
            async for received in resp.content.iter_any():
                tally.feed(received)
                if tally.error is not None:
                    break
    except (aiohttp.ClientError, json.JSONDecodeError, ValueError) as exc:
        return RequestResult(False, error=f"{type(exc).__name__}: {exc}")
    return tally.result(prompt_len)


def error_message(raw: bytes) -> str:
    text = raw.decode("utf-8", errors="replace")
    try:
        return json.loads(text)["error"]["message"]
    except (json.JSONDecodeError, KeyError, TypeError):
        return text[:200]


def arrival_gaps(count: int, rate: float, seed: int) -> list[float]:
    """Seconds to wait before sending each request: a Poisson process, or none at rate inf."""
    if rate == float("inf"):
        return [0.0] * count
    rng = random.Random(seed)
    return [0.0] + [rng.expovariate(rate) for _ in range(count - 1)]


@dataclass
class LoadRun:
    results: list[RequestResult]
    duration: float
    client_cpu: float  # this process; this and the rest: the timed part only
    server_cpu: float | None  # the launched server (None: not ours)
    other_cpu: float | None  # everyone else


async def run_load(args: argparse.Namespace, url: str, bodies: list[dict], prompt_lens: list[int | None],
                   warmup: list[dict], server_pid: int | None) -> LoadRun:
    """Warm up, then send every request (at most --concurrency in flight)."""
    chat = args.endpoint == "chat"
    width = args.concurrency or len(bodies)
    async with load_client(args, url, chat, width) as send:
        async def bounded(body: dict, prompt_len: int | None) -> RequestResult:
            try:  # the client's own timeout bounds each read (aiohttp); this bounds the whole request
                return await asyncio.wait_for(send(body, prompt_len), args.request_timeout)
            except asyncio.TimeoutError:
                return RequestResult(False, error=f"no complete response within {args.request_timeout:.0f}s")

        for result in map(settle, await asyncio.gather(*(bounded(body, None) for body in warmup))):
            if not result.ok:
                raise BenchError(f"a warm-up request failed: {result.error}")
        gate = asyncio.Semaphore(width)

        async def limited(body: dict, prompt_len: int | None) -> RequestResult:
            async with gate:
                return await bounded(body, prompt_len)

        server0 = process_cpu_seconds(server_pid) if server_pid else None
        busy0, cpu0, start = machine_busy_seconds(), time.process_time(), time.perf_counter()
        tasks = []
        for body, prompt_len, gap in zip(bodies, prompt_lens, arrival_gaps(len(bodies), args.request_rate, args.seed)):
            if gap:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(limited(body, prompt_len)))
        results = await asyncio.gather(*tasks)
        duration, client_cpu, busy1 = time.perf_counter() - start, time.process_time() - cpu0, machine_busy_seconds()
        server1 = process_cpu_seconds(server_pid) if server_pid else None
    results = [settle(r) for r in results]  # parsed now, outside the timed part
    server_cpu = server1 - server0 if server0 is not None and server1 is not None else None
    # without a server of ours its CPU is unknown, and so is everyone else's
    return LoadRun(list(results), duration, client_cpu, server_cpu, others_cpu(busy0, busy1, client_cpu, server_cpu))


def settle(result) -> RequestResult:
    """A RequestResult, or a response recorded during the run (raw client) parsed into one."""
    return result if isinstance(result, RequestResult) else result.parse()


@contextlib.asynccontextmanager
async def load_client(args: argparse.Namespace, url: str, chat: bool, width: int):
    """`send(body, prompt_len)` of the chosen --client: a RequestResult, or something `settle` makes one.

    raw (the default): serve_lib/raw_http.py, a connection per request whose reads are recorded with
    their arrival times and parsed after the run, several times less client CPU per streamed token
    than aiohttp (docs/serving.md). aiohttp: a pooled
    keep-alive client with a C parser, the common choice of serving benchmarks (vLLM's among them);
    httpx's async client costs 3x aiohttp's CPU per streamed token (0.18 vs 0.05 CPU s for 32 x 64)."""
    if args.client == "raw":
        from serve_lib.raw_http import HttpTarget, send_request_raw

        try:
            target = HttpTarget.of(url)
        except ValueError as exc:  # https://, say: one line, before any request
            raise BenchError(str(exc)) from None
        yield lambda body, prompt_len: send_request_raw(target, body, chat, prompt_len)
        return
    import aiohttp

    connector = aiohttp.TCPConnector(limit=width)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30.0, sock_read=args.request_timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, read_bufsize=1 << 20) as session:
        yield lambda body, prompt_len: send_request(session, url, body, chat, prompt_len)
