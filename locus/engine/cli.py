"""`locus generate` and `locus init-model`."""

from __future__ import annotations

import argparse
import sys

DEFAULT_MODEL_HELP = (
    "checkpoint directory (HuggingFace Llama-4 format) or preset name (tiny, small). "
    "Default: the embedded 'tiny' preset, built in memory with seeded RANDOM weights (no download; "
    "its text is gibberish)"
)


def add_model_args(p: argparse.ArgumentParser) -> None:
    """Flags shared by every command that loads a model (generate, serve, bench)."""
    p.add_argument("--model", default=None, help=DEFAULT_MODEL_HELP)
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="compute dtype (default: the checkpoint's, float32 for presets)")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--moe-backend", default="auto", choices=["auto", "torch", "triton"],
                   help="expert kernels: auto = Triton on CUDA, torch reference on CPU; triton on CPU needs TRITON_INTERPRET=1 (slow)")


def register(subparsers: argparse._SubParsersAction) -> None:
    gen = subparsers.add_parser("generate", help="generate a continuation of a prompt",
                                description="Generate text from a prompt. " + DEFAULT_MODEL_HELP + ".")
    add_model_args(gen)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    gen.set_defaults(func=run_generate)

    init = subparsers.add_parser("init-model", help="write a seeded random checkpoint of a preset shape")
    init.add_argument("--preset", required=True, choices=["tiny", "small"])
    init.add_argument("--out", required=True, help="output directory (must not exist or be empty)")
    init.add_argument("--seed", type=int, default=0)
    init.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    init.add_argument("--per-expert", action="store_true", help="store experts one by one ([out, in] per expert)")
    init.set_defaults(func=run_init_model)


def run_generate(args: argparse.Namespace) -> int:
    import time

    from locus.engine.generate import SimpleSampling, generate_tokens
    from locus.engine.loader import load

    try:
        sampling = SimpleSampling(args.temperature, args.top_p, args.top_k, args.seed)
    except ValueError as exc:
        print(f"locus: error: {exc}", file=sys.stderr)
        return 2
    loaded = load(args.model, args.dtype, args.device, args.moe_backend)
    tok = loaded.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
    prompt_ids = tok.encode(text, add_special_tokens=not args.chat)
    if loaded.random_weights:
        print(f"[locus] model '{loaded.name}': preset with random weights (output is gibberish)", file=sys.stderr)
    start = time.perf_counter()
    try:
        new = generate_tokens(loaded.model, prompt_ids, args.max_tokens, sampling, stop_ids=tok.eos_token_ids)
    except ValueError as exc:
        print(f"locus: error: {exc}", file=sys.stderr)
        return 2
    elapsed = time.perf_counter() - start
    print(args.prompt + tok.decode(new))
    print(f"[locus] {len(prompt_ids)} prompt + {len(new)} generated tokens in {elapsed:.2f}s", file=sys.stderr)
    return 0


def run_init_model(args: argparse.Namespace) -> int:
    from locus.engine.presets import build_preset
    from locus.engine.weights import resolve_dtype, save_checkpoint

    model = build_preset(args.preset, seed=args.seed, dtype=resolve_dtype(args.dtype))
    out = save_checkpoint(model, args.out, per_expert=args.per_expert)
    print(f"wrote {args.preset} checkpoint (seed {args.seed}, random weights) to {out}")
    return 0
