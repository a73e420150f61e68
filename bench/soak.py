"""Soak: thousands of mixed requests against a server with a tiny KV pool, to show that no request
and no load pattern kills or wedges the engine, and that memory stays flat.

The server runs the `tiny` preset with 16 KV blocks of 16 tokens (256 tokens of KV for 8 sequences
at once, so preemption never stops), a waiting-queue limit, and requests that mix n = 1..3,
streamed and whole responses, seeds, stop strings, logprobs, clients that leave mid-stream, and
bodies that must be refused (400). A 503 (queue full) is retried after its Retry-After, as the
openai client does, for up to RETRY_FOR_S seconds. The server's RSS is sampled as the run goes; the report gives the RSS after
the first 10% of requests (warm) and at the end, and the slope over the second half.

    python bench/soak.py [--requests 2000 --concurrency 16 --seed 0 --out results/soak.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from pathlib import Path

from serve_lib.server import free_port, log_tail, start_server, stop_server, wait_until_ready

RETRY_FOR_S = 300.0  # a request refused (503) for this long counts as not answered


def server_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def make_request(rng: random.Random, i: int) -> tuple[str, dict, str]:
    """(path, body, kind): kind is 'ok', 'bad' (must get a 400) or 'leave' (the client disconnects)."""
    roll = rng.random()
    kind = "bad" if roll < 0.05 else "leave" if roll < 0.10 else "ok"
    text = "".join(rng.choice("abcdefghij klmnopqrstuvwxyz.,\u00e9\u2028") for _ in range(rng.randint(5, 80)))
    body = {"max_tokens": rng.randint(1, 32), "n": rng.randint(1, 3), "temperature": rng.choice([0, 0.8]),
            "stream": kind == "leave" or rng.random() < 0.5, "ignore_eos": rng.random() < 0.7}
    if rng.random() < 0.3:
        body["seed"] = rng.randrange(1 << 31)
    if rng.random() < 0.2:
        body["stop"] = [rng.choice("aeiou")]
    if rng.random() < 0.2:
        body["logprobs"] = rng.randint(0, 3)
    if kind == "bad":
        body[rng.choice(["top_k", "n", "temperature", "max_tokens"])] = rng.choice([2**63, -7, 1e9, "x"])
    if rng.random() < 0.5:
        return "/v1/completions", {**body, "prompt": text}, kind
    if "logprobs" in body:
        body["logprobs"], body["top_logprobs"] = True, body["logprobs"]
    return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": text}]}, kind


async def send(client, path: str, body: dict, kind: str, retries: Counter) -> str:
    """The outcome: 'completed', 'refused-400', 'left', or what went wrong."""
    give_up = time.monotonic() + RETRY_FOR_S
    while time.monotonic() < give_up:
        async with client.stream("POST", path, json=body) as r:
            if r.status_code == 503 and r.headers.get("retry-after"):
                await r.aread()
                retries["503-then-retried"] += 1
                await asyncio.sleep(float(r.headers["retry-after"]))
                continue
            if kind == "bad":
                await r.aread()
                return "refused-400" if r.status_code == 400 else f"bad-got-{r.status_code}"
            if r.status_code != 200:
                return f"status-{r.status_code}: {(await r.aread())[:200]!r}"
            if kind == "leave":
                async for _ in r.aiter_lines():
                    break  # one line, then close the connection mid-stream
                return "left"
            if not body.get("stream"):
                data = json.loads(await r.aread())
                return "completed" if len(data["choices"]) == body["n"] else "wrong-choices"
            lines = [line async for line in r.aiter_lines() if line]
            if lines[-1] != "data: [DONE]" or any('"error"' in line for line in lines):
                return f"broken-stream: {lines[-1][:200]}"
            return "completed"
    return "refused-for-too-long"


async def run(args: argparse.Namespace, url: str, pid: int) -> dict:
    import httpx

    rng = random.Random(args.seed)
    requests = [make_request(rng, i) for i in range(args.requests)]
    outcomes: Counter = Counter()
    retries: Counter = Counter()
    rss: list[tuple[int, float]] = []
    done = 0
    queue: asyncio.Queue = asyncio.Queue()
    for item in requests:
        queue.put_nowait(item)

    async def worker(client) -> None:
        nonlocal done
        while not queue.empty():
            path, body, kind = queue.get_nowait()
            outcomes[await send(client, path, body, kind, retries)] += 1
            done += 1
            if done % max(1, args.requests // 50) == 0:
                rss.append((done, server_rss_mib(pid)))
                health = await client.get("/health")
                if health.status_code != 200:
                    outcomes["unhealthy"] += 1

    limits = httpx.Limits(max_connections=args.concurrency * 2)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        start = time.monotonic()
        await asyncio.gather(*(worker(client) for _ in range(args.concurrency)))
        seconds = time.monotonic() - start
        metrics = (await client.get("/metrics")).text
    preemptions = next((float(line.split()[-1]) for line in metrics.splitlines()
                        if line.startswith("locus_num_preemptions_total")), None)
    return {"outcomes": dict(outcomes), "retries_after_503": retries["503-then-retried"], "rss_mib": rss,
            "seconds": seconds, "preemptions": preemptions}


def rss_slope(samples: list[tuple[int, float]]) -> float:
    """MiB per 1,000 requests over the second half (least squares)."""
    half = samples[len(samples) // 2:]
    if len(half) < 2:
        return 0.0
    xs, ys = [x for x, _ in half], [y for _, y in half]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    return 1000 * sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-waiting", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="results/soak.json")
    args = p.parse_args(argv)

    port = free_port()
    cmd = [sys.executable, "-m", "locus.cli", "serve", "--model", "tiny", "--port", str(port),
           "--num-kv-blocks", str(args.num_kv_blocks), "--block-size", "16", "--max-num-seqs", str(args.max_num_seqs),
           "--max-waiting", str(args.max_waiting), "--log-level", "warning"]
    server = start_server(cmd, None, None)
    url = f"http://127.0.0.1:{port}"
    try:
        import httpx

        with httpx.Client() as client:
            wait_until_ready(client, url, 120, server.proc, server.log_path)
        result = asyncio.run(run(args, url, server.proc.pid))
        alive = server.proc.poll() is None
    finally:
        stop_server(server)
    samples = result["rss_mib"]
    warm = samples[max(0, len(samples) // 10 - 1)][1] if samples else None
    report = {"requests": args.requests, "concurrency": args.concurrency, "num_kv_blocks": args.num_kv_blocks,
              "block_size": 16, "max_num_seqs": args.max_num_seqs, "max_waiting": args.max_waiting,
              "server_alive_at_end": alive, "exit_code": server.proc.returncode, **result,
              "rss_warm_mib": warm, "rss_end_mib": samples[-1][1] if samples else None,
              "rss_slope_mib_per_1k_requests": rss_slope(samples)}
    expected = {"completed", "refused-400", "left"}
    failures = {k: v for k, v in result["outcomes"].items() if k not in expected}
    print(f"{args.requests} requests in {result['seconds']:.0f} s at concurrency {args.concurrency}, "
          f"{args.num_kv_blocks} KV blocks x 16 tokens, {result['preemptions']:.0f} preemptions, "
          f"{result['retries_after_503']} retries after a 503")
    print("| outcome | requests |\n|---|---|")
    for k, v in sorted(result["outcomes"].items()):
        print(f"| {k} | {v} |")
    print(f"server RSS: {warm:.0f} MiB warm -> {report['rss_end_mib']:.0f} MiB at the end; "
          f"second-half slope {report['rss_slope_mib_per_1k_requests']:+.2f} MiB per 1,000 requests; "
          f"alive at the end: {alive}, exit code after SIGTERM: {server.proc.returncode}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    if failures or not alive or server.proc.returncode != 0:
        print(f"soak FAILED: {failures or 'the server died'}{log_tail(server.log_path)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
