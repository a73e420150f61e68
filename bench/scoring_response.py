"""What one scoring request costs the server (issue 55, finding 1): two prompts of 2,048 token ids,
`max_tokens: 0`, `echo`, `logprobs: 5` and `n` choices, against `locus serve --model mini` started here
on a free loopback port. Per `n`: the answer, its time and size, the server's RSS (before, the peak
sampled every 10 ms, and 2 s after the last of --repeat requests) and the longest /health answer while
the last one ran. The baseline is taken after the same prompts are scored for one choice, so it holds
the engine's own high-water mark; what is left is the response's.

    python bench/scoring_response.py [--n 42,128] [--repeat 3] [--serve-flags "--max-logprob-entries 10000000"]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from serve_lib.server import free_port, wait_until_ready  # noqa: E402


def rss_mb(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for process {pid}")


@contextmanager
def served(flags: list[str]):
    """`locus serve --model mini` on a free port, until it answers /health; stopped with SIGTERM."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "locus.cli", "serve", "--model", "mini", "--port", str(port),
                             "--log-level", "warning", *flags])
    url = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(timeout=2) as client:
            wait_until_ready(client, url, 300, proc, None)
        yield proc, url
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def while_watched(pid: int, url: str, send) -> tuple[httpx.Response, float, float]:
    """send()'s answer, the peak RSS (MB) and the longest /health (s) while it ran."""
    peak, longest, done = [rss_mb(pid)], [0.0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], rss_mb(pid))
            time.sleep(0.01)

    def poll() -> None:
        with httpx.Client(base_url=url, timeout=600) as http:
            while not done.is_set():
                started = time.monotonic()
                http.get("/health")
                longest[0] = max(longest[0], time.monotonic() - started)
                time.sleep(0.02)

    threads = [threading.Thread(target=sample), threading.Thread(target=poll)]
    for t in threads:
        t.start()
    try:
        return send(), peak[0], longest[0]
    finally:
        done.set()
        for t in threads:
            t.join()


def measure(n: int, repeat: int, flags: list[str]) -> dict:
    rng = random.Random(0)
    body = {"prompt": [[rng.randrange(5, 4096) for _ in range(2048)] for _ in range(2)], "max_tokens": 0,
            "echo": True, "logprobs": 5, "n": n}
    raw = json.dumps(body).encode()
    with served(flags) as (proc, url), httpx.Client(base_url=url, timeout=600) as http:
        http.post("/v1/completions", json={**body, "n": 1}).raise_for_status()  # the engine's own high-water mark
        time.sleep(1)
        baseline = rss_mb(proc.pid)
        post = lambda: http.post("/v1/completions", content=raw, headers={"content-type": "application/json"})  # noqa: E731
        for _ in range(repeat - 1):
            post()
        started = time.monotonic()
        r, peak, health = while_watched(proc.pid, url, post)
        seconds = time.monotonic() - started
        time.sleep(2)
        after = rss_mb(proc.pid)
    return {"n": n, "entries": 2 * n * 2048 * 6, "status": r.status_code, "response_bytes": len(r.content),
            "seconds": round(seconds, 2), "rss_baseline_mb": round(baseline), "rss_peak_mb": round(peak - baseline),
            "rss_after_mb": round(after - baseline), "health_max_s": round(health, 3), "body_bytes": len(raw),
            "error": r.json()["error"]["message"] if r.status_code != 200 else None}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", default="42,128", help="choices per request, comma-separated (default 42,128)")
    p.add_argument("--repeat", type=int, default=3, help="requests per n; the figures are the last one's (default 3)")
    p.add_argument("--serve-flags", default="", help="more `locus serve` flags, one string")
    p.add_argument("--out", default="results/scoring_response.json")
    args = p.parse_args()
    rows = [measure(int(n), args.repeat, shlex.split(args.serve_flags)) for n in args.n.split(",")]
    print(f"{'n':>4} {'entries':>9} {'status':>6} {'MB out':>7} {'s':>6} {'RSS peak +MB':>12} {'RSS after +MB':>13} "
          f"{'/health max s':>13}")
    for row in rows:
        print(f"{row['n']:>4} {row['entries']:>9} {row['status']:>6} {row['response_bytes'] / 1e6:>7.1f} "
              f"{row['seconds']:>6.2f} {row['rss_peak_mb']:>12} {row['rss_after_mb']:>13} {row['health_max_s']:>13.3f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"serve_flags": args.serve_flags, "repeat": args.repeat, "cpu_count": os.cpu_count(),
                                          "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
