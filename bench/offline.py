"""Offline throughput: Locus's engine vs transformers' `generate` on the same checkpoint, side by side.

Default workload (the engine issue's): the `small` preset (hidden 256, 4 layers, 16 experts top-1,
vocab 32000) written as a HuggingFace checkpoint, 32 prompts of 64 random tokens, 64 new tokens each,
greedy, on this machine's CPU (or `--device cuda`: Locus with its CUDA-graph decode, transformers on
the same GPU). transformers' Llama-4 MoE runs every expert on every token; Locus runs only the chosen
ones and batches continuously. Both runs use the same weights, prompts and thread count, one after
the other in one process, and each is timed best-of `--repeats`.

    python bench/offline.py [--prompts 32 --prompt-len 64 --new-tokens 64 --out results/offline.json]
    python bench/offline.py --device cuda --dtype bfloat16 --prompts 64
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint dir (default: write the `small` preset to a temp dir)")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="both engines load the checkpoint in this dtype")
    p.add_argument("--phases", action="store_true",
                   help="also time prefill alone (1 new token) to split each engine's time into prefill and decode")
    p.add_argument("--compile", action="store_true",
                   help="also run Locus with compiled decode steps (one bucket: the batch size), beside the eager run")
    p.add_argument("--moe-backend", default="auto", choices=["auto", "torch", "cpu", "triton"],
                   help="locus's expert kernels (auto: the C decode kernel where it builds, Triton on CUDA, as "
                        "`locus serve`)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (both engines)")
    p.add_argument("--out", default="results/offline.json")
    return p.parse_args(argv)


def make_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, min(vocab, 32000), (n, length), generator=g).tolist()


def time_best(fn, repeats: int) -> tuple[float, object]:
    best, result = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def run_locus(model_dir: Path, prompts, new_tokens: int, repeats: int, max_num_seqs: int, dtype: str,
              compile_decode: bool = False, moe_backend: str = "auto", device: str = "cpu"):
    from locus.engine.core.engine_core import EngineConfig
    from locus.engine.frontend.llm import LLM
    from locus.engine.sampling.sampler import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)

    def once():
        # a fresh engine per repeat: no prefix cache carried over between timed runs
        llm = LLM(str(model_dir), dtype=dtype, device=device, moe_backend=moe_backend,
                  engine_config=EngineConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=4096,
                                             compile_decode=compile_decode,
                                             compile_buckets=(min(len(prompts), max_num_seqs),)))
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        return time.perf_counter() - start, [o.outputs[0].token_ids for o in outs]

    runs = [once() for _ in range(repeats)]
    seconds = min(r[0] for r in runs)
    return seconds, runs[0][1]


def run_transformers(model_dir: Path, prompts, new_tokens: int, repeats: int, dtype: str, device: str = "cpu"):
    from transformers import Llama4ForCausalLM

    model = Llama4ForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype)).to(device).eval()
    ids = torch.tensor(prompts, device=device)

    def once():
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        if device != "cpu":
            torch.cuda.synchronize()
        return out[:, ids.shape[1]:].tolist()

    return time_best(once, repeats)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(args.model) if args.model else None
        if model_dir is None:
            from locus.engine.checkpoint.presets import build_preset
            from locus.engine.checkpoint.weights import save_checkpoint

            model_dir = save_checkpoint(build_preset("small", seed=0), Path(tmp) / "small")
        from locus.engine.model.config import load_config

        vocab = load_config(model_dir).vocab_size
        prompts = make_prompts(args.prompts, args.prompt_len, vocab)
        total_new = args.prompts * args.new_tokens
        rows = []
        locus_s, locus_tokens = run_locus(model_dir, prompts, args.new_tokens, args.repeats, args.max_num_seqs, args.dtype,
                                          moe_backend=args.moe_backend, device=args.device)
        rows.append({"engine": "locus", "seconds": locus_s, "output_tokens_per_s": total_new / locus_s})
        if args.compile:
            compiled_s, compiled_tokens = run_locus(model_dir, prompts, args.new_tokens, args.repeats, args.max_num_seqs,
                                                    args.dtype, compile_decode=True, moe_backend=args.moe_backend,
                                                    device=args.device)
            rows.append({"engine": "locus-compiled", "seconds": compiled_s, "output_tokens_per_s": total_new / compiled_s,
                         "identical_to_eager_share": sum(a == b for a, b in zip(compiled_tokens, locus_tokens)) / len(prompts)})
        agree = hf_error = None
        if not args.skip_transformers:
            try:
                hf_s, hf_tokens = run_transformers(model_dir, prompts, args.new_tokens, args.repeats, args.dtype,
                                                   args.device)
            except Exception as exc:  # noqa: BLE001 - the baseline's failure must not lose Locus's figures
                hf_error = f"{type(exc).__name__}: {exc}"
                print(f"transformers failed, no comparison: {hf_error}", file=sys.stderr)
            else:
                rows.append({"engine": "transformers", "seconds": hf_s, "output_tokens_per_s": total_new / hf_s})
                agree = sum(a == b for a, b in zip(locus_tokens, hf_tokens)) / len(prompts)
        phases = {}
        if args.phases:
            phases["locus"] = run_locus(model_dir, prompts, 1, args.repeats, args.max_num_seqs, args.dtype,
                                        moe_backend=args.moe_backend, device=args.device)[0]
            if args.compile:  # one new token: the prefill alone, which stays eager
                phases["locus-compiled"] = phases["locus"]
            if any(r["engine"] == "transformers" for r in rows):
                phases["transformers"] = run_transformers(model_dir, prompts, 1, args.repeats, args.dtype, args.device)[0]
            for r in rows:
                r["prefill_seconds"] = phases[r["engine"]]
                r["decode_seconds"] = r["seconds"] - phases[r["engine"]]
    hf = next((r for r in rows if r["engine"] == "transformers"), None)
    ratio = rows[0]["output_tokens_per_s"] / hf["output_tokens_per_s"] if hf else None
    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"CPU threads {torch.get_num_threads()}"
    print(f"workload: {args.prompts} prompts x {args.prompt_len} tokens, {args.new_tokens} new tokens, greedy, "
          f"{args.dtype}, {where}")
    print(f"{'engine':<16}{'seconds':>10}{'out tok/s':>12}{' vs transformers' if hf else ''}")
    for r in rows:
        vs = f"{r['output_tokens_per_s'] / hf['output_tokens_per_s']:>8.2f}x" if hf else ""
        print(f"{r['engine']:<16}{r['seconds']:>10.2f}{r['output_tokens_per_s']:>12.1f}{vs}")
    if ratio is not None:
        print(f"locus / transformers throughput: {ratio:.2f}x   (greedy outputs identical for {agree:.0%} of prompts)")
    if args.phases:
        for r in rows:
            print(f"{r['engine']:<16} prefill {r['prefill_seconds']:.3f} s, decode {r['decode_seconds']:.3f} s")
        if hf:
            for r in rows[:-1]:
                print(f"speed-up of {r['engine']}: prefill {hf['prefill_seconds'] / r['prefill_seconds']:.1f}x, "
                      f"decode {hf['decode_seconds'] / r['decode_seconds']:.2f}x")
    result = {
        "bench": "offline", "model": args.model or "small preset (seed 0)", "prompts": args.prompts,
        "prompt_len": args.prompt_len, "new_tokens": args.new_tokens, "dtype": args.dtype, "moe_backend": args.moe_backend, "repeats": args.repeats, "rows": rows,
        "device": where,
        "ratio_locus_over_transformers": ratio, "identical_greedy_share": agree, "transformers_error": hf_error,
        "machine": {"threads": torch.get_num_threads(), "python": platform.python_version(), "torch": torch.__version__},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
