"""Where a decode step's time goes: torch-profiler table of the offline engine's decode steps.

Workload of bench/offline.py (the `small` preset, 32 prompts of 64 random tokens, greedy): the
prompts are prefilled, a few warm-up decode steps run, then `--steps` decode steps are timed one by
one (median printed) and profiled, ops grouped by input shape.

    python bench/profile_decode.py [--dtype float32|bfloat16] [--steps 20] [--rows 25]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from offline import make_prompts  # the same prompts as bench/offline.py (bench/ is on the path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small", help="preset name or checkpoint dir")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rows", type=int, default=25, help="profiler table rows")
    args = p.parse_args(argv)

    from locus.engine.engine_core import EngineConfig
    from locus.engine.llm import LLM
    from locus.engine.sampling_params import SamplingParams

    llm = LLM(args.model, dtype=args.dtype, device="cpu", moe_backend="torch",
              engine_config=EngineConfig(max_num_seqs=256, max_num_batched_tokens=4096))
    core = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=2 * args.steps + 10, ignore_eos=True)
    for i, prompt in enumerate(make_prompts(args.prompts, args.prompt_len, core.model.config.vocab_size)):
        core.add_request(str(i), prompt, params)
    core.step()  # the prefill
    for _ in range(5):
        core.step()
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        core.step()
        times.append(time.perf_counter() - start)
    with torch.profiler.profile(record_shapes=True) as prof:
        for _ in range(args.steps):
            core.step()
    print(f"{args.model}, {args.dtype}, {args.prompts} sequences, {torch.get_num_threads()} threads: "
          f"decode step median {statistics.median(times) * 1e3:.2f} ms over {args.steps} steps")
    print(f"profiled over {args.steps} steps (divide the totals by {args.steps} for one step):")
    print(prof.key_averages(group_by_input_shape=True).table(
        sort_by="self_cpu_time_total", row_limit=args.rows, max_name_column_width=28, max_shapes_column_width=56))
    return 0


if __name__ == "__main__":
    sys.exit(main())
