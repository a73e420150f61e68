"""The host's share of a decode step: what the engine does around the model's forward, per batch size.

A decode step is schedule -> prepare inputs -> forward -> sample -> postprocess (append, stop checks,
detokenize) -> outputs -> hand-off to the streams. Everything but the forward is host work that a GPU
waits through (until the overlapped schedule hides it). This script runs B sequences in decode and
times each phase of every step, with the model's own work (its forward and lm_head, or the decode
graph's replay) timed apart; on CUDA the forward's timer waits for the device, so device time never
lands in a host phase.

Phases (medians over the timed steps, ms):
    schedule     Scheduler.schedule
    prepare      ModelRunner.run minus the forward: batch tensors, block tables, static-buffer copies
    forward      the model's forward + lm_head and each sampled row's argmax (eager), or the decode
                 graph's call (compiled / CUDA graph, which holds both)
    sample       Sampler.launch: the sampler's device work queued (on CPU, computed), its host arrays
    readback     the host blocked on the step's one readback (CUDA: the device was still busy)
    postprocess  the engine's per-token work once the tokens are on the host: append, stop checks, detokenize
    outputs      the rest of EngineCore.step: block registration, routing publish, RequestOutputs
    hand-off     AsyncEngine._deliver_step: the step's outputs to each request's stream (one running loop)
    host         step + hand-off - forward - readback (wall time)
    host_cpu     the same in the engine thread's CPU time: without the time the thread was descheduled
                 or waiting for the GIL (the stream's event loop thread), which on a loaded machine
                 lands at random in the wall-time phases
    forward_cpu  the forward's CPU time in the engine thread (on CPU with one torch thread, host_cpu +
                 forward_cpu is the whole step's work)

    python bench/engine_overhead.py [--model small] [--device cpu|cuda] [--batch-sizes 1,32,256]
                                    [--decode eager|compiled|graph] [--overlap default|on|off] [--steps 20]
                                    [--threads N] [--out FILE.json]

Before / after, side by side: `--against DIR --rounds N` runs this script N times over DIR's engine
(another checkout, e.g. `git worktree add --detach /tmp/base main`: its `locus` package first on the
path) and N times over this checkout's, alternating, each in a process of its own, and reports each
side's median over the rounds of each phase, and after / before of the host time. The instrument is
the same on both sides (this script; it also wraps the engine before the two-half step):

    python bench/engine_overhead.py --against /tmp/base --rounds 3 --threads 1 --out FILE.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import subprocess
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import torch

PHASES = ("schedule", "prepare", "forward", "sample", "readback", "postprocess", "outputs", "hand-off", "host",
          "host_cpu", "forward_cpu")


class Timers:
    """Seconds spent in each wrapped call during the current step."""

    def __init__(self, sync):
        self.sync = sync  # waits for the device (CUDA) inside the forward's timer
        self.now: dict[str, float] = defaultdict(float)
        self.cpu: dict[str, float] = defaultdict(float)  # this thread's CPU time (not while descheduled or waiting)
        self._open: set[str] = set()  # a wrapped call inside another of the same name counts once

    def wrap(self, name: str, fn, wait: bool = False):
        def timed(*args, **kwargs):
            # inside a compiled graph (dynamo traces the model's forward): not timed, the graph's call is
            if torch.compiler.is_compiling() or name in self._open:
                return fn(*args, **kwargs)
            self._open.add(name)
            start, start_cpu = time.perf_counter(), time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                if wait:
                    self.sync()
                self.now[name] += time.perf_counter() - start
                self.cpu[name] += time.thread_time() - start_cpu
                self._open.discard(name)
        return timed

    def take(self) -> tuple[dict[str, float], dict[str, float]]:
        now, cpu = dict(self.now), dict(self.cpu)
        self.now, self.cpu = defaultdict(float), defaultdict(float)
        return now, cpu


def instrument(core, timers: Timers) -> None:
    """Wrap the engine's phase boundaries (instance attributes only; the classes stay untouched)."""
    core.scheduler.schedule = timers.wrap("schedule", core.scheduler.schedule)
    core.runner.run = timers.wrap("run", core.runner.run)
    sampler = core.sampler
    if hasattr(sampler, "launch"):  # the sync-free sampler and the two-half step (issue 43)
        sampler.launch = timers.wrap("sample", sampler.launch)
        core._take_sample = timers.wrap("postprocess", core._take_sample)
    else:  # the engine before them (--against): Sampler.sample inside EngineCore._sample
        sampler.sample = timers.wrap("sample", sampler.sample)
        core._sample = timers.wrap("sample+postprocess", core._sample)
    model = core.model
    model.forward = timers.wrap("forward", model.forward, wait=True)
    model.compute_logits = timers.wrap("forward", model.compute_logits, wait=True)
    if hasattr(core.runner, "lm_head"):
        core.runner.lm_head = timers.wrap("forward", core.runner.lm_head, wait=True)  # lm_head + argmax
    graphs = getattr(core.runner, "graphs", None)
    if graphs is not None:  # the decode graphs: a compiled or uncaptured call, or a CUDA graph's replay
        for name in ("_call", "_compiled"):  # (_compiled: the code before the decode-graph runner)
            if hasattr(graphs, name):
                setattr(graphs, name, timers.wrap("forward", getattr(graphs, name), wait=True))
        for graph in getattr(graphs, "_graphs", {}).values():
            graph.replay = timers.wrap("forward", graph.replay, wait=True)


