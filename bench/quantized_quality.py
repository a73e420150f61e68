"""What narrow formats cost the trained `mini` (real learned routing): held-out loss per domain and
greedy agreement with the unquantized model, per format.

    python bench/quantized_quality.py --out results/quantized_quality.json                  # shipped sample
    python bench/quantized_quality.py --corpus RUN/corpus --out results/quantized_quality.json

Data: the held-out documents of a `locus train` corpus (--corpus, the first --bytes-per-domain bytes
of each domain, as bench/mini_heldout.py takes them), else the sample the checkpoint ships
(heldout_sample.json). Each domain's documents are one stream `bos text eot ...` scored in windows of
--seq-len + 1 tokens (bench/mini_heldout.py's windows).

Per format and domain:
    loss       held-out nats per byte; `vs model` is the change against the unquantized model
    top-1      the share of held-out positions where the model's most likely next token is the
               unquantized model's (teacher-forced on the held-out text: every position counts)
    greedy     free-running: each held-out document's first --prompt-tokens tokens as the prompt,
               --greedy-tokens greedy tokens; the share of continuations identical to the
               unquantized model's, and the mean number of tokens before the first difference
Rows (`where`):
    weights    the routed experts' weights in fp8 (row-wise E4M3), mxfp8, mxfp4 (--quantize-experts)
    dispatch   the routed experts' input rows rounded to mxfp8 / mxint8, as an expert-parallel server
               with --ep-dispatch-format delivers them to every expert (one process: simulate_dispatch;
               tests/engine/ep/test_expert_parallel.py checks the ranks compute exactly that)
    both       weights and dispatch quantized (--both WEIGHTS+DISPATCH, e.g. mxfp8+mxfp8)
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from locus.engine.checkpoint.loader import load, shipped_model
from locus.engine.ep.payload import simulate_dispatch
from locus.engine.frontend.llm import LLM
from locus.engine.sampling.sampler import SamplingParams
from locus.training.train import rows_batch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling bench/mini_heldout.py
from mini_heldout import heldout_texts, window_batches  # noqa: E402

FORMATS = ("fp8", "mxfp8", "mxfp4")
DISPATCH_FORMATS = ("mxfp8", "mxint8")
BOTH = ("mxfp8+mxfp8",)


def shipped_texts(model_dir: Path) -> dict[str, list[str]]:
    return json.loads((model_dir / "heldout_sample.json").read_text())["documents"]


@torch.no_grad()
def score(model, tok, texts: dict[str, list[str]], seq_len: int, batch_size: int = 8) -> dict[str, dict]:
    """Per domain: summed next-token loss (nats), bytes, and the argmax token at every position."""
    out = {}
    for domain, docs in texts.items():
        total, argmax = 0.0, []
        for x in window_batches(model, tok, docs, seq_len, batch_size):
            logits = model.compute_logits(model(rows_batch(x[:, :-1])).hidden)
            total += torch.nn.functional.cross_entropy(logits, x[:, 1:].reshape(-1), reduction="sum").item()
            argmax.append(logits.argmax(-1))
        out[domain] = {"nats": total, "bytes": sum(len(t.encode("utf-8")) for t in docs),
                       "argmax": torch.cat(argmax)}
    return out


def greedy(model, tok, texts: dict[str, list[str]], prompt_tokens: int, new_tokens: int) -> dict[str, list[list[int]]]:
    llm = LLM.from_model(model, tok)
    out = {}
    for domain, docs in texts.items():
        prompts = [ids[:prompt_tokens] for ids in (tok.encode(d) for d in docs) if len(ids) >= 2]
        results = llm.generate(prompts, SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))
        out[domain] = [list(r.outputs[0].token_ids) for r in results]
    return out


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def evaluate(name: str, fmt: str | None, texts, prompts, args, dispatch: str | None = None) -> tuple[dict, dict]:
    """The scores and greedy continuations of the model with its routed experts in `fmt` (None: as loaded)
    and their input rows in the dispatch format `dispatch` (None: as they are)."""
    loaded = load(name, dtype=args.dtype, device="cpu", moe_backend=args.moe_backend, quantize_experts=fmt)
    model = loaded.model.eval()
    simulate_dispatch(model, dispatch)
    return (score(model, loaded.tokenizer, texts, args.seq_len),
            greedy(model, loaded.tokenizer, prompts, args.prompt_tokens, args.greedy_tokens))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="mini", help="a checkpoint directory or shipped name (default mini)")
    ap.add_argument("--corpus", help="a `locus train` corpus directory (default: the checkpoint's heldout_sample.json)")
    ap.add_argument("--bytes-per-domain", type=int, default=65536)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--prompt-tokens", type=int, default=16)
    ap.add_argument("--greedy-tokens", type=int, default=32)
    ap.add_argument("--max-prompts", type=int, default=32, help="greedy prompts per domain (the first documents)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--moe-backend", default="torch", choices=["torch", "cpu"])
    ap.add_argument("--formats", default=",".join(FORMATS), help="expert weight formats (weights rows; '' for none)")
    ap.add_argument("--dispatch-formats", default=",".join(DISPATCH_FORMATS),
                    help="dispatch payload formats (dispatch rows; '' for none)")
    ap.add_argument("--both", default=",".join(BOTH), help="WEIGHTS+DISPATCH pairs (both rows; '' for none)")
    ap.add_argument("--domains", help="comma-separated subset of the domains (default: all)")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    if args.corpus:
        texts, source = heldout_texts(args.corpus, args.bytes_per_domain), f"{args.corpus} (held-out split)"
    else:
        model_dir = Path(args.model) if Path(args.model).is_dir() else shipped_model(args.model)
        if model_dir is None or not (model_dir / "heldout_sample.json").is_file():
            print(f"{args.model}: no heldout_sample.json; pass --corpus", file=sys.stderr)
            return 1
        texts, source = shipped_texts(model_dir), f"{args.model}/heldout_sample.json"
    if args.domains:
        texts = {d: texts[d] for d in args.domains.split(",") if d in texts}
    start = time.perf_counter()
    prompts = {d: docs[:args.max_prompts] for d, docs in texts.items()}
    base_score, base_greedy = evaluate(args.model, None, texts, prompts, args)
    rows = []
    specs = [("weights", f, None, f) for f in args.formats.split(",") if f]
    specs += [("dispatch", None, d, d) for d in args.dispatch_formats.split(",") if d]
    for pair in [b for b in args.both.split(",") if b]:
        weights, _, dispatch = pair.partition("+")
        if not dispatch:
            ap.error(f"--both {pair!r}: give WEIGHTS+DISPATCH, e.g. mxfp8+mxfp8")
        specs.append(("both", weights, dispatch, f"{weights} + {dispatch}"))
    for where, fmt, dispatch, label in specs:
        s, g = evaluate(args.model, fmt, texts, prompts, args, dispatch)
        per_domain = {}
        for domain in texts:
            base, now = base_score[domain], s[domain]
            loss0, loss = base["nats"] / base["bytes"], now["nats"] / now["bytes"]
            same = [first_difference(a, b) for a, b in zip(base_greedy[domain], g[domain])]
            per_domain[domain] = {
                "nats_per_byte": loss, "base_nats_per_byte": loss0, "change": loss / loss0 - 1,
                "top1_agreement": (now["argmax"] == base["argmax"]).float().mean().item(),
                "greedy_identical": float(np.mean([n == args.greedy_tokens for n in same])),
                "greedy_tokens_before_difference": float(np.mean(same)),
            }
        rows.append({"where": where, "format": label, "weights": fmt, "dispatch": dispatch, "domains": per_domain})
    elapsed = time.perf_counter() - start
    domains = list(texts)
    print(f"held-out quality of {args.model} with narrow formats ({source}; {args.dtype}, moe backend "
          f"{args.moe_backend}; greedy: {args.prompt_tokens}-token prompts, {args.greedy_tokens} tokens)")
    print("| where | format | " + " | ".join(f"{d} loss" for d in domains) + " | top-1 agreement | greedy identical |"
          " tokens before a difference |")
    print("|---" * (5 + len(domains)) + "|")
    print("| - | model dtype | " + " | ".join(f"{base_score[d]['nats'] / base_score[d]['bytes']:.4f}" for d in domains)
          + " | 1 | 1 | " + f"{args.greedy_tokens} |")
    for row in rows:
        doms = row["domains"]
        cells = [f"{doms[d]['nats_per_byte']:.4f} ({100 * doms[d]['change']:+.2f}%)" for d in domains]
        top1 = min(doms[d]["top1_agreement"] for d in domains), max(doms[d]["top1_agreement"] for d in domains)
        ident = np.mean([doms[d]["greedy_identical"] for d in domains])
        before = np.mean([doms[d]["greedy_tokens_before_difference"] for d in domains])
        print(f"| {row['where']} | {row['format']} | " + " | ".join(cells) +
              f" | {top1[0]:.3f}-{top1[1]:.3f} | {ident:.2f} | {before:.1f} |")
    print(f"({elapsed:.0f} s)")
    if args.out:
        Path(args.out).write_text(json.dumps({
            "model": args.model, "source": source, "dtype": args.dtype, "moe_backend": args.moe_backend,
            "seq_len": args.seq_len, "prompt_tokens": args.prompt_tokens, "greedy_tokens": args.greedy_tokens,
            "base_nats_per_byte": {d: base_score[d]["nats"] / base_score[d]["bytes"] for d in domains},
            "rows": rows}, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0



if __name__ == "__main__":
    sys.exit(main())
