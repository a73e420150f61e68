"""The report of bench/serve.py: rounds and their median ratios, the printed tables and the JSON file."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from serve_lib.load import LoadReport
from serve_lib.offline import OfflineReport
from serve_lib.server import Launched


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
    print(f"CPU seconds during the run: client {load.client_cpu_s:.1f} ({args.client}, {load.client_loop} loop){server_cpu}{other} (wall {load.duration_s:.1f})")
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
        "seed": args.seed, "warmup": args.warmup, "client": args.client, "load": asdict(load),
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
                         "kv_cache_memory": args.kv_cache_memory, "compile": args.compile,
                         "enforce_eager": args.enforce_eager,
                         "compile_buckets": list(args.compile_buckets) if args.compile_buckets else None}
        if (server or offline) else None,
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
    repo = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=repo, capture_output=True,
                               text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
