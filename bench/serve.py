"""HTTP load benchmark: stream many requests at a running `locus serve` (or one it starts) and report
latency (TTFT, TPOT, ITL, end-to-end) and throughput; optionally run the same workload through the
in-process offline engine first and report HTTP / offline output-token throughput side by side.

Default workload mirrors bench/offline.py: prompts of `--input-len` random token ids (drawn in
[3, min(vocab, 32000)), seeded) sent as token-id lists to /v1/completions so prompt lengths are
exact, `--output-len` new tokens with `ignore_eos` so output lengths are exact, temperature 0.

    python bench/serve.py --base-url http://127.0.0.1:8000 --num-prompts 64 --concurrency 32
    locus bench serve --launch-model small --compare-offline --num-prompts 64 --input-len 64 \\
        --output-len 64 --concurrency 32 --request-rate inf --rounds 9 --out results/serve.json

Measurements (all client-side, from `time.perf_counter`):
- TTFT: request sent -> first SSE chunk carrying a generated token (chat's role-only preamble does not count).
- ITL: gaps between consecutive token-carrying chunks.
- TPOT: (E2E - TTFT) / (output tokens - 1), output tokens from the `usage` chunk.
- E2E: request sent -> end of stream.
- duration: first request sent -> last request done; throughputs divide by it.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from serve_lib.common import PROG, BenchError
from serve_lib.load import run_load, run_on_fastest_loop, summarize
from serve_lib.offline import OfflineReport, run_offline
from serve_lib.prompts import make_prompts, read_dataset, request_body, warmup_len
from serve_lib.report import Round, print_report, print_rounds, write_json
from serve_lib.server import (
    Launched,
    free_port,
    launch_command,
    probe_vocab,
    served_model,
    start_server,
    stop_server,
    user_command,
    wait_until_ready,
)


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
    load.add_argument("--client", choices=["raw", "aiohttp"], default="raw",
                      help="the load's HTTP client: raw (a connection per request; reads recorded with their arrival "
                           "times and parsed after the run: least CPU, which matters when client and server "
                           "share cores) or aiohttp "
                           "(pooled keep-alive connections, as vLLM's benchmark)")

    engine = p.add_argument_group("engine (for --compare-offline and --launch-model; match the server's)")
    engine.add_argument("--compare-offline", action="store_true",
                        help="first run the same workload through locus.engine.frontend.llm.LLM in this process")
    engine.add_argument("--max-num-seqs", type=int, default=256)
    engine.add_argument("--max-num-batched-tokens", type=int, default=2048)
    engine.add_argument("--kv-cache-memory", default="1GiB")
    engine.add_argument("--dtype", default=None)
    engine.add_argument("--device", default=None)
    engine.add_argument("--moe-backend", default="auto")
    engine.add_argument("--model-seed", type=int, default=0, help="weight seed for presets (server --seed)")
    engine.add_argument("--compile", action="store_true",
                        help="compiled decode steps (torch.compile per batch-size bucket) in the offline engine and the "
                             "launched server alike")
    engine.add_argument("--enforce-eager", action="store_true",
                        help="no CUDA-graph decode (captured by default on CUDA), both sides")
    engine.add_argument("--compile-buckets", default=None, metavar="B1,B2,...",
                        help="decode batch sizes to compile, both sides (default: the engine's, 1, 2, 4, ... up to "
                             "--max-num-seqs)")
    engine.add_argument("--threads", type=int, default=None,
                        help="torch threads for the offline engine and the launched server (default: torch's "
                             "default here, passed to the server as OMP_NUM_THREADS so both match)")

    p.add_argument("--compare-constrained", type=float, default=None, metavar="FRACTION",
                   help="after each HTTP run, run the same workload again with this fraction of the requests "
                        "constrained (structured outputs: a regex of exactly --output-len characters) and report "
                        "constrained / free output-token throughput, side by side")
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
    if args.compare_constrained is not None and not 0 < args.compare_constrained <= 1:
        p.error("--compare-constrained must be in (0, 1]")
    if args.concurrency is not None and args.concurrency < 1:
        p.error("--concurrency must be positive")
    if args.request_rate <= 0:
        p.error("--request-rate must be positive (inf: all at once)")
    if args.compile_buckets is not None:
        from locus.engine.runner.decode_graph import parse_buckets

        try:
            args.compile_buckets = tuple(parse_buckets(args.compile_buckets))
        except ValueError as exc:
            p.error(str(exc))
        if not args.compile:
            p.error("--compile-buckets needs --compile")
    if args.launch and args.launch_model:
        p.error("give --launch or --launch-model, not both")
    args.model = args.model or args.launch_model
    if args.compare_offline and not args.model:
        p.error("--compare-offline needs --model or --launch-model (the offline engine loads it)")
    return args


def constrain(bodies: list[dict], args: argparse.Namespace) -> list[dict]:
    """Every k-th request (k from the fraction) gets a structured-output constraint that allows exactly
    --output-len characters, so constrained requests generate as much as free ones. The warm-up's
    constrained requests compile the grammar (a one-time cost per distinct spec, then cached)."""
    every = max(1, round(1 / args.compare_constrained))
    pattern = f"[a-z ]{{{args.output_len}}}"
    return [{**b, "guided_regex": pattern} if i % every == 0 else b for i, b in enumerate(bodies)]


def report_constrained(args: argparse.Namespace, pairs: list[tuple]) -> None:
    import json
    import statistics

    ratios = [c.output_throughput / f.output_throughput for f, c in pairs]
    print(f"\nconstrained ({args.compare_constrained:.0%} of requests) vs free, output tokens/s:")
    for i, ((f, c), ratio) in enumerate(zip(pairs, ratios)):
        print(f"  round {i + 1}: free {f.output_throughput:.1f}, constrained {c.output_throughput:.1f}, ratio {ratio:.3f}")
    print(f"  median ratio {statistics.median(ratios):.3f}")
    out = Path(args.out)
    result = json.loads(out.read_text())
    result["constrained"] = {"fraction": args.compare_constrained, "median_ratio": statistics.median(ratios),
                             "rounds": [{"free": f.output_throughput, "constrained": c.output_throughput,
                                         "failed": c.failed} for f, c in pairs]}
    out.write_text(json.dumps(result, indent=1) + "\n")


def base_url(args: argparse.Namespace) -> str:
    if args.base_url:
        return args.base_url.rstrip("/")
    port = args.port
    words = shlex.split(args.launch) if args.launch else []
    if port is None and "--port" in words[:-1]:  # the launched command names its own port
        value = words[words.index("--port") + 1]
        port = int(value) if value.isdigit() else None
    return f"http://{args.host}:{port or 8000}"


# --- main -----------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:  # checked here so a missing client library is one line, not a traceback
        import httpx  # noqa: F401 - setup requests
        if args.client == "aiohttp":
            import aiohttp  # noqa: F401 - the load
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
    endpoint_url = f"{url}/v1/chat/completions" if args.endpoint == "chat" else f"{url}/v1/completions"
    rounds: list[Round] = []
    constrained: list[tuple] = []  # (free, constrained) LoadReports per round
    for r in range(args.rounds):
        if r and args.compare_offline:  # the server idles meanwhile
            offline = offline_round(args, vocab, r)
        # the same seeds and vocabulary give the offline run's prompts again
        prompts, warmup_prompts = round_prompts(args, vocab, r)
        bodies = [request_body(args.endpoint, model, p, args.output_len) for p in prompts]
        warmup = [request_body(args.endpoint, model, p, warmup_len(args)) for p in warmup_prompts]
        prompt_lens = [len(p) if isinstance(p, list) else None for p in prompts]
        print(f"HTTP load: {endpoint_url}, model {model}, {len(bodies)} requests ...", flush=True)
        done, client_loop = run_on_fastest_loop(
            run_load(args, endpoint_url, bodies, prompt_lens, warmup, server.proc.pid if server else None))
        load = summarize(done.results, done.duration, done.client_cpu, done.server_cpu, done.other_cpu, client_loop)
        rounds.append(Round(load, offline))
        if args.compare_constrained:  # the same requests, a fraction of them constrained, right after
            print(f"HTTP load, {args.compare_constrained:.0%} constrained ...", flush=True)
            done, client_loop = run_on_fastest_loop(
                run_load(args, endpoint_url, constrain(bodies, args), prompt_lens, constrain(warmup, args),
                         server.proc.pid if server else None))
            constrained.append((load, summarize(done.results, done.duration, done.client_cpu, done.server_cpu,
                                                done.other_cpu, client_loop)))
    print_report(args, load, offline, loadavg)
    print_rounds(rounds)
    write_json(args.out, args, url, model, rounds, loadavg, server)
    if constrained:
        report_constrained(args, constrained)
    if load.successful == 0:
        print(f"{PROG}: error: every request failed", file=sys.stderr)
        return 1
    return 0


def round_prompts(args: argparse.Namespace, vocab: int | None, r: int) -> tuple[list, list]:
    """Round r's prompts and warm-up prompts, from seeds seed + 2r and seed + 2r + 1. Each round
    draws new ones: repeating prompts against one server would hit its prefix cache and skip their
    prefill (a --dataset file repeats its lines whatever the seed)."""
    seed = args.seed + 2 * r
    return make_prompts(args, vocab, seed, args.num_prompts), make_prompts(args, vocab, seed + 1, args.warmup)


def offline_round(args: argparse.Namespace, vocab: int | None, r: int = 0) -> list[OfflineReport]:
    print(f"offline engine: {args.model}, {args.num_prompts} requests ...", flush=True)
    return run_offline(args, *round_prompts(args, vocab, r))


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
    from locus.engine.model.config import load_config
    from locus.engine.checkpoint.presets import PRESETS

    if model in PRESETS:
        return PRESETS[model].vocab_size
    try:
        return load_config(Path(model)).vocab_size
    except Exception as exc:  # noqa: BLE001 - any unreadable model is a setup error here
        raise BenchError(f"--model {model!r}: cannot read its vocabulary ({exc}); pass --vocab-size") from None


if __name__ == "__main__":
    sys.exit(main())
