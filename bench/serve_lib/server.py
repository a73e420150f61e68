"""The server side of bench/serve.py: setup requests (readiness, model, vocabulary) and launching and
stopping a `locus serve` process."""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from serve_lib.common import PROG, BenchError


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
    if args.enforce_eager:
        cmd.append("--enforce-eager")
    if args.compile:
        cmd.append("--compile")
        if args.compile_buckets:
            cmd += ["--compile-buckets", ",".join(map(str, args.compile_buckets))]
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
