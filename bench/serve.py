"""HTTP load benchmark: stream many requests at a running `locus serve` (or one it starts) and report
latency (TTFT, TPOT, ITL, end-to-end) and throughput; optionally run the same workload through the
in-process offline engine first and report HTTP / offline output-token throughput side by side.

Default workload mirrors bench/offline.py: prompts of `--input-len` random token ids (drawn in
[3, min(vocab, 32000)), seeded) sent as token-id lists to /v1/completions so prompt lengths are
exact, `--output-len` new tokens with `ignore_eos` so output lengths are exact, temperature 0.

    python bench/serve.py --base-url http://127.0.0.1:8000 --num-prompts 64 --concurrency 32
    locus bench serve --launch-model small --compare-offline --num-prompts 64 --input-len 64 \\
        --output-len 64 --concurrency 32 --request-rate inf --rounds 5 --out results/serve.json

Measurements (all client-side, from `time.perf_counter`):
- TTFT: request sent -> first SSE chunk carrying a generated token (chat's role-only preamble does not count).
- ITL: gaps between consecutive token-carrying chunks.
- TPOT: (E2E - TTFT) / (output tokens - 1), output tokens from the `usage` chunk.
- E2E: request sent -> end of stream.
- duration: first request sent -> last request done; throughputs divide by it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

PROG = "bench serve"
WORDS_ALPHABET = "abcdefghijklmnopqrstuvwxyz"


class BenchError(Exception):
    """A setup problem the user can fix (server unreachable, bad file): one line, exit 2."""


# --- arguments ------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    target = p.add_argument_group("target")
    target.add_argument("--base-url", default=None, help="server root, e.g. http://127.0.0.1:8000 (default: from --host/--port)")
    target.add_argument("--host", default="127.0.0.1")
    target.add_argument("--port", type=int, default=None, help="default: --launch CMD's --port, else 8000")
    target.add_argument("--model", default=None,
                        help="model name sent in requests, and the model the offline engine loads "
                             "(default: the first of /v1/models; with --launch-model, that model)")
    target.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    target.add_argument("--launch", default=None, metavar="CMD",
                        help="start this server command (e.g. \"locus serve --model small --port 18200\"), "
                             "benchmark it, then stop it; the target is --base-url/--port or the CMD's --port")
    target.add_argument("--launch-model", default=None, metavar="MODEL",
                        help="start `locus serve --model MODEL` on a free loopback port with this script's engine flags")
    target.add_argument("--ready-timeout", type=float, default=300.0, help="seconds to wait for /health 200")
    target.add_argument("--server-log", default=None, help="launched server's output (default: a temp file)")

    load = p.add_argument_group("workload")
    load.add_argument("--dataset", default="random", help="'random', or a file: JSONL with {\"prompt\": ...} or text, one prompt per line")
    load.add_argument("--num-prompts", type=int, default=64)
    load.add_argument("--input-len", type=int, default=64, help="random dataset: prompt tokens (chat: words)")
    load.add_argument("--output-len", type=int, default=64, help="new tokens per request (ignore_eos)")
    load.add_argument("--vocab-size", type=int, default=None, help="random token ids are drawn below min(this, 32000) (default: probed with /detokenize)")
    load.add_argument("--concurrency", type=int, default=None, help="most requests in flight (default: no limit)")
    load.add_argument("--request-rate", type=float, default=float("inf"), help="Poisson arrivals per second (inf: all at once)")
    load.add_argument("--seed", type=int, default=0, help="prompts and arrival times")
    load.add_argument("--warmup", type=int, default=None,
                      help="untimed short requests sent at once before each run, offline too (default: the run's "
                           "batch width, min(--num-prompts, --concurrency), so the timed batch shapes are warm)")
    load.add_argument("--request-timeout", type=float, default=600.0, help="seconds one request may take")

    engine = p.add_argument_group("engine (for --compare-offline and --launch-model; match the server's)")
    engine.add_argument("--compare-offline", action="store_true",
                        help="first run the same workload through locus.engine.llm.LLM in this process")
    engine.add_argument("--max-num-seqs", type=int, default=256)
    engine.add_argument("--max-num-batched-tokens", type=int, default=2048)
    engine.add_argument("--kv-cache-memory", default="1GiB")
    engine.add_argument("--dtype", default=None)
    engine.add_argument("--device", default=None)
    engine.add_argument("--moe-backend", default="auto")
    engine.add_argument("--model-seed", type=int, default=0, help="weight seed for presets (server --seed)")
    engine.add_argument("--threads", type=int, default=None,
                        help="torch threads for the offline engine and the launched server (default: torch's "
                             "default here, passed to the server as OMP_NUM_THREADS so both match)")

    p.add_argument("--rounds", type=int, default=1,
                   help="repeat (offline run, HTTP run) pairs this many times and report the median ratio: "
                        "on a shared machine one pair can be off by 5-10%%")
    p.add_argument("--out", default="results/serve.json")
    args = p.parse_args(argv)
    if args.num_prompts < 1 or args.output_len < 1 or args.input_len < 1:
        p.error("--num-prompts, --input-len and --output-len must be positive")
    if args.warmup is None:
        args.warmup = min(args.num_prompts, args.concurrency or args.num_prompts)
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    if args.rounds < 1:
        p.error("--rounds must be positive")
    if args.concurrency is not None and args.concurrency < 1:
        p.error("--concurrency must be positive")
    if args.request_rate <= 0:
        p.error("--request-rate must be positive (inf: all at once)")
    if args.launch and args.launch_model:
        p.error("give --launch or --launch-model, not both")
    args.model = args.model or args.launch_model
    if args.compare_offline and not args.model:
        p.error("--compare-offline needs --model or --launch-model (the offline engine loads it)")
    return args


def base_url(args: argparse.Namespace) -> str:
    if args.base_url:
        return args.base_url.rstrip("/")
    port = args.port
    words = shlex.split(args.launch) if args.launch else []
    if port is None and "--port" in words[:-1]:  # the launched command names its own port
        value = words[words.index("--port") + 1]
        port = int(value) if value.isdigit() else None
    return f"http://{args.host}:{port or 8000}"


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
    server_cpu_s: float | None  # the launched server's CPU time during the run (None: not launched here)
    other_cpu_s: float | None  # CPU time of every other process meanwhile: > 0.1 x duration means a disturbed run
    errors: list[str]  # distinct failure messages, at most 10


@dataclass
class OfflineReport:
    max_num_seqs: int
    seconds: float
    prompt_tokens: int
    output_tokens: int
    output_throughput: float
    total_token_throughput: float
    threads: int
    cpu_s: float  # this process's CPU time during generate (compare with the server's + the client's)
    other_cpu_s: float | None  # CPU time of other processes during generate (see LoadReport)


@dataclass
class Round:
    """One HTTP run and the offline runs just before it (none without --compare-offline)."""
    load: LoadReport
    offline: list[OfflineReport]

    def ratios(self) -> list[float]:
        """HTTP / offline output throughput for each offline width (the server's first)."""
        return [self.load.output_throughput / o.output_throughput for o in self.offline]


def median_ratios(rounds: list[Round]) -> list[float]:
    """Per offline width, the median over rounds of HTTP / offline: the figure to quote."""
    per_width = zip(*(r.ratios() for r in rounds))
    return [float(np.median(values)) for values in per_width]


def summarize(results: list[RequestResult], duration: float, client_cpu: float, server_cpu: float | None,
              other_cpu: float | None) -> LoadReport:
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
        client_cpu_s=client_cpu, server_cpu_s=server_cpu, other_cpu_s=other_cpu, errors=errors)