class Streams:
    """An AsyncEngine (not started) whose sinks live on an event loop in another thread, each with a
    listener that takes every output: the hand-off's cost on the engine thread, with a live loop."""

    def __init__(self, core):
        from locus.engine.frontend.async_engine import AsyncEngine
        from locus.engine.frontend.request_stream import OutputSink

        self.engine = AsyncEngine(core)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self._sink = OutputSink

    def register(self, request_ids) -> None:
        for rid in request_ids:
            sink = self._sink()
            sink.listen(lambda out: True)
            self.engine._sinks[rid] = (sink, self.loop)

    def deliver(self, outputs) -> None:
        self.engine._publish_stats(0)
        self.engine._deliver_step(outputs)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


def measure(model, tokenizer, B: int, args, device: torch.device) -> dict:
    from locus.engine.core.engine_core import EngineConfig, EngineCore
    from locus.engine.sampling.params import SamplingParams
    from offline import make_prompts

    warm = 4
    total_len = args.prompt_len + warm + args.steps + 4
    blocks = B * (-(-total_len // 16) + 1)
    config = dict(max_num_seqs=B, max_num_batched_tokens=max(2048, B * args.prompt_len), num_kv_blocks=blocks,
                  compile_buckets=(B,))  # decode graphs (compiled or captured): the one bucket timed
    if args.decode == "compiled":
        config.update(compile_decode=True)
    elif args.decode == "eager" and device.type == "cuda":
        config.update(enforce_eager=True)
    if args.overlap != "default":
        if "async_scheduling" not in EngineConfig.__dataclass_fields__:
            raise SystemExit("--overlap: this engine has no overlapped schedule")
        config.update(async_scheduling=args.overlap == "on")
    core = EngineCore(model, tokenizer, EngineConfig(**config))
    params = SamplingParams(temperature=0.0, max_tokens=warm + args.steps + 3, ignore_eos=True)
    prompts = make_prompts(B, args.prompt_len, model.config.vocab_size, seed=B)
    ids = [f"r{i}" for i in range(B)]
    for rid, prompt in zip(ids, prompts):
        core.add_request(rid, prompt, params)
    streams = Streams(core)
    streams.register(ids)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    timers = Timers(sync)
    try:
        while core.scheduler.waiting or any(s.num_computed < len(s.prompt_ids) for s in core.scheduler.running):
            streams.deliver(core.step())  # prefill (possibly chunked)
        for _ in range(warm):
            streams.deliver(core.step())
        instrument(core, timers)
        rows = []
        waited = lambda: getattr(core, "step_wait_seconds", 0.0)  # noqa: E731
        for _ in range(args.steps):
            timers.take()
            before_wait = waited()
            start, start_cpu = time.perf_counter(), time.thread_time()
            outputs = core.step()
            stepped = time.perf_counter()
            streams.deliver(outputs)
            end, end_cpu = time.perf_counter(), time.thread_time()
            t, cpu = timers.take()
            row = {
                "schedule": t.get("schedule", 0.0),
                "prepare": t.get("run", 0.0) - t.get("forward", 0.0),
                "forward": t.get("forward", 0.0),
                "sample": t.get("sample", 0.0),
                "readback": waited() - before_wait,
                "postprocess": t.get("postprocess", t.get("sample+postprocess", 0.0) - t.get("sample", 0.0)),
                "hand-off": end - stepped,
            }
            row["outputs"] = (stepped - start) - sum(row[k] for k in ("schedule", "prepare", "forward", "sample",
                                                                      "readback", "postprocess"))
            row["host"] = (end - start) - row["forward"] - row["readback"]
            row["host_cpu"] = (end_cpu - start_cpu) - cpu.get("forward", 0.0)
            row["forward_cpu"] = cpu.get("forward", 0.0)  # (on CPU, with host_cpu: the whole step's CPU time)
            rows.append(row)
        decoded = sum(len(out.outputs[0].delta_token_ids) for out in outputs)
        if decoded != B:
            raise RuntimeError(f"the last timed step decoded {decoded} tokens, not {B}: not a pure decode batch")
    finally:
        streams.close()
    return {phase: statistics.median(r[phase] for r in rows) * 1e3 for phase in PHASES}


def git_commit(where: Path | None = None) -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=where or Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def without(argv: list[str], dropped: tuple[str, ...]) -> list[str]:
    """argv less the `dropped` options and their values."""
    kept, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg.split("=")[0] in dropped:
            skip = "=" not in arg
        else:
            kept.append(arg)
    return kept


def compare(args, argv: list[str]) -> int:
    """Run the bench from `args.against` (before) and from this checkout (after), alternately, each
    round in fresh processes; print and write each side's medians over the rounds and after / before."""
    import os
    import tempfile

    here = Path(__file__).resolve().parent.parent
    sides = {"before": Path(args.against).resolve(), "after": here}
    for name, root in sides.items():
        if not (root / "locus" / "engine" / "engine_core.py").is_file():
            raise SystemExit(f"engine_overhead: {root} is not a Locus checkout")
    # each side gets this run's options, less the comparison's own; the baseline also without --overlap,
    # which an engine before the overlapped schedule does not have
    options = {"before": without(argv, ("--against", "--rounds", "--out", "--overlap")),
               "after": without(argv, ("--against", "--rounds", "--out"))}
    runs: dict[str, list[dict]] = {name: [] for name in sides}
    with tempfile.TemporaryDirectory(prefix="engine-overhead-") as tmp:
        for r in range(args.rounds):
            for name, root in sides.items():
                out = Path(tmp) / f"{name}{r}.json"
                command = [sys.executable, str(Path(__file__).resolve()), *options[name], "--out", str(out)]
                env = {**os.environ, "PYTHONPATH": str(root)}
                done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True)
                if done.returncode != 0:
                    raise SystemExit(f"engine_overhead: the {name} run failed:\n{done.stderr[-3000:]}")
                runs[name].append(json.loads(out.read_text()))
                print(f"[round {r + 1}/{args.rounds}] {name}: host ms " + ", ".join(
                    f"{B} seqs {m['host']:.2f}" for B, m in runs[name][-1]["ms"].items()), flush=True)
    medians = {name: {B: {ph: statistics.median(run["ms"][B][ph] for run in rs) for ph in rs[0]["ms"][B]}
                      for B in rs[0]["ms"]} for name, rs in runs.items()}
    ratio = {B: medians["after"][B]["host"] / medians["before"][B]["host"] for B in medians["after"]}
    print(f"host time of a decode step, median of {args.rounds} alternating rounds each, ms")
    cpu_ratio = {B: medians["after"][B]["host_cpu"] / medians["before"][B]["host_cpu"] for B in medians["after"]}
    print("| sequences | before host | after host | after / before | before host CPU | after host CPU | after / before "
          "| before forward | after forward |")
    print("|---" * 9 + "|")
    for B in medians["after"]:
        b, a = medians["before"][B], medians["after"][B]
        print(f"| {B} | {b['host']:.3f} | {a['host']:.3f} | {ratio[B]:.2f} | {b['host_cpu']:.3f} | {a['host_cpu']:.3f} "
              f"| {cpu_ratio[B]:.2f} | {b['forward']:.3f} | {a['forward']:.3f} |")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({
            "bench": "engine_overhead", "command": " ".join(["python bench/engine_overhead.py", *argv]),
            "workload": runs["after"][0]["workload"], "rounds": args.rounds,
            "commits": {name: git_commit(root) for name, root in sides.items()},
            "ms": medians["after"], "before_ms": medians["before"], "host_after_over_before": ratio,
            "host_cpu_after_over_before": cpu_ratio,
            "runs": runs,
            "machine": {"python": platform.python_version(), "torch": torch.__version__, "load_average": os.getloadavg()},
        }, indent=1) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small", help="preset name or checkpoint dir")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--moe-backend", default="auto", choices=["auto", "torch", "cpu", "triton"])
    p.add_argument("--batch-sizes", default="1,32,256")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--decode", default="default", choices=["default", "eager", "compiled", "graph"],
                   help="how decode steps run: the engine's default for the device (CPU eager, CUDA graphs), "
                        "eager, compiled (--compile), graph (CUDA graphs, CUDA only)")
    p.add_argument("--overlap", default="default", choices=["default", "on", "off"],
                   help="the overlapped schedule (EngineConfig.async_scheduling; default: off)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    p.add_argument("--against", default=None, metavar="DIR",
                   help="another checkout: run its bench and this one alternately (--rounds), before / after")
    p.add_argument("--rounds", type=int, default=3, help="with --against: runs of each side")
    args = p.parse_args(argv)
    if args.against:
        return compare(args, argv if argv is not None else sys.argv[1:])
    if args.threads:
        torch.set_num_threads(args.threads)

    from locus.engine.checkpoint.loader import load

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here")
    if args.decode == "graph" and device.type != "cuda":
        p.error("--decode graph needs --device cuda")
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    loaded = load(args.model, args.dtype, str(device), args.moe_backend, 0)
    results = {}
    for B in sizes:
        results[B] = measure(loaded.model, loaded.tokenizer, B, args, device)
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    workload = (f"{args.model}, {args.dtype}, {where}, decode {args.decode}, overlap {args.overlap}, "
                f"prompts of {args.prompt_len} tokens, "
                f"median of {args.steps} steps")
    print(f"host time of a decode step ({workload}), ms")
    print("| sequences | " + " | ".join(PHASES) + " | host / step |")
    print("|---" * (len(PHASES) + 2) + "|")
    for B, r in results.items():
        step = r["host"] + r["forward"]
        print(f"| {B} | " + " | ".join(f"{r[ph]:.3f}" for ph in PHASES) + f" | {r['host'] / step:.0%} |")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({
            "bench": "engine_overhead", "workload": workload, "command": " ".join(["python bench/engine_overhead.py", *(argv or sys.argv[1:])]),
            "commit": git_commit(Path(sys.modules["locus"].__file__).parent), "ms": {str(B): r for B, r in results.items()},
            "machine": {"python": platform.python_version(), "torch": torch.__version__, "device": where},
        }, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
