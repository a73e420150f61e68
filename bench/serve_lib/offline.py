"""The offline side of bench/serve.py: the same workload through locus.engine.frontend.llm.LLM in this process."""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

from serve_lib.cpu import machine_busy_seconds, others_cpu
from serve_lib.prompts import warmup_len


@dataclass
class OfflineReport:
    max_num_seqs: int
    seconds: float
    prompt_tokens: int
    output_tokens: int
    output_throughput: float
    total_token_throughput: float
    threads: int
    cpu_s: float  # this process's CPU time during generate (compare with the server's + the client's)
    other_cpu_s: float | None  # CPU time of other processes during generate (see LoadReport)


# --- the offline engine on the same workload ------------------------------------------------------
def offline_widths(args: argparse.Namespace) -> list[int]:
    """max_num_seqs values for the offline runs: the server's, and, when the client's concurrency is
    what bounds the HTTP batch, that concurrency too (same batch width: isolates the serving overhead)."""
    widths = [args.max_num_seqs]
    if args.concurrency and args.concurrency < min(args.max_num_seqs, args.num_prompts):
        widths.append(args.concurrency)
    return widths


def run_offline(args: argparse.Namespace, prompts: list[str | list[int]], warmup: list[str | list[int]]) -> list[OfflineReport]:
    """locus.engine.frontend.llm.LLM with the server's engine flags, once per width of offline_widths; a fresh
    engine (KV pool, prefix cache) each time, the same weights. Times `generate` only."""
    import torch

    from locus.engine.core.engine_core import EngineConfig, parse_memory
    from locus.engine.frontend.llm import LLM
    from locus.engine.sampling.params import SamplingParams

    if args.threads:
        torch.set_num_threads(args.threads)

    def config(width: int) -> EngineConfig:
        return EngineConfig(max_num_seqs=width, max_num_batched_tokens=args.max_num_batched_tokens,
                            kv_cache_memory=parse_memory(args.kv_cache_memory), compile_decode=args.compile,
                            compile_buckets=args.compile_buckets, enforce_eager=args.enforce_eager)

    llm = LLM(args.model, dtype=args.dtype, device=args.device, moe_backend=args.moe_backend, seed=args.model_seed,
              engine_config=config(args.max_num_seqs))
    model, tokenizer = llm.engine.model, llm.tokenizer
    to_ids = offline_tokenizer(tokenizer, args.endpoint == "chat")
    token_prompts = [to_ids(p) for p in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    reports = []
    for width in offline_widths(args):
        if llm is None:
            llm = LLM.from_model(model, tokenizer, config(width))
        if warmup:
            llm.generate([to_ids(p) for p in warmup], SamplingParams(temperature=0.0, max_tokens=warmup_len(args), ignore_eos=True))
        busy0, cpu0, start = machine_busy_seconds(), time.process_time(), time.perf_counter()
        outs = llm.generate(token_prompts, params)
        seconds, cpu = time.perf_counter() - start, time.process_time() - cpu0
        other = others_cpu(busy0, machine_busy_seconds(), cpu)
        prompt_tokens = sum(len(p) for p in token_prompts)
        output_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        reports.append(OfflineReport(width, seconds, prompt_tokens, output_tokens, output_tokens / seconds,
                                     (prompt_tokens + output_tokens) / seconds, torch.get_num_threads(), cpu, other))
        llm = outs = None  # drop the KV pool before the next engine (or a launched server) allocates one
    return reports


def offline_tokenizer(tok, chat: bool):
    """Prompt -> token ids exactly as the server's endpoint would tokenize it."""
    def to_ids(prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        if chat:
            return tok.encode(tok.apply_chat_template([{"role": "user", "content": prompt}], True), add_special_tokens=False)
        return tok.encode(prompt)
    return to_ids
