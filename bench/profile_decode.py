"""A decode step against its floor: the eager and the compiled engine side by side, and the floor
measured in the same run.

Workload of bench/offline.py (the `small` preset, 32 prompts of 64 random tokens, greedy). Two
engines share one model: one eager, one with compiled decode steps (decode_graph.py, one bucket of
the batch size). Both prefill the prompts, warm up, then their decode steps are timed alternately,
one step each in turn, so that this shared machine's noise falls on both alike.

The floor is what a decode step cannot avoid, each part measured here, now:
- lm_head: [B, H] x [H, V], the fastest of eager `F.linear`, `W @ h^T` and inductor with frozen
  (prepacked) weights;
- routed experts: reading the bytes of the experts the step's tokens touch (from the eager step's
  routing), at the streaming bandwidth of a plain read over all expert weights (larger than the L3);
- dense projections (attention q/k/v/o, router, shared expert, dense MLPs): their FLOPs at the peak
  of a large GEMM in the same dtype.
Attention itself, routing, sampling, scheduling and Python count as zero.

    python bench/profile_decode.py [--dtype float32|bfloat16] [--moe-backend auto|torch|cpu] [--steps 30] [--profile]
                                   [--out FILE.json]
    python bench/profile_decode.py --device cuda --model scout-2l --dtype bfloat16   # a GPU: CUDA graphs
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from offline import make_prompts  # the same prompts as bench/offline.py (bench/ is on the path)


def best_ms(fn, repeats: int = 30) -> float:
    """Median wall time of fn() in ms after a warm-up (the median of a few bursts resists noise); on a
    GPU each call is waited for."""
    sync = torch.cuda.synchronize if torch.cuda.is_initialized() else (lambda: None)
    for _ in range(3):
        fn()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def lm_head_ms(model, batch: int) -> dict:
    dev = model.device
    h = torch.randn(batch, model.config.hidden_size, dtype=model.dtype, device=dev)
    w = model.lm_head.weight.detach()
    head = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype, device=dev)
    # CPU: freezing folds and prepacks the weight (oneDNN). It must be the global config while the
    # graph compiles: torch 2.13 does not apply torch.compile's options={"freezing": True}. CUDA: plain inductor.
    head = torch.compile(head)
    with torch.no_grad(), torch._inductor.config.patch(freezing=dev.type == "cpu"):
        head._orig_mod.weight.copy_(w)
        head(h)  # compiles here, under the patch
        forms = {"F.linear": best_ms(lambda: F.linear(h, w)), "W @ h^T": best_ms(lambda: (w @ h.T).T),
                 "inductor" + (" frozen" if dev.type == "cpu" else ""): best_ms(lambda: head(h))}
    del head
    return {"ms": min(forms.values()), "forms_ms": forms}


def stream_gbps(model) -> float:
    """GB/s of a plain read (a sum) over every expert weight of the model, viewed as float32 words."""
    tensors = [m.experts.gate_up_proj for m in moe_blocks(model)] + [m.experts.down_proj for m in moe_blocks(model)]
    words = [t.detach().reshape(-1).view(torch.float32) for t in tensors]
    total = sum(t.numel() * t.element_size() for t in tensors)
    return total / (best_ms(lambda: [w.sum() for w in words], repeats=15) / 1e3) / 1e9


def peak_gflops(dtype: torch.dtype, device: torch.device) -> float:
    n = 1024 if device.type == "cpu" else 8192  # a GPU needs a large GEMM to reach its peak
    a, b = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device)
    return 2 * n ** 3 / (best_ms(lambda: a @ b, repeats=10) / 1e3) / 1e9


def moe_blocks(model) -> list:
    return [layer.feed_forward for layer in model.model.layers if layer.is_moe]


def dense_flops(model, batch: int) -> int:
    """2 * B * weights of every projection a decode token always runs (not lm_head, not routed experts)."""
    params = 0
    for layer in model.model.layers:
        attn = layer.self_attn
        params += sum(p.numel() for p in (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, attn.o_proj.weight))
        ffn = layer.feed_forward
        dense = [ffn.router, ffn.shared_expert] if layer.is_moe else [ffn]
        params += sum(p.numel() for m in dense for p in m.parameters())
    return 2 * batch * params


def touched_expert_bytes(model, routing) -> int:
    cfg = model.config
    per_expert = (cfg.hidden_size * 2 * cfg.intermediate_size + cfg.intermediate_size * cfg.hidden_size) * \
        torch.tensor([], dtype=model.dtype).element_size()
    return sum(int(topk.ids.unique().numel()) for topk in routing.values()) * per_expert


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small", help="preset name or checkpoint dir")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--device", default="cpu", help="cpu, or cuda: the compiled steps are CUDA graphs there "
                   "(mode reduce-overhead) and the experts run on the Triton kernels")
    p.add_argument("--moe-backend", default="auto", choices=["auto", "torch", "cpu", "triton"],
                   help="expert kernels (auto: the C decode kernel on CPU, Triton on CUDA, as `locus serve`)")
    p.add_argument("--profile", action="store_true", help="also print a torch-profiler table of compiled steps")
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    args = p.parse_args(argv)

    from locus.engine.engine_core import EngineConfig, EngineCore
    from locus.engine.checkpoint.loader import load
    from locus.engine.sampling_params import SamplingParams

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here")
    loaded = load(args.model, args.dtype, str(device), args.moe_backend, 0)
    model, B = loaded.model, args.prompts
    config = dict(max_num_seqs=max(B, 1), max_num_batched_tokens=max(4096, B * args.prompt_len))
    eager = EngineCore(model, loaded.tokenizer, EngineConfig(**config))
    compiled = EngineCore(model, loaded.tokenizer, EngineConfig(**config, compile_decode=True, compile_buckets=(B,)))
    params = SamplingParams(temperature=0.0, max_tokens=2 * args.steps + 20, ignore_eos=True)
    prompts = make_prompts(B, args.prompt_len, model.config.vocab_size)
    for core in (eager, compiled):
        for i, prompt in enumerate(prompts):
            core.add_request(str(i), prompt, params)
        for _ in range(6):  # the prefill, then warm decode steps
            core.step()
    times = {"eager": [], "compiled": []}
    for _ in range(args.steps):
        for name, core in (("eager", eager), ("compiled", compiled)):
            start = time.perf_counter()
            core.step()
            times[name].append(time.perf_counter() - start)
    assert compiled.graphs.steps >= args.steps, "the compiled engine's decode steps did not run compiled"
    step_ms = {name: statistics.median(t) * 1e3 for name, t in times.items()}

    items = eager.scheduler.schedule().micro_batches[0]  # one more eager decode step, for its routing
    routing = eager.runner.run(items, record_routing=True).routing
    head = lm_head_ms(model, B)
    gbps, peak = stream_gbps(model), peak_gflops(model.dtype, device)
    expert_bytes = touched_expert_bytes(model, routing)
    floor = {"lm_head_ms": head["ms"], "experts_ms": expert_bytes / gbps / 1e6,
             "dense_ms": dense_flops(model, B) / peak / 1e6}
    floor_ms = sum(floor.values())

    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{torch.get_num_threads()} threads"
    name = f"{args.model}, {args.dtype}, {B} sequences, {where}, MoE backend {args.moe_backend}"
    print(f"{name}: decode step median over {args.steps} alternating steps")
    print("| part | ms | note |\n|---|---|---|")
    print(f"| lm_head | {head['ms']:.2f} | best of " + ", ".join(f"{k} {v:.2f}" for k, v in head["forms_ms"].items()) + " |")
    print(f"| routed experts (read) | {floor['experts_ms']:.2f} | {expert_bytes / 2**20:.1f} MiB touched at {gbps:.1f} GB/s |")
    print(f"| dense projections | {floor['dense_ms']:.2f} | {dense_flops(model, B) / 1e6:.0f} MFLOP at {peak:.0f} GFLOPS |")
    print(f"| **floor** | **{floor_ms:.2f}** | |")
    for kind in ("eager", "compiled"):
        print(f"| {kind} step | {step_ms[kind]:.2f} | {step_ms[kind] / floor_ms:.2f}x the floor |")
    print(f"compiled / eager: {step_ms['compiled'] / step_ms['eager']:.3f}; compile time {compiled.compile_seconds:.1f} s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"workload": name, "step_ms": step_ms, "floor_ms": floor_ms, "floor_parts_ms": floor,
                       "lm_head_forms_ms": head["forms_ms"], "stream_gbps": gbps, "peak_gflops": peak,
                       "touched_expert_bytes": expert_bytes, "compile_s": compiled.compile_seconds,
                       "step_over_floor": {k: v / floor_ms for k, v in step_ms.items()}}, f, indent=1)
    if args.profile:
        with torch.profiler.profile(record_shapes=True) as prof:
            for _ in range(args.steps // 2):
                compiled.step()
        print(prof.key_averages(group_by_input_shape=True).table(
            sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=40, max_shapes_column_width=56))
    return 0


if __name__ == "__main__":
    sys.exit(main())
