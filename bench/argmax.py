"""The greedy token over the compiled CPU decode step's [V, B] logits: each way of taking it, timed.

    python bench/argmax.py --out results/argmax.json            # V = 32000 (the presets), B = 32
    python bench/argmax.py --vocab 202048 --batch 8,32,64       # Llama 4's vocabulary

Forms, all over the same logits `W @ h^T` laid out [V, B] (what decode_graph.py computes):
    aten         logits.T.argmax(-1), eager (the strided reduction)
    inductor     torch.compile of the same (the generated reduction the graph had before)
    c kernel     locus::vocab_argmax (locus/kernels/argmax_cpu.c), what the compiled CPU step runs
Each is checked against aten on the timed inputs. Median of --repeat calls after a warm-up; the
logits are in cache, as they are in the step (the lm_head has just written them).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch


def median_us(fn, repeat: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batch", default="32", help="comma-separated sequence counts B")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--repeat", type=int, default=50)
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    args = p.parse_args(argv)

    from locus.kernels import argmax_cpu

    if argmax_cpu.load_library() is None:
        p.error("the C argmax kernel could not be built here (no C compiler?)")
    rows = []
    print(f"argmax over [V, B] logits, V = {args.vocab}, {torch.get_num_threads()} threads, median of {args.repeat}")
    print("| dtype | B | aten us | inductor us | c kernel us | aten / c | inductor / c |\n|---|---|---|---|---|---|---|")
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        for B in (int(b) for b in args.batch.split(",")):
            torch.manual_seed(B)
            logits = (torch.randn(args.vocab, 64, dtype=dtype) @ torch.randn(B, 64, dtype=dtype).T).contiguous()
            compiled = torch.compile(lambda x: x.T.argmax(-1), dynamic=False)
            expected = logits.T.argmax(-1)
            for form in (compiled, argmax_cpu.vocab_argmax):
                if not torch.equal(form(logits), expected):
                    raise SystemExit(f"{name} B={B}: a form disagrees with aten's argmax")
            us = {"aten": median_us(lambda: logits.T.argmax(-1), args.repeat),
                  "inductor": median_us(lambda: compiled(logits), args.repeat),
                  "c kernel": median_us(lambda: argmax_cpu.vocab_argmax(logits), args.repeat)}
            rows.append({"dtype": name, "V": args.vocab, "B": B, "us": us})
            print(f"| {name} | {B} | {us['aten']:.0f} | {us['inductor']:.0f} | {us['c kernel']:.0f} | "
                  f"{us['aten'] / us['c kernel']:.1f}x | {us['inductor'] / us['c kernel']:.1f}x |")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"benchmark": "argmax", "threads": torch.get_num_threads(),
                                              "rows": rows}, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
