"""`locus generate` and `locus init-model`."""

from __future__ import annotations

import argparse
import sys

DEFAULT_MODEL_HELP = (
    "checkpoint directory (HuggingFace Llama-4 format), 'mini' (the small trained model shipped in "
    "locus/assets/mini), or preset name (tiny, small, scout-2l, tiny-qwen3-moe). "
    "Default: the embedded 'tiny' preset, built in memory with seeded RANDOM weights (no download; "
    "its text is gibberish)"
)


# generate and serve default to the shipped trained model, as a newcomer expects readable text
SHIPPED_DEFAULT_HELP = (
    "checkpoint directory (HuggingFace Llama-4 format), 'mini' (the small trained model shipped in "
    "locus/assets/mini), or preset name (tiny, small, scout-2l, tiny-qwen3-moe: seeded RANDOM weights, gibberish). "
    "Default: 'mini' ('tiny' where it is not installed)"
)


def add_model_args(p: argparse.ArgumentParser, model_help: str = DEFAULT_MODEL_HELP) -> None:
    """Flags shared by every command that loads a model (generate, serve, bench)."""
    p.add_argument("--model", default=None, help=model_help)
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="compute dtype (default: the checkpoint's, or the preset's: float32, bfloat16 for scout-2l)")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--moe-backend", default="auto", choices=["auto", "torch", "triton", "cpu"],
                   help="expert kernels: auto = Triton on CUDA, the C decode kernel on CPU (the torch reference if it "
                   "cannot be built); triton on CPU needs TRITON_INTERPRET=1 (slow)")
    p.add_argument("--quantize-experts", default=None, choices=["fp8", "mxfp8", "mxfp4"],
                   help="hold the routed experts in a narrow format, quantized once at load: fp8 (row-wise E4M3, a "
                        "float32 scale per output channel), mxfp8 or mxfp4 (OCP MX, an E8M0 scale per 32 weights); "
                        "2x / ~4x fewer expert bytes than bfloat16. See docs/formats.md")


def register(subparsers: argparse._SubParsersAction) -> None:
    gen = subparsers.add_parser("generate", help="generate a continuation of a prompt",
                                description="Generate text from a prompt. " + SHIPPED_DEFAULT_HELP + ".")
    add_model_args(gen, SHIPPED_DEFAULT_HELP)
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    gen.set_defaults(func=run_generate)

    init = subparsers.add_parser("init-model", help="write a seeded random checkpoint of a preset shape")
    init.add_argument("--preset", required=True, choices=["tiny", "small", "scout-2l", "tiny-qwen3-moe",
                                                          "tiny-deepseek-v3", "tiny-deepseek-v2-lite"])
    init.add_argument("--out", required=True, help="output directory (must not exist or be empty)")
    init.add_argument("--seed", type=int, default=0)
    init.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    init.add_argument("--per-expert", action="store_true", help="store experts one by one ([out, in] per expert)")
    init.set_defaults(func=run_init_model)

    bench = subparsers.add_parser("bench", help="run a benchmark script from bench/ (offline, serve, ...)",
                                  description="Runs bench/NAME.py of a source checkout with the remaining arguments.")
    bench.add_argument("name", help="benchmark name, e.g. offline, serve, moe_kernels, replay")
    bench.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    bench.set_defaults(func=run_bench)


def run_generate(args: argparse.Namespace) -> int:
    import time

    from locus.engine.frontend.llm import LLM
    from locus.engine.sampling.sampler import InvalidParameter, SamplingParams

    try:
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                                max_tokens=args.max_tokens)
        params.check_ranges()  # before the model loads; the engine checks only the vocabulary bounds
    except InvalidParameter as exc:
        print(f"locus: error: {exc}", file=sys.stderr)
        return 2
    from locus.engine.checkpoint.loader import default_serve_model

    llm = LLM(args.model or default_serve_model(), dtype=args.dtype, device=args.device, moe_backend=args.moe_backend,
              quantize_experts=args.quantize_experts)
    tok = llm.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat else args.prompt
    prompt_ids = tok.encode(text, add_special_tokens=not args.chat)
    if llm.random_weights:
        print(f"[locus] model '{llm.name}': preset with random weights (output is gibberish)", file=sys.stderr)
    start = time.perf_counter()
    out = llm.generate([prompt_ids], params)[0].outputs[0]
    elapsed = time.perf_counter() - start
    print(args.prompt + out.text)
    print(f"[locus] {len(prompt_ids)} prompt + {len(out.token_ids)} generated tokens in {elapsed:.2f}s "
          f"(finish: {out.finish_reason})", file=sys.stderr)
    return 0


def run_init_model(args: argparse.Namespace) -> int:
    from locus.engine.checkpoint.presets import build_preset
    from locus.engine.checkpoint.weights import resolve_dtype, save_checkpoint

    model = build_preset(args.preset, seed=args.seed, dtype=resolve_dtype(args.dtype))
    out = save_checkpoint(model, args.out, per_expert=args.per_expert)
    print(f"wrote {args.preset} checkpoint (seed {args.seed}, random weights) to {out}")
    return 0


def run_bench(args: argparse.Namespace) -> int:
    """Benchmarks live in the repository's bench/ folder (not installed): find it next to the package."""
    import runpy
    from pathlib import Path

    import locus
    from locus.errors import LocusError

    bench_dir = Path(locus.__file__).resolve().parents[1] / "bench"
    script = bench_dir / f"{args.name}.py"
    if not script.is_file():
        names = sorted(p.stem for p in bench_dir.glob("*.py")) if bench_dir.is_dir() else []
        raise LocusError(f"no benchmark {args.name!r} in {bench_dir}" + (f" (have: {', '.join(names)})" if names else
                         " (benchmarks need a source checkout: pip install -e .)"))
    sys.argv = [str(script), *args.args]
    # as with `python bench/NAME.py`: the script's folder first on the path, for its sibling modules
    added = str(bench_dir) not in sys.path
    if added:
        sys.path.insert(0, str(bench_dir))
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as exc:
        return int(exc.code or 0)
    finally:
        if added:
            sys.path.remove(str(bench_dir))
    return 0
