"""Greedy parity in float32, the GPU suite's `parity` stage (bench/gpu_suite.py):
- Triton vs torch experts: one forward of 16 prompts through the same model with either MoE backend;
  the logits max-diff at each prompt's last position and whether their argmax agree;
- decode graphs vs eager: 16 prompts x 24 greedy tokens through an engine whose decode steps replay
  CUDA graphs and through an `--enforce-eager` one: identical tokens, and the logits max-diff of every
  decode step against the eager runner on the same KV state;
- the overlapped schedule vs the serial one: the same 16 prompts through two graph engines, one with
  `async_scheduling` on, one off: identical tokens.

    python bench/gpu_parity.py --out FILE.json                          # small, on the GPU
    python bench/gpu_parity.py --model tiny --device cpu --out FILE.json  # the CPU self-check: the
        # Triton kernels interpreted, the static-buffer decode graphs uncompiled and uncaptured
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

if not torch.cuda.is_available():  # before anything imports Triton
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parent))
from offline import make_prompts  # noqa: E402


def set_backend(model, backend: str) -> None:
    for layer in model.model.layers:
        if layer.is_moe:
            layer.feed_forward.moe_backend = backend


@torch.inference_mode()
def last_logits(model, prompts: list[list[int]], backend: str) -> torch.Tensor:
    from locus.engine.model.forward_batch import ForwardBatch, SequenceSpan

    set_backend(model, backend)
    batch = ForwardBatch.from_spans(prompts, [SequenceSpan(i, 0, len(p)) for i, p in enumerate(prompts)], model.device)
    hidden = model(batch).hidden
    ends = torch.tensor([sum(map(len, prompts[:i + 1])) - 1 for i in range(len(prompts))], device=model.device)
    return model.compute_logits(hidden[ends])


def graph_engine(model, tok, config):
    """The engine whose decode steps run through decode graphs: captured on CUDA (the default there);
    on CPU (the self-check) the same static-buffer runner, uncompiled."""
    from locus.engine.runner.decode_graph import DecodeGraphs
    from locus.engine.frontend.llm import LLM

    llm = LLM.from_model(model, tok, config)
    core = llm.engine
    if core.graphs is None:
        max_blocks = -(-min(core.max_model_len, core.pool_tokens) // config.block_size)
        core.graphs = core.runner.graphs = DecodeGraphs(model, core.cache, list(config.compile_buckets), max_blocks,
                                                        compile=False)
        core.graphs.warm_up()
    return llm


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small", help="preset")
    p.add_argument("--device", default="cuda")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=24)
    p.add_argument("--out", required=True)
    args = p.parse_args(argv)

    from locus.engine.checkpoint.presets import build_preset
    from locus.engine.checkpoint.tokenizer import ByteTokenizer
    from locus.engine.core.engine_core import EngineConfig
    from locus.engine.frontend.llm import LLM
    from locus.engine.runner.model_runner import Feed, ModelRunner
    from locus.engine.sampling.sampler import SamplingParams

    model = build_preset(args.model, seed=0, device=args.device, moe_backend="triton")
    tok = ByteTokenizer(ByteTokenizer.MIN_VOCAB)
    prompts = make_prompts(args.prompts, 48, min(model.config.vocab_size, 256), seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens, ignore_eos=True)

    triton_logits, torch_logits = last_logits(model, prompts, "triton"), last_logits(model, prompts, "torch")
    set_backend(model, "triton")

    config = dict(block_size=16, max_num_seqs=args.prompts,
                  compile_buckets=tuple(sorted({b for b in (1, 2, 4, 8) if b < args.prompts} | {args.prompts})))
    graph = graph_engine(model, tok, EngineConfig(**config))
    graphs, runner = graph.engine.graphs, graph.engine.runner
    eager_runner, graph_run, diffs = ModelRunner(model, runner.cache), runner.run, []

    def run_both(items, record_routing=False, feed=None, **kwargs):
        # An overlapped step's feed may be a view of a graph's static output (its in-graph argmax),
        # which this replay overwrites with its own tokens: the eager run gets the feed as it was.
        kept = None if feed is None else Feed(feed.tokens.clone(), dict(feed.rows))
        fast = graph_run(items, record_routing, feed=feed, **kwargs)
        if runner.can_run_compiled(items):
            eager_logits = eager_runner.run(items, feed=kept, **kwargs).logits
            diffs.append(float((fast.logits.float() - eager_logits).abs().max()))
        return fast

    runner.run = run_both
    graph_tokens = [o.outputs[0].token_ids for o in graph.generate(prompts, params)]
    eager = LLM.from_model(model, tok, EngineConfig(**config, enforce_eager=True))
    eager_tokens = [o.outputs[0].token_ids for o in eager.generate(prompts, params)]
    same = sum(a == b for a, b in zip(graph_tokens, eager_tokens))
    # the overlapped schedule against the serial one, both replaying graphs, neither spied on
    schedules = {}
    for overlap in (True, False):
        llm = graph_engine(model, tok, EngineConfig(**config, async_scheduling=overlap))
        schedules[overlap] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    same_schedules = sum(a == b for a, b in zip(schedules[True], schedules[False]))
    agree = int((triton_logits.argmax(-1) == torch_logits.argmax(-1)).sum())
    figures = {
        "model": args.model, "device": torch.cuda.get_device_name() if model.device.type == "cuda" else "cpu",
        "triton_vs_torch": {"logits_max_diff": float((triton_logits - torch_logits).abs().max()),
                            "argmax_identical": agree, "prompts": len(prompts)},
        "graph_vs_eager": {"tokens_identical": same, "prompts": len(prompts), "logits_max_diff": max(diffs, default=None),
                           "steps_compared": len(diffs), "captured": graphs.captured,
                           "skipped": {str(k): v for k, v in graphs.skipped.items()}},
        "overlapped_vs_serial": {"tokens_identical": same_schedules, "prompts": len(prompts),
                                 "identical_to_eager": sum(a == b for a, b in zip(schedules[True], eager_tokens))},
    }
    figures["passed"] = (same == len(prompts) and agree == len(prompts) and not graphs.skipped and bool(diffs)
                         and same_schedules == len(prompts))
    Path(args.out).write_text(json.dumps(figures, indent=1) + "\n")
    print(json.dumps(figures, indent=1))
    return 0 if figures["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