# --- prompts --------------------------------------------------------------------------------------
def make_prompts(args: argparse.Namespace, vocab: int | None, seed: int, count: int) -> list[str | list[int]]:
    """Token-id lists (random, completions), word strings (random, chat) or the file's prompts, cycled."""
    rng = random.Random(seed)
    if args.dataset != "random":
        lines = read_dataset(Path(args.dataset))
        return [lines[i % len(lines)] for i in range(count)]
    if args.endpoint == "chat":  # chat takes text; lengths in tokens are approximate
        return [" ".join(random_word(rng) for _ in range(args.input_len)) for _ in range(count)]
    high = min(vocab or 32000, 32000)  # same id range as bench/offline.py
    return [[rng.randrange(3, high) for _ in range(args.input_len)] for _ in range(count)]


def random_word(rng: random.Random) -> str:
    return "".join(rng.choice(WORDS_ALPHABET) for _ in range(rng.randint(2, 7)))


def read_dataset(path: Path) -> list[str]:
    try:
        lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    except OSError as exc:
        raise BenchError(f"cannot read --dataset {path}: {exc.strerror or exc}") from None
    if not lines:
        raise BenchError(f"--dataset {path} has no prompts")
    if path.suffix != ".jsonl":
        return lines
    prompts = []
    for number, line in enumerate(lines, 1):
        try:
            prompt = json.loads(line)["prompt"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise BenchError(f"--dataset {path}:{number}: expected a JSON object with a \"prompt\" string") from None
        if not isinstance(prompt, str) or not prompt:
            raise BenchError(f"--dataset {path}:{number}: \"prompt\" must be a non-empty string")
        prompts.append(prompt)
    return prompts


def request_body(endpoint: str, model: str, prompt: str | list[int], output_len: int) -> dict:
    body: dict = {"model": model, "max_tokens": output_len, "temperature": 0.0, "ignore_eos": True,
                  "stream": True, "stream_options": {"include_usage": True}}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


# --- talking to the server (setup) ----------------------------------------------------------------
def wait_until_ready(client, url: str, timeout: float, proc: subprocess.Popen | None, log_path: str | None) -> None:
    """Poll /health until 200. A server we did not start must at least answer at once."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            raise BenchError(f"the server exited with code {proc.returncode} before it was ready{log_tail(log_path)}")
        try:
            health = client.get(f"{url}/health")
            if health.status_code in (200, 404):  # 404: a server without /health; the first request will tell
                return
            if health.status_code == 503 and health_status(health) == "error":  # broken, not loading: stop waiting
                detail = health.json().get("detail") or "no detail"
                raise BenchError(f"the server at {url} is not healthy: {detail}" + (f" (log {log_path})" if log_path else ""))
        except httpx.TransportError as exc:
            if proc is None:
                raise BenchError(f"cannot reach the server at {url}: {exc or type(exc).__name__}") from None
        if time.monotonic() > deadline:
            raise BenchError(f"the server at {url} was not ready within {timeout:.0f}s{log_tail(log_path)}")
        time.sleep(0.2)


def health_status(response) -> str | None:
    try:
        return response.json().get("status")
    except (ValueError, AttributeError):
        return None


def served_model(client, url: str) -> str:
    data = client.get(f"{url}/v1/models").json().get("data") or []
    if not data:
        raise BenchError(f"{url}/v1/models lists no model; pass --model")
    return data[0]["id"]


def probe_vocab(client, url: str, model: str) -> int | None:
    """The largest usable token id bound up to 32000, by asking /detokenize (about 15 small requests).
    None when the server has no /detokenize (then ids stay below 32000; pass --vocab-size to narrow)."""
    def valid(token_id: int) -> bool | None:
        # a fresh connection each: a server may close its connection after an error reply
        r = client.post(f"{url}/detokenize", json={"model": model, "tokens": [token_id]}, headers={"Connection": "close"})
        return True if r.status_code == 200 else False if r.status_code == 400 else None

    top = valid(31999)
    if top is None or top:
        return None if top is None else 32000
    low, high = 0, 31999  # low is valid (or nothing is), high is not
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if valid(mid) else (low, mid)
    return low + 1


# --- launching a server ---------------------------------------------------------------------------
@dataclass
class Launched:
    proc: subprocess.Popen
    command: list[str]
    log_path: str
    threads: int | None
    temp_log: bool  # we chose the log file: removed after a successful run, kept to read after a failure


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_command(args: argparse.Namespace, port: int) -> list[str]:
    cmd = [sys.executable, "-m", "locus.cli", "serve", "--model", args.launch_model, "--host", "127.0.0.1",
           "--port", str(port), "--max-num-seqs", str(args.max_num_seqs),
           "--max-num-batched-tokens", str(args.max_num_batched_tokens), "--kv-cache-memory", args.kv_cache_memory,
           "--moe-backend", args.moe_backend, "--seed", str(args.model_seed)]
    for flag, value in (("--dtype", args.dtype), ("--device", args.device)):
        if value:
            cmd += [flag, value]
    return cmd


def start_server(command: list[str], threads: int | None, log_path: str | None) -> Launched:
    env = dict(os.environ)
    if threads:  # torch sizes its intra-op pool from this at start-up
        env["OMP_NUM_THREADS"] = str(threads)
    temp_log = log_path is None
    log_path = log_path or tempfile.NamedTemporaryFile(prefix="locus-bench-server-", suffix=".log", delete=False).name
    try:
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    except OSError as exc:
        raise BenchError(f"cannot start the server {shlex.join(command)}: {exc.strerror or exc}") from None
    return Launched(proc, command, log_path, threads, temp_log)


def user_command(text: str) -> list[str]:
    """--launch CMD as argv; a bare `locus` is this interpreter's (the venv may not be on PATH)."""
    words = shlex.split(text)
    if words and words[0] == "locus" and shutil.which("locus") is None:
        words = [sys.executable, "-m", "locus.cli", *words[1:]]
    return words


def stop_server(server: Launched, grace: float = 30.0) -> None:
    """SIGTERM (the server drains and exits), then SIGKILL if it does not within `grace` seconds."""
    if server.proc.poll() is not None:
        return
    server.proc.send_signal(signal.SIGTERM)
    try:
        server.proc.wait(grace)
    except subprocess.TimeoutExpired:
        print(f"{PROG}: the server did not exit {grace:.0f}s after SIGTERM; killing it", file=sys.stderr)
        server.proc.kill()
        server.proc.wait(10)


def log_tail(log_path: str | None, lines: int = 15) -> str:
    if not log_path or not os.path.exists(log_path):
        return ""
    tail = Path(log_path).read_text(errors="replace").splitlines()[-lines:]
    return f" (server log {log_path}):\n  " + "\n  ".join(tail) if tail else ""


def machine_busy_seconds() -> float | None:
    """CPU seconds spent busy by the whole machine since boot, from /proc/stat (Linux); None elsewhere."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def others_cpu(busy0: float | None, busy1: float | None, *ours: float | None) -> float | None:
    """What other processes used meanwhile: the machine's busy time less our own processes'."""
    if busy0 is None or busy1 is None or any(v is None for v in ours):
        return None
    return max(0.0, busy1 - busy0 - sum(ours))


def process_cpu_seconds(pid: int) -> float | None:
    """utime + stime of a process, from /proc (Linux); None elsewhere."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# --- the load run ---------------------------------------------------------------------------------
def carries_token(chunk: dict, chat: bool) -> bool:
    """One engine output becomes one SSE chunk; chat's first chunk only announces the role."""
    choices = chunk.get("choices")
    if not choices:
        return False
    return not (chat and "role" in choices[0].get("delta", {}))


async def send_request(session, url: str, body: dict, chat: bool, prompt_len: int | None) -> RequestResult:
    import aiohttp

    start = time.perf_counter()
    ttft, last, itl, chunks, usage = None, start, [], 0, None
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                return RequestResult(False, error=f"HTTP {resp.status}: {error_message(await resp.read())}")
            async for line in resp.content:  # SSE: one `data: ...` line per event
                if not line.startswith(b"data:"):
                    continue
                now = time.perf_counter()
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    return RequestResult(False, error=f"stream error: {chunk['error'].get('message', chunk['error'])}")
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if carries_token(chunk, chat):
                    if ttft is None:
                        ttft = now - start
                    else:
                        itl.append(now - last)
                    last, chunks = now, chunks + 1
    except (aiohttp.ClientError, json.JSONDecodeError, ValueError) as exc:
        return RequestResult(False, error=f"{type(exc).__name__}: {exc}")
    e2e = time.perf_counter() - start
    if ttft is None:
        return RequestResult(False, error="the stream ended without a generated token")
    output = usage["completion_tokens"] if usage else chunks
    prompt = usage["prompt_tokens"] if usage else (prompt_len or 0)
    return RequestResult(True, prompt, output, ttft, e2e, itl)


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
    # aiohttp, not httpx, for the load itself: its C parser costs a third of httpx's CPU per streamed
    # token (0.05 vs 0.18 CPU s for 32 x 64 tokens), and on a small machine the client shares the
    # cores with the server it measures.
    import aiohttp

    chat = args.endpoint == "chat"
    width = args.concurrency or len(bodies)
    connector = aiohttp.TCPConnector(limit=width)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30.0, sock_read=args.request_timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, read_bufsize=1 << 20) as client:
        async def bounded(body: dict, prompt_len: int | None) -> RequestResult:
            try:  # the session's timeout bounds each read; this bounds the whole request
                return await asyncio.wait_for(send_request(client, url, body, chat, prompt_len), args.request_timeout)
            except asyncio.TimeoutError:
                return RequestResult(False, error=f"no complete response within {args.request_timeout:.0f}s")

        for result in await asyncio.gather(*(bounded(body, None) for body in warmup)):
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
    server_cpu = server1 - server0 if server0 is not None and server1 is not None else None
    # without a server of ours its CPU is unknown, and so is everyone else's
    return LoadRun(list(results), duration, client_cpu, server_cpu, others_cpu(busy0, busy1, client_cpu, server_cpu))


