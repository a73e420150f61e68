"""Record a domain-tagged routing trace of the trained `mini` model and of the random `small` preset,
and print what `locus trace stats` says about each (issue 28, part 4).

Prompts are held-out documents of the training corpus, cut to --prompt-tokens tokens of the mini
tokenizer (the same text goes to both models), tagged with their domain; every request samples
--max-tokens tokens (temperature 0.8, seeded). The traces are written to --out/<model> and can be fed
to `locus trace stats`, `locus plan` and `locus replay` like any other.

    python bench/mini_trace.py [--corpus DIR] [--requests-per-domain 40] [--out results/tmp/mini_trace]

Without --corpus the prompts come from the model's heldout_sample.json (a few documents a domain; cut
into several prompts each).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from serve_lib.domain_text import domain_prompts  # noqa: E402


def record(model: str, prompts: list[tuple[str, str]], out: Path, max_tokens: int, seed: int) -> dict:
    from locus.engine.frontend.llm import LLM
    from locus.engine.sampling.sampler import SamplingParams
    from locus.traces.reader import TraceReader
    from locus.traces.stats import compute_stats

    llm = LLM(model, seed=0)
    core = llm.engine
    path = out / model
    if path.exists():
        import shutil

        shutil.rmtree(path)
    core.start_recording(path, model)
    t0 = time.monotonic()
    for i, (domain, text) in enumerate(prompts):
        ids = llm.tokenizer.encode(text)
        params = SamplingParams(max_tokens=max_tokens, temperature=0.8, top_k=40, seed=seed + i)
        core.add_request(f"{domain}-{i}", ids, params, domain=domain)
    while core.has_unfinished():
        core.step()
    core.dump_recording()
    seconds = time.monotonic() - t0
    stats = compute_stats(TraceReader(path))
    return {"model": model, "trace": str(path), "requests": stats.num_requests, "tokens": stats.num_tokens,
            "seconds": round(seconds, 1), "experts": stats.num_experts, "top_k": stats.top_k,
            "moe_layers": list(stats.moe_layers), "js_mean": stats.js_mean, "js_max": stats.js_max,
            "js_layer_max": stats.js_layer_max, "pd_cosine": stats.pd_cosine, "pd_cosine_baseline": stats.pd_cosine_baseline,
            "pd_coverage": stats.pd_coverage, "pd_coverage_baseline": stats.pd_coverage_baseline, "top_n": stats.top_n,
            "max_mean": stats.max_mean_mean, "max_mean_worst": stats.max_mean_worst, "cv": stats.cv_mean,
            "inter_layer_mi": stats.inter_layer_mi, "domain_js": stats.domain_js}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="mini,small", help="comma-separated models to record (default mini,small)")
    ap.add_argument("--corpus", default=None, help="a `locus train` corpus directory (held-out documents as prompts)")
    ap.add_argument("--requests-per-domain", type=int, default=40)
    ap.add_argument("--prompt-tokens", type=int, default=48, help="prompt length in mini tokens")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="results/tmp/mini_trace")
    ap.add_argument("--json", default=None, help="write the rows here too")
    args = ap.parse_args(argv)

    from locus.engine.checkpoint.loader import shipped_model
    from locus.training.tokenizer import load_trained

    mini = shipped_model("mini")
    if mini is None:
        print("locus/assets/mini is missing: train it first (docs/training.md)", file=sys.stderr)
        return 2
    tok = load_trained(mini / "tokenizer.json")
    prompts = domain_prompts(tok, args.corpus, mini / "heldout_sample.json", args.requests_per_domain, args.prompt_tokens)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = [record(m, prompts, out, args.max_tokens, args.seed) for m in args.models.split(",")]
    print(f"{len(prompts)} requests ({args.requests_per_domain} a domain at most), prompts of <= {args.prompt_tokens} "
          f"mini tokens, {args.max_tokens} sampled tokens each\n")
    print("| model | experts, top-k, MoE layers | domain JSD mean / max (bits) | prefill->decode cosine (baseline) "
          "| decode coverage by prefill top-n (baseline) | load max/mean (worst layer) | cv |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['experts']}, {r['top_k']}, {r['moe_layers']} | {r['js_mean']:.3f} / {r['js_max']:.3f} | "
              f"{r['pd_cosine']:.3f} ({r['pd_cosine_baseline']:.3f}) | {r['pd_coverage']:.3f} ({r['pd_coverage_baseline']:.3f}), "
              f"n={r['top_n']} | {r['max_mean']:.2f} ({r['max_mean_worst']:.2f}) | {r['cv']:.2f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
