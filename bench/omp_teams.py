"""What a second OpenMP team costs the engine: offline throughput while another thread that once ran a
parallel torch op is alive, against the engine's thread alone.

Every thread that runs a parallel region gets its own OpenMP team (here: itself and one worker), and
the team stays as long as the thread lives. Once a process has more OpenMP threads than cores,
libgomp cuts how long idle workers spin before they sleep (its "throttled" spin count), so the
engine's worker sleeps between the forward's parallel regions and pays a wake-up at each one. With
torch's threads filling every core (2 here), one helper thread is enough. The server therefore runs
torch only on its engine thread (docs/serving.md).

Each round times the same workload three times: one team; a helper thread alive that ran one
parallel op (`torch.ones(4M).add_(1)`) and now waits; the helper gone.

    python bench/omp_teams.py [--model small --prompts 32 --prompt-len 64 --new-tokens 64 --rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path

PHASES = ("one team", "second team alive", "second team gone")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="results/omp_teams.json")
    args = p.parse_args(argv)

    import torch

    from locus.engine.frontend.llm import LLM
    from locus.engine.sampling.params import SamplingParams

    llm = LLM(args.model, seed=0)
    vocab = min(llm.engine.model.config.vocab_size, 32000)
    rng = random.Random(0)

    def prompts() -> list[list[int]]:  # fresh ones every run: no prefix-cache hits
        return [[rng.randrange(3, vocab) for _ in range(args.prompt_len)] for _ in range(args.prompts)]

    def throughput() -> float:
        llm.generate(prompts(), SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))  # warm-up
        start = time.perf_counter()
        llm.generate(prompts(), SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True))
        return args.prompts * args.new_tokens / (time.perf_counter() - start)

    def helper(release: threading.Event) -> None:
        torch.ones(1 << 22).add_(1)  # large enough to run in parallel: this thread's own team
        release.wait()

    runs: dict[str, list[float]] = {phase: [] for phase in PHASES}
    for _ in range(args.rounds):
        runs[PHASES[0]].append(throughput())
        release = threading.Event()
        thread = threading.Thread(target=helper, args=(release,), daemon=True)
        thread.start()
        time.sleep(0.2)  # its parallel op is done; it only waits now
        runs[PHASES[1]].append(throughput())
        release.set()
        thread.join()
        runs[PHASES[2]].append(throughput())

    base = statistics.median(runs[PHASES[0]])
    print(f"workload: {args.prompts} prompts x {args.prompt_len} tokens, {args.new_tokens} new, model {args.model}; "
          f"{torch.get_num_threads()} torch threads, {os.cpu_count()} CPUs")
    print(f"{'phase':<20}{'out tok/s (median)':>20}{'vs one team':>13}   runs")
    for phase in PHASES:
        med = statistics.median(runs[phase])
        print(f"{phase:<20}{med:>20,.0f}{med / base:>12.1%}   {', '.join(f'{v:,.0f}' for v in runs[phase])}")
    result = {"workload": vars(args), "torch_threads": torch.get_num_threads(), "cpus": os.cpu_count(),
              "runs": runs, "median": {phase: statistics.median(v) for phase, v in runs.items()}}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
