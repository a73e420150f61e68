"""What recording expert traces costs: offline engine throughput with and without the recorder.

Same model, prompts and engine settings; runs alternate (off, on, off, on, ...) so that machine noise
hits both sides alike, and the best run of each side is compared. Target (trace issue): < 5% loss.
Prefix caching is off in both arms, since recording turns it off.

    python bench/trace_overhead.py [--model small --prompts 32 --prompt-len 64 --new-tokens 64 --repeats 3]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="results/trace_overhead.json")
    args = p.parse_args(argv)

    from locus.engine.core.engine_core import EngineConfig
    from locus.engine.frontend.llm import LLM
    from locus.engine.sampling.sampler import SamplingParams

    llm = LLM(args.model, device="cpu", moe_backend="torch",
              engine_config=EngineConfig(enable_prefix_caching=False, max_num_batched_tokens=4096))
    vocab = llm.engine.model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, min(vocab, 32000), (args.prompts, args.prompt_len), generator=g).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)
    total = args.prompts * args.new_tokens
    times: dict[str, list[float]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for arm in ("off", "on"):
                if arm == "on":
                    llm.engine.start_recording(Path(tmp) / f"trace{i}", args.model)
                start = time.perf_counter()
                llm.generate(prompts, params)
                elapsed = time.perf_counter() - start
                if arm == "on":
                    summary = llm.engine.dump_recording()
                    assert summary.requests == args.prompts
                times[arm].append(elapsed)
    best = {arm: min(v) for arm, v in times.items()}
    overhead = best["on"] / best["off"] - 1
    print(f"workload: {args.prompts} prompts x {args.prompt_len} tokens, {args.new_tokens} new, model {args.model}")
    print(f"{'recording':<10}{'best s':>9}{'out tok/s':>11}   runs")
    for arm in ("off", "on"):
        print(f"{arm:<10}{best[arm]:>9.2f}{total / best[arm]:>11.1f}   " + " ".join(f"{t:.2f}" for t in times[arm]))
    print(f"throughput cost of recording: {overhead:+.1%}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"bench": "trace_overhead", **vars(args), "seconds": times,
                                          "best": best, "overhead": overhead}, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
