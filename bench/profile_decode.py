"""A decode step against its floor: the engine's decode modes side by side, and the floor measured in
the same run.

Workload of bench/offline.py (the `small` preset, 32 prompts of 64 random tokens, greedy). Engines
sharing one model, one per decode mode: on CPU eager and compiled (`--compile`); on CUDA eager
(`--enforce-eager`), graph (CUDA graphs, the default there) and graph+compile. Each prefills the
prompts and warms up, then their decode steps are timed alternately, one step each in turn, so that
noise falls on all alike. A step is the engine's whole step (schedule, forward, sampling, outputs),
waited for on a GPU.

The floor is what a decode step cannot avoid, from the device's ceilings (bench/device_ceilings.py:
bandwidth of a large copy on a GPU, of a large read on CPU; a large GEMM's FLOP/s in the dtype),
measured in this run:
- routed experts: the bytes of the experts the step's tokens touch (from an eager step's routing),
  read at that bandwidth;
- dense projections (attention q/k/v/o, router, shared expert, dense MLPs): their weight bytes at the
  bandwidth or their FLOPs at the GEMM peak, whichever takes longer;
- lm_head: on a GPU the same roofline; on CPU the fastest of eager `F.linear`, `W @ h^T` and inductor
  with frozen (prepacked) weights, as timed here (a CPU GEMM of 32 rows is far from its peak).
Attention itself, routing, sampling, scheduling and Python count as zero.

    python bench/profile_decode.py [--dtype float32|bfloat16] [--moe-backend auto|torch|cpu] [--steps 30] [--profile]
                                   [--out FILE.json]
    python bench/profile_decode.py --device cuda --model scout-2l --dtype bfloat16   # a GPU: CUDA graphs
    python bench/profile_decode.py --dtype bfloat16 --quantize-experts mxfp4          # narrow experts beside
The JSON's `graphs_skipped` lists every bucket a CUDA-graph engine could not capture (it must be empty).

--quantize-experts fp8|mxfp8|mxfp4 adds a copy of the model whose routed experts are held in that
format (`--quantize-experts` of `locus serve`): its engines (one per mode) step in turn with the
model-dtype ones, and its floor counts the narrow expert bytes (ExpertQuantization.bytes_after per
expert held), so both steps, both floors and their ratios come from one run.

The split of a steady-state step (`step_split`, per CUDA-graph mode; on CPU and in eager mode its
fields are None, with the reason):
- replay_ms: the bucket's graph replayed back to back, timed with CUDA events (device time of one replay);
- kernel_sum_ms: the sum of the kernels' (and device copies') own durations in one replay, from
  torch.profiler's trace (mean over a few replays);
- launch_gaps_ms = replay_ms - kernel_sum_ms: the device idle between the graph's kernels;
- host_ms = the engine's whole step - replay_ms: what the host adds on top of the device's work.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from device_ceilings import measure as measure_ceilings  # noqa: E402
from offline import make_prompts  # noqa: E402  (the same prompts as bench/offline.py)

MODES = {"cpu": ("eager", "compiled"), "cuda": ("eager", "graph", "graph+compile")}


def best_ms(fn, repeats: int = 30) -> float:
    """Median wall time of fn() in ms after a warm-up; on a GPU each call is waited for."""
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


def lm_head_forms_ms(model, batch: int) -> dict:
    """CPU: the lm_head's forms, timed (the fastest is the floor's lm_head)."""
    dev = model.device
    h = torch.randn(batch, model.config.hidden_size, dtype=model.dtype, device=dev)
    w = model.lm_head.weight.detach()
    head = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype, device=dev)
    # Freezing folds and prepacks the weight (oneDNN). It must be the global config while the graph
    # compiles: torch 2.13 does not apply torch.compile's options={"freezing": True}.
    head = torch.compile(head)
    with torch.no_grad(), torch._inductor.config.patch(freezing=True):
        head._orig_mod.weight.copy_(w)
        head(h)  # compiles here, under the patch
        forms = {"F.linear": best_ms(lambda: F.linear(h, w)), "W @ h^T": best_ms(lambda: (w @ h.T).T),
                 "inductor frozen": best_ms(lambda: head(h))}
    del head
    return forms


def moe_blocks(model) -> list:
    return [layer.feed_forward for layer in model.model.layers if layer.is_moe]


def dense_weights(model) -> tuple[int, int]:
    """(parameters, bytes) of every projection a decode token always runs (not lm_head, not routed experts)."""
    params = 0
    for layer in model.model.layers:
        attn = layer.self_attn
        params += sum(p.numel() for p in (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, attn.o_proj.weight))
        ffn = layer.feed_forward
        dense = [ffn.router, ffn.shared_expert] if layer.is_moe else [ffn]
        params += sum(p.numel() for m in dense for p in m.parameters())
    return params, params * model.dtype.itemsize


def touched_expert_bytes(routing, per_expert: float) -> int:
    """Bytes of the experts a step's tokens touch, each read once, over the MoE layers."""
    return round(sum(int(topk.ids.unique().numel()) for topk in routing.values()) * per_expert)