# --- the offline engine on the same workload ------------------------------------------------------
def offline_widths(args: argparse.Namespace) -> list[int]:
    """max_num_seqs values for the offline runs: the server's, and, when the client's concurrency is
    what bounds the HTTP batch, that concurrency too (same batch width: isolates the serving overhead)."""
    widths = [args.max_num_seqs]
    if args.concurrency and args.concurrency < min(args.max_num_seqs, args.num_prompts):
        widths.append(args.concurrency)
    return widths


def run_offline(args: argparse.Namespace, prompts: list[str | list[int]], warmup: list[str | list[int]]) -> list[OfflineReport]:
    """locus.engine.llm.LLM with the server's engine flags, once per width of offline_widths; a fresh
    engine (KV pool, prefix cache) each time, the same weights. Times `generate` only."""
    import torch

    from locus.engine.engine_core import EngineConfig, parse_memory
    from locus.engine.llm import LLM
    from locus.engine.sampling_params import SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)

    def config(width: int) -> EngineConfig:
        return EngineConfig(max_num_seqs=width, max_num_batched_tokens=args.max_num_batched_tokens,
                            kv_cache_memory=parse_memory(args.kv_cache_memory))

    llm = LLM(args.model, dtype=args.dtype, device=args.device, moe_backend=args.moe_backend, seed=args.model_seed,
              engine_config=config(args.max_num_seqs))
    model, tokenizer = llm.engine.model, llm.tokenizer
    to_ids = offline_tokenizer(tokenizer, args.endpoint == "chat")
    token_prompts = [to_ids(p) for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    reports = []
    for width in offline_widths(args):
        if llm is None:
            llm = LLM.from_model(model, tokenizer, config(width))
        if warmup:
            llm.generate([to_ids(p) for p in warmup], SamplingParams(temperature=0.0, max_tokens=warmup_len(args), ignore_eos=True))
        busy0, cpu0, start = machine_busy_seconds(), time.process_time(), time.perf_counter()
        outs = llm.generate(token_prompts, params)
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu0
        other = others_cpu(busy0, machine_busy_seconds(), cpu)
        prompt_tokens = sum(len(p) for p in token_prompts)
        output_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        reports.append(OfflineReport(width, seconds, prompt_tokens, output_tokens, output_tokens / seconds,
                                     (prompt_tokens + output_tokens) / seconds, torch.get_num_threads(), cpu, other))
        llm = outs = None  # drop the KV pool before the next engine (or a launched server) allocates one
    return reports


def offline_tokenizer(tok, chat: bool):
    """Prompt -> token ids exactly as the server's endpoint would tokenize it."""
    def to_ids(prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        if chat:
            return tok.encode(tok.apply_chat_template([{"role": "user", "content": prompt}], True), add_special_tokens=False)
        return tok.encode(prompt)
    return to_ids


def warmup_len(args: argparse.Namespace) -> int:
    return min(args.output_len, 8)


# --- report ---------------------------------------------------------------------------------------
def print_report(args: argparse.Namespace, load: LoadReport, offline: list[OfflineReport],
                 loadavg: tuple[float, float, float]) -> None:
    conc = args.concurrency or "unlimited"
    print(f"workload: {args.num_prompts} requests, dataset {args.dataset}, input {args.input_len}, output "
          f"{args.output_len} (ignore_eos, greedy), endpoint {args.endpoint}, concurrency {conc}, rate {args.request_rate}")
    print(f"machine load average before the run (1/5/15 min): {loadavg[0]:.2f} {loadavg[1]:.2f} {loadavg[2]:.2f}, "
          f"{os.cpu_count()} CPUs")
    rows = [("Successful requests", f"{load.successful}"), ("Failed requests", f"{load.failed}"),
            ("Duration (s)", f"{load.duration_s:.2f}"), ("Prompt tokens", f"{load.prompt_tokens}"),
            ("Output tokens", f"{load.output_tokens}"), ("Request throughput (req/s)", f"{load.request_throughput:.2f}"),
            ("Output token throughput (tok/s)", f"{load.output_throughput:.1f}"),
            ("Total token throughput (tok/s)", f"{load.total_token_throughput:.1f}")]
    print(f"{'=' * 22} HTTP serving {'=' * 22}")
    for name, value in rows:
        print(f"{name:<40}{value:>18}")
    print(f"{'(ms)':<10}{'mean':>12}{'median':>12}{'p90':>12}{'p99':>12}")
    for name, pct in (("TTFT", load.ttft_ms), ("TPOT", load.tpot_ms), ("ITL", load.itl_ms), ("E2E", load.e2e_ms)):
        print(f"{name:<10}" + "".join(f"{'-' if v is None else f'{v:.1f}':>12}" for v in (pct.mean, pct.median, pct.p90, pct.p99)))
    server_cpu = f", server {load.server_cpu_s:.1f}" if load.server_cpu_s is not None else ""
    other = f", other processes {load.other_cpu_s:.1f}" if load.other_cpu_s is not None else ""
    print(f"CPU seconds during the run: client {load.client_cpu_s:.1f}{server_cpu}{other} (wall {load.duration_s:.1f})")
    for error in load.errors:
        print(f"  failure: {error}")
    if offline:
        print(f"{'=' * 11} offline engine (LLM.generate), same prompts {'=' * 2}")
        print(f"{'max_num_seqs':<14}{'seconds':>9}{'out tok/s':>11}{'CPU s':>8}{'other CPU s':>13}{'HTTP / offline':>16}")
        for o in offline:
            other = "-" if o.other_cpu_s is None else f"{o.other_cpu_s:.1f}"
            print(f"{o.max_num_seqs:<14}{o.seconds:>9.2f}{o.output_throughput:>11.1f}{o.cpu_s:>8.1f}{other:>13}"
                  f"{load.output_throughput / o.output_throughput:>16.1%}")
        print(f"torch threads: {offline[0].threads} (offline and launched server)")


def print_rounds(rounds: list[Round]) -> None:
    if len(rounds) < 2:
        return
    widths = [o.max_num_seqs for o in rounds[0].offline]
    print(f"{'=' * 18} rounds (offline, then HTTP) {'=' * 10}")
    print(f"{'round':<7}{'HTTP tok/s':>11}" + "".join(f"{f'offline {w}':>15}{'HTTP/offline':>14}" for w in widths))
    for i, r in enumerate(rounds, 1):
        cells = "".join(f"{o.output_throughput:>15.1f}{ratio:>14.1%}" for o, ratio in zip(r.offline, r.ratios()))
        print(f"{i:<7}{r.load.output_throughput:>11.1f}{cells}")
    if widths:
        medians = ", ".join(f"{m:.1%} (offline max_num_seqs {w})" for w, m in zip(widths, median_ratios(rounds)))
        print(f"median HTTP / offline over {len(rounds)} rounds: {medians}")


def write_json(path: str, args: argparse.Namespace, url: str, model: str, rounds: list[Round],
               loadavg: tuple[float, float, float], server: Launched | None) -> None:
    load, offline = rounds[-1].load, rounds[-1].offline
    medians = median_ratios(rounds) if offline else []
    result = {
        "bench": "serve", "base_url": url, "model": model, "endpoint": args.endpoint, "dataset": args.dataset,
        "num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
        "concurrency": args.concurrency, "request_rate": args.request_rate if args.request_rate != float("inf") else "inf",
        "seed": args.seed, "warmup": args.warmup, "load": asdict(load),
        # load/offline: the last round. offline[0]: the server's engine flags; offline[1], if present:
        # max_num_seqs = --concurrency. The ratios are medians over the rounds.
        "offline": [asdict(o) for o in offline],
        "ratio_http_over_offline": medians[0] if medians else None,
        "ratio_http_over_offline_same_width": medians[-1] if len(medians) > 1 else None,
        "rounds": [{"http_output_throughput": r.load.output_throughput,
                    "offline_output_throughput": [o.output_throughput for o in r.offline],
                    "ratios": r.ratios()} for r in rounds],
        "server": ({"command": server.command, "omp_num_threads": server.threads} if server else None),
        "engine_flags": {"max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
                         "kv_cache_memory": args.kv_cache_memory} if (server or offline) else None,
        "machine": {"cpus": os.cpu_count(), "loadavg_before": loadavg, "loadavg_after": os.getloadavg(),
                    "python": platform.python_version()},
        "source": source_revision(),
    }
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")


def source_revision() -> str | None:
    """The checkout's commit (+ '-dirty' with local changes): the code keeps moving, numbers need a version."""
    repo = Path(__file__).resolve().parents[1]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo, capture_output=True,
                               text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


# --- main -----------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:  # checked here so a missing client library is one line, not a traceback
        import aiohttp  # noqa: F401 - the load
        import httpx  # noqa: F401 - setup requests
    except ImportError as exc:
        print(f"{PROG}: error: needs {exc.name} (pip install aiohttp httpx)", file=sys.stderr)
        return 2
    launched: list[Launched] = []  # filled by run(); stopped here whatever happens
    code = 1
    try:
        code = run(args, launched)
        return code
    except BenchError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        code = 2
        return code
    finally:
        for server in launched:
            stop_server(server)
            if server.temp_log and code == 0:
                Path(server.log_path).unlink(missing_ok=True)


def run(args: argparse.Namespace, launched: list[Launched]) -> int:
    import httpx

    loadavg = os.getloadavg()
    if args.dataset != "random":
        read_dataset(Path(args.dataset))  # a bad file fails before any model loads
    token_ids = args.dataset == "random" and args.endpoint == "completions"
    vocab = args.vocab_size
    offline: list[OfflineReport] = []
    if args.compare_offline:  # first, while nothing else of ours runs
        if token_ids and vocab is None:
            vocab = local_vocab(args.model)
        offline = offline_round(args, vocab)
    url, server = launch_if_asked(args, args.threads or (offline[0].threads if offline else None))
    if server is not None:
        launched.append(server)
    try:
        with httpx.Client(timeout=10.0, trust_env=False) as client:
            wait_until_ready(client, url, args.ready_timeout, server.proc if server else None,
                             server.log_path if server else None)
            model = args.model or served_model(client, url)
            if token_ids and vocab is None:
                vocab = probe_vocab(client, url, model)
    except (httpx.HTTPError, ValueError, KeyError) as exc:  # a server that answers, but not like an OpenAI one
        raise BenchError(f"setting up against {url} failed: {type(exc).__name__}: {exc}") from None
    # the same seeds and vocabulary give the offline run's prompts again
    prompts = make_prompts(args, vocab, args.seed, args.num_prompts)
    bodies = [request_body(args.endpoint, model, p, args.output_len) for p in prompts]
    warmup = [request_body(args.endpoint, model, p, warmup_len(args))
              for p in make_prompts(args, vocab, args.seed + 1, args.warmup)]
    prompt_lens = [len(p) if isinstance(p, list) else None for p in prompts]
    endpoint_url = f"{url}/v1/chat/completions" if args.endpoint == "chat" else f"{url}/v1/completions"
    rounds: list[Round] = []
    for r in range(args.rounds):
        if r and args.compare_offline:  # the server idles meanwhile
            offline = offline_round(args, vocab)
        print(f"HTTP load: {endpoint_url}, model {model}, {len(bodies)} requests ...", flush=True)
        done = asyncio.run(run_load(args, endpoint_url, bodies, prompt_lens, warmup, server.proc.pid if server else None))
        load = summarize(done.results, done.duration, done.client_cpu, done.server_cpu, done.other_cpu)
        rounds.append(Round(load, offline))
    print_report(args, load, offline, loadavg)
    print_rounds(rounds)
    write_json(args.out, args, url, model, rounds, loadavg, server)
    if load.successful == 0:
        print(f"{PROG}: error: every request failed", file=sys.stderr)
        return 1
    return 0


def offline_round(args: argparse.Namespace, vocab: int | None) -> list[OfflineReport]:
    print(f"offline engine: {args.model}, {args.num_prompts} requests ...", flush=True)
    return run_offline(args, make_prompts(args, vocab, args.seed, args.num_prompts),
                       make_prompts(args, vocab, args.seed + 1, args.warmup))


def launch_if_asked(args: argparse.Namespace, threads: int | None) -> tuple[str, Launched | None]:
    """The URL to benchmark, and the server process this run started (if any)."""
    if not (args.launch or args.launch_model):
        return base_url(args), None
    if args.launch_model:
        port = free_port()
        url, command = f"http://127.0.0.1:{port}", launch_command(args, port)
    else:
        url, command = base_url(args), user_command(args.launch)
    server = start_server(command, threads, args.server_log)
    print(f"launched: {shlex.join(command)} (log {server.log_path})", flush=True)
    return url, server


def local_vocab(model: str) -> int:
    """The model's vocabulary size without building it (preset table or config.json)."""
    from locus.engine.config import load_config
    from locus.engine.presets import PRESETS

    if model in PRESETS:
        return PRESETS[model].vocab_size
    try:
        return load_config(Path(model)).vocab_size
    except Exception as exc:  # noqa: BLE001 - any unreadable model is a setup error here
        raise BenchError(f"--model {model!r}: cannot read its vocabulary ({exc}); pass --vocab-size") from None


if __name__ == "__main__":
    sys.exit(main())