def float_expert_bytes(model) -> int:
    """One expert's gate_up and down in the model dtype."""
    cfg = model.config
    return 3 * cfg.hidden_size * cfg.intermediate_size * model.dtype.itemsize


def roofline_ms(nbytes: float, flops: float, bandwidth: float, peak: float) -> float:
    return max(nbytes / bandwidth, flops / peak) * 1e3


def engine_config(mode: str, B: int, prompt_len: int):
    from locus.engine.core.engine_core import EngineConfig

    config = dict(max_num_seqs=max(B, 1), max_num_batched_tokens=max(4096, B * prompt_len), compile_buckets=(B,))
    return EngineConfig(**config, compile_decode=mode in ("compiled", "graph+compile"), enforce_eager=mode == "eager")


SPLIT_KEYS = ("replay_ms", "kernel_sum_ms", "kernel_count", "launch_gaps_ms", "host_ms")
DEVICE_ACTIVITY = ("kernel", "gpu_memcpy", "gpu_memset")  # device work in a chrome trace's "cat"


def device_time_ms(trace: dict) -> tuple[float, int]:
    """(sum of the device activities' durations in ms, how many) from a torch.profiler chrome trace."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and e.get("cat", "").lower() in DEVICE_ACTIVITY]
    return sum(float(e.get("dur", 0.0)) for e in events) / 1e3, len(events)


def split_step(step_ms: float, replay_ms: float, kernel_sum_ms: float, kernel_count: int) -> dict:
    """The step's parts: device busy (kernels), device idle inside the replay (launch gaps), host on top."""
    return {"replay_ms": replay_ms, "kernel_sum_ms": kernel_sum_ms, "kernel_count": kernel_count,
            "launch_gaps_ms": replay_ms - kernel_sum_ms, "host_ms": step_ms - replay_ms, "reason": None}


def no_split(reason: str) -> dict:
    return {**dict.fromkeys(SPLIT_KEYS), "reason": reason}


def step_split(core, B: int, step_ms: float, replays: int = 20, profiled: int = 5) -> dict:
    """Split a CUDA-graph engine's steady-state decode step (module docstring). Replays the bucket of
    the step just timed: the same inputs again, so the KV it rewrites is what it wrote."""
    graphs = core.graphs
    if core.model.device.type != "cuda":
        return no_split("on CPU there is no CUDA graph replay to split")
    bucket = graphs.bucket(B) if graphs is not None else None
    graph = graphs._graphs.get(bucket) if graphs is not None else None
    if graph is None:
        return no_split("this mode runs no captured graph for the bucket (eager, or the capture was skipped)")
    import tempfile

    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    replay_ms = start.elapsed_time(end) / replays
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(profiled):
            graph.replay()
        torch.cuda.synchronize()
    with tempfile.NamedTemporaryFile("w+", suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        kernel_ms, count = device_time_ms(json.load(open(f.name)))
    return split_step(step_ms, replay_ms, kernel_ms / profiled, count // profiled)


def graph_report(core) -> dict:
    graphs = core.graphs
    if graphs is None:
        return {"captured": [], "skipped": {}}
    return {"captured": graphs.captured, "skipped": {str(b): why for b, why in graphs.skipped.items()},
            "capture": graphs.capture, "compiled": graphs.compiled}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small", help="preset name or checkpoint dir")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--device", default="cpu", help="cpu, or cuda: decode steps are CUDA graphs there and the experts "
                   "run on the Triton kernels; a preset's weights are drawn on the GPU")
    p.add_argument("--modes", default=None,
                   help="comma-separated decode modes to time (default: cpu eager,compiled; cuda eager,graph,graph+compile)")
    p.add_argument("--moe-backend", default="auto", choices=["auto", "torch", "cpu", "triton"],
                   help="expert kernels (auto: the C decode kernel on CPU, Triton on CUDA, as `locus serve`)")
    p.add_argument("--quantize-experts", choices=["fp8", "mxfp8", "mxfp4"],
                   help="also step a copy of the model whose routed experts are held in this format, side by side")
    p.add_argument("--profile", action="store_true", help="also print a torch-profiler table of the last mode's steps")
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    args = p.parse_args(argv)

    from locus.engine.checkpoint.loader import load
    from locus.engine.checkpoint.quantize import quantize_model_experts
    from locus.engine.core.engine_core import EngineCore
    from locus.engine.runner.model_runner import ModelRunner
    from locus.engine.sampling.params import SamplingParams

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here")
    modes = args.modes.split(",") if args.modes else list(MODES[device.type])
    unknown = set(modes) - set(MODES[device.type])
    if unknown:
        p.error(f"modes {sorted(unknown)} do not exist on {device.type} (choose from {', '.join(MODES[device.type])})")
    loaded = load(args.model, args.dtype, str(device), args.moe_backend, 0, draw_on_device=device.type == "cuda")
    model, B = loaded.model, args.prompts
    ceilings = measure_ceilings(device, model.dtype)

    # weights -> (model, bytes one held expert takes): the model dtype, and the narrow copy if asked
    variants = {"model": (model, float_expert_bytes(model))}
    if args.quantize_experts:
        narrow = copy.deepcopy(model)
        report = quantize_model_experts(narrow, args.quantize_experts)
        held = narrow.model.layers[narrow.config.moe_layers[0]].feed_forward.experts.gate_up_proj.shape[0]
        variants[args.quantize_experts] = (narrow, report.bytes_after / (report.layers * held))
    engines = {(w, mode): EngineCore(m, loaded.tokenizer, engine_config(mode, B, args.prompt_len))
               for w, (m, _) in variants.items() for mode in modes}
    cores = {mode: engines[("model", mode)] for mode in modes}
    params = SamplingParams(temperature=0.0, max_tokens=2 * args.steps + 20, ignore_eos=True)
    prompts = make_prompts(B, args.prompt_len, model.config.vocab_size)
    for core in engines.values():
        for i, prompt in enumerate(prompts):
            core.add_request(str(i), prompt, params)
        for _ in range(6):  # the prefill, then warm decode steps
            core.step()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times = {key: [] for key in engines}
    for _ in range(args.steps):
        for key, core in engines.items():
            sync()
            start = time.perf_counter()
            core.step()
            sync()
            times[key].append(time.perf_counter() - start)
    for (w, mode), core in engines.items():
        if mode != "eager" and core.graphs.steps < args.steps:
            raise RuntimeError(f"the {mode} engine's decode steps ({w} weights) did not run through its decode graphs")
    steps = {key: statistics.median(t) * 1e3 for key, t in times.items()}
    step_ms = {mode: steps[("model", mode)] for mode in modes}
    split = {mode: step_split(core, B, step_ms[mode]) for mode, core in cores.items()}

    touched = {}  # weights -> bytes of the experts one more (eager) step touches
    for w, (m, per_expert) in variants.items():
        core = engines[(w, modes[0])]
        core.drain()  # (overlapped, on CUDA: the step in flight's tokens first; this step feeds none)
        items = core.scheduler.schedule().micro_batches[0]
        touched[w] = touched_expert_bytes(ModelRunner(m, core.cache).run(items, record_routing=True).routing, per_expert)
    expert_bytes = touched["model"]
    dense_params, dense_bytes = dense_weights(model)
    bw, peak = ceilings.bandwidth, ceilings.matmul_flops
    V, H = model.lm_head.weight.shape
    head_forms = lm_head_forms_ms(model, B) if device.type == "cpu" else {}
    head_ms = min(head_forms.values()) if head_forms else roofline_ms(V * H * model.dtype.itemsize, 2 * B * V * H, bw, peak)
    floor = {"lm_head_ms": head_ms, "experts_ms": expert_bytes / bw * 1e3,
             "dense_ms": roofline_ms(dense_bytes, 2 * B * dense_params, bw, peak)}
    floor_ms = sum(floor.values())
    graphs = {mode: graph_report(core) for mode, core in cores.items()}
    skipped = {mode: g["skipped"] for mode, g in graphs.items() if g["skipped"]}
    inductor_skips = int(torch._dynamo.utils.counters["inductor"].get("cudagraph_skips", 0))

    where = ceilings.device if device.type == "cuda" else f"{torch.get_num_threads()} threads"
    name = f"{args.model}, {args.dtype}, {B} sequences, {where}, MoE backend {args.moe_backend}"
    print(f"{name}: decode step median over {args.steps} alternating steps")
    print("| part | ms | note |\n|---|---|---|")
    head_note = ("best of " + ", ".join(f"{k} {v:.2f}" for k, v in head_forms.items())) if head_forms else \
        f"{V * H * model.dtype.itemsize / 2**20:.1f} MiB read"
    print(f"| lm_head | {head_ms:.3f} | {head_note} |")
    print(f"| routed experts (read) | {floor['experts_ms']:.3f} | {expert_bytes / 2**20:.1f} MiB touched |")
    print(f"| dense projections | {floor['dense_ms']:.3f} | {dense_bytes / 2**20:.1f} MiB, {2 * B * dense_params / 1e6:.0f} MFLOP |")
    print(f"| **floor** | **{floor_ms:.3f}** | {bw / 1e9:,.0f} GB/s, {peak / 1e12:,.1f} TFLOP/s (bench/device_ceilings.py) |")
    for mode in modes:
        print(f"| {mode} step | {step_ms[mode]:.3f} | {step_ms[mode] / floor_ms:.2f}x the floor |")
    for mode, parts in split.items():
        if parts["reason"] is None:
            print(f"| {mode} step split | replay {parts['replay_ms']:.3f} | kernels {parts['kernel_sum_ms']:.3f} "
                  f"({parts['kernel_count']} a replay) + launch gaps {parts['launch_gaps_ms']:.3f}; "
                  f"host on top {parts['host_ms']:.3f} |")
    for mode, core in cores.items():
        if core.graphs is not None:
            print(f"{mode}: decode graphs captured {graphs[mode]['captured']}, set up in {core.compile_seconds:.1f} s")
    if skipped:
        print(f"GRAPHS SKIPPED: {skipped}")
    quantized = None
    if args.quantize_experts:
        fmt = args.quantize_experts
        q_floor = {**floor, "experts_ms": touched[fmt] / bw * 1e3}
        q_step = {mode: steps[(fmt, mode)] for mode in modes}
        print(f"\nrouted experts in {fmt} (a copy of the model, its engines stepped in turn with the above):")
        print("| weights | routed experts (read) ms | MiB touched | floor ms | " +
              " | ".join(f"{mode} step ms" for mode in modes) + " |\n|---|---|---|---|" + "---|" * len(modes))
        for label, key, f, st in ((args.dtype, "model", floor, step_ms), (fmt, fmt, q_floor, q_step)):
            print(f"| {label} | {f['experts_ms']:.3f} | {touched[key] / 2**20:.2f} | {sum(f.values()):.3f} | " +
                  " | ".join(f"{st[mode]:.3f} ({step_ms[mode] / st[mode]:.2f}x)" for mode in modes) + " |")
        quantized = {"format": fmt, "step_ms": q_step, "floor_ms": sum(q_floor.values()), "floor_parts_ms": q_floor,
                     "touched_expert_bytes": touched[fmt], "bytes_per_expert": variants[fmt][1],
                     "step_speedup_vs_model": {mode: step_ms[mode] / q_step[mode] for mode in modes}}
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"workload": name, "device": ceilings.device, "modes": modes, "step_ms": step_ms,
                       "floor_ms": floor_ms, "floor_parts_ms": floor, "lm_head_forms_ms": head_forms,
                       "bandwidth_gbps": bw / 1e9, "peak_tflops": peak / 1e12, "touched_expert_bytes": expert_bytes,
                       "setup_s": {mode: core.compile_seconds for mode, core in cores.items()},
                       "compile_s": sum(core.compile_seconds for core in cores.values()),
                       "graphs": graphs, "graphs_skipped": skipped, "inductor_cudagraph_skips": inductor_skips,
                       "step_over_floor": {k: v / floor_ms for k, v in step_ms.items()},
                       "quantized_experts": quantized, "step_split": split}, f, indent=1)
    if args.profile:
        core = cores[modes[-1]]
        with torch.profiler.profile(record_shapes=True) as prof:
            for _ in range(args.steps // 2):
                core.step()
        print(prof.key_averages(group_by_input_shape=True).table(
            sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=40, max_shapes_column_width=56))
    return 0


if __name__ == "__main__":
    sys.exit(main())
