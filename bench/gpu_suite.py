"""Everything only a GPU can show, in one command: one JSON and a markdown table (printed last).

    python bench/gpu_suite.py [--stages tests,decode-small,...] [--deadline 470]
                              [--budget decode-scout=150 ...] [--out results/gpu_suite_<device>.json]
    python bench/gpu_suite.py --dry-run --out FILE.json      # the JSON's shape, no GPU needed

Stages, in this order (each in its own process with its own time budget, so that a hang or a crash
costs that stage only; its error goes into the JSON and the suite goes on):
    tests         pytest -m gpu: kernels, paged attention, decode graphs captured and compiled, sampling
    decode-small  bench/profile_decode.py --device cuda, `small`, bfloat16, 32 sequences: the step of
                  each decode mode against its floor (target <= 3x); fails if any graph was skipped;
                  the step split into graph replay, its kernels, launch gaps and host time
    decode-scout  the same on `scout-2l` (two layers of Llama-4 Scout, weights drawn on the GPU;
                  target <= 1.5x)
    parity        greedy tokens and logits max-diff in float32 on `small`: Triton vs torch experts,
                  CUDA graph vs eager
    kernels       bench/moe_kernels.py --roofline on the Scout and Maverick expert shapes
    kernels-narrow  the same on Scout's shape at T = 1, 8, 4096 with the experts in bf16, fp8, mxfp8
                  and mxfp4: per format, bytes as stored, share of the copy bandwidth, the dot form,
                  speed against bf16
    offline       bench/offline.py --device cuda: out tok/s against transformers `generate`
    serve         bench/serve.py: one HTTP run against a launched `locus serve --device cuda`
    overhead      bench/engine_overhead.py --device cuda: the host's time per decode step at 1, 32, 256
Without CUDA it says so and exits 2 (--dry-run excepted). Exit 1 when a stage failed.
No network is needed: presets have seeded random weights, the checkpoint for transformers is
written locally.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
FORMAT = "locus-gpu-suite"
STAGES = ("tests", "decode-small", "decode-scout", "parity", "kernels", "kernels-narrow", "offline", "serve", "overhead")
# Seconds each (estimates, not measured yet); the suite also starts no stage after --deadline, so a
# stage that does not fit is skipped with that reason (run it with --stages in a second call).
BUDGETS = {"tests": 110, "decode-small": 75, "decode-scout": 75, "parity": 45, "kernels": 130, "kernels-narrow": 50,
           "offline": 55, "serve": 60, "overhead": 40}
TARGETS = {"decode-small": 3.0, "decode-scout": 1.5}  # decode step / floor (issue 43)


@dataclass
class StageResult:
    name: str
    status: str = "not run"  # ok | failed | timeout | skipped | dry-run | not run
    seconds: float = 0.0
    reason: str | None = None  # why it failed or was skipped
    command: list[str] = field(default_factory=list)
    figures: dict = field(default_factory=dict)
    output_tail: str = ""


# --- the stages (each runs in this process's child, or as a bench script) ------------------------
def run_command(result: StageResult, command: list[str], budget: float, env: dict | None = None) -> int | None:
    """Run a stage's command with a time limit, in its own process group (a launched server or any
    other grandchild goes with it); fills status, seconds and the output's tail."""
    result.command = command
    start = time.perf_counter()
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env={**os.environ, "PYTHONPATH": _python_path(), **(env or {})})
    try:
        output, _ = proc.communicate(timeout=budget)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        output, _ = proc.communicate()
        result.seconds = time.perf_counter() - start
        result.status, result.reason = "timeout", f"over its {budget:.0f} s budget"
        result.output_tail = _tail(output or "")
        return None
    finally:
        _kill_group(proc)  # whatever the stage left running
    result.seconds = time.perf_counter() - start
    result.output_tail = _tail(output)
    if proc.returncode != 0:
        result.status = "failed"
        result.reason = f"exit {proc.returncode}: " + _last_error(output)
    else:
        result.status = "ok"
    return proc.returncode


def _python_path() -> str:
    """This checkout first, then whatever the caller put on the path (packages carried to the device)."""
    return os.pathsep.join([str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))])


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def stage_tests(result: StageResult, budget: float, work: Path) -> None:
    junit = work / "tests.xml"
    paths = ["tests/kernels", "tests/engine/runner/test_decode_graph_cuda.py", "tests/engine/sampling/test_sampling.py"]
    run_command(result, [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
                         f"--junitxml={junit}", *paths], budget)
    if junit.is_file():
        result.figures = junit_counts(junit.read_text())
        if result.status == "ok" and result.figures.get("tests", 0) == 0:
            result.status, result.reason = "failed", "no GPU test ran"


def junit_counts(xml: str) -> dict:
    import xml.etree.ElementTree as ET

    root = ET.fromstring(xml)
    suites = [root] if root.tag == "testsuite" else list(root)
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    counts["failed_tests"] = [f"{case.get('classname')}::{case.get('name')}" for s in suites for case in s.iter("testcase")
                              if case.find("failure") is not None or case.find("error") is not None]
    return counts


def stage_decode(result: StageResult, budget: float, work: Path, model: str) -> None:
    out = work / f"decode_{model}.json"
    modes = "eager,graph,graph+compile" if model == "small" else "eager,graph"
    run_command(result, [sys.executable, str(BENCH / "profile_decode.py"), "--device", "cuda", "--model", model,
                         "--dtype", "bfloat16", "--prompts", "32", "--steps", "20", "--modes", modes,
                         "--out", str(out)], budget)
    if not out.is_file():
        return
    result.figures = decode_figures(json.loads(out.read_text()), TARGETS[result.name])
    if result.figures["graphs_skipped"] or result.figures["inductor_cudagraph_skips"]:
        result.status = "failed"
        result.reason = f"graphs skipped: {result.figures['graphs_skipped'] or result.figures['inductor_cudagraph_skips']}"


# step_split: per mode, the step's replay (CUDA events), its kernels' sum (torch.profiler), the launch gaps
# between them and the host's time on top (bench/profile_decode.py)
DECODE_KEYS = ("workload", "floor_ms", "floor_parts_ms", "step_ms", "step_over_floor", "bandwidth_gbps", "peak_tflops",
               "graphs", "graphs_skipped", "inductor_cudagraph_skips", "step_split")


def decode_figures(data: dict, target: float) -> dict:
    """What the suite keeps of a bench/profile_decode.py JSON: the best non-eager mode against the target."""
    best = min((m for m in data["step_ms"] if m != "eager"), key=lambda m: data["step_ms"][m])
    return {**{k: data[k] for k in DECODE_KEYS}, "target_step_over_floor": target, "best_mode": best,
            "target_met": data["step_over_floor"][best] <= target}


def stage_kernels(result: StageResult, budget: float, work: Path) -> None:
    out = work / "kernels.json"
    code = run_command(result, [sys.executable, str(BENCH / "moe_kernels.py"), "--roofline", "--shapes",
                                "llama4-scout,llama4-maverick", "--out", str(out)], budget)
    if code is not None and code != 0 and "--roofline" in result.output_tail and "unrecognized" in result.output_tail:
        result.reason = "bench/moe_kernels.py has no --roofline yet (the kernel helper's change has not landed)"
    if out.is_file():
        result.figures = {"table": json.loads(out.read_text())}


# Few points, so that the stage stays well under a minute (Triton compiles each format's kernels per
# config): two decode batches (one expert, then about half of Scout's 16) and one prefill batch (the tensor-core
# forms); the model-dtype rows run beside them in the same process for the ratio.
NARROW_FORMATS = "model,fp8,mxfp8,mxfp4"
NARROW_TOKENS = "1,8,4096"


def stage_kernels_narrow(result: StageResult, budget: float, work: Path, shape: str = "llama4-scout",
                         tokens: str = NARROW_TOKENS, extra: tuple[str, ...] = ()) -> None:
    """`shape`, `tokens` and `extra` (more bench arguments) are for the CPU self-check."""
    out = work / "kernels_narrow.json"
    run_command(result, [sys.executable, str(BENCH / "moe_kernels.py"), "--roofline", "--shapes", shape,
                         "--format", NARROW_FORMATS, "--tokens", tokens, *extra, "--out", str(out)], budget)
    if out.is_file():  # the bench rewrites it after every row: a stage cut at its budget keeps its rows
        result.figures = narrow_figures(json.loads(out.read_text()))


def narrow_figures(table: dict) -> dict:
    """The roofline table and, per weight format and T, what the narrow rows show: bytes moved as the
    format stores them (elements and scales, plus activations), their share of the measured copy
    bandwidth, the dot form, parity, and the model-dtype row's time over this one (measured beside it)."""
    model = {r["T"]: r["ms"] for r in table["rows"] if r["dot"] is None}
    by_format: dict[str, dict] = {}
    for r in table["rows"]:
        by_format.setdefault(r["weights"], {})[str(r["T"])] = {
            "dot": r["dot"], "ms": r["ms"], "bytes": r["bytes"], "gbps": r["gbps"],
            "bandwidth_share": r["bandwidth_share"], "compute_share": r["compute_share"], "parity": r["parity"],
            "speedup_vs_model": model[r["T"]] / r["ms"] if r["T"] in model else None}
    return {"table": table, "by_format": by_format}


def stage_offline(result: StageResult, budget: float, work: Path) -> None:
    out = work / "offline.json"
    # best of two runs: the process's first run pays Triton's JIT compiles (both engines' kernels)
    run_command(result, [sys.executable, str(BENCH / "offline.py"), "--device", "cuda", "--dtype", "bfloat16",
                         "--prompts", "64", "--prompt-len", "64", "--new-tokens", "64", "--repeats", "2",
                         "--out", str(out)], budget)
    if out.is_file():
        result.figures = offline_figures(json.loads(out.read_text()))


def offline_figures(data: dict) -> dict:
    return {"rows": data["rows"], "ratio_locus_over_transformers": data["ratio_locus_over_transformers"],
            "identical_greedy_share": data["identical_greedy_share"], "transformers_error": data.get("transformers_error")}


def stage_serve(result: StageResult, budget: float, work: Path) -> None:
    out = work / "serve.json"
    run_command(result, [sys.executable, str(BENCH / "serve.py"), "--launch-model", "small", "--device", "cuda",
                         "--dtype", "bfloat16", "--max-num-seqs", "64", "--num-prompts", "64", "--input-len", "64",
                         "--output-len", "64", "--concurrency", "32", "--ready-timeout", str(int(budget * 0.6)),
                         "--out", str(out)], budget)
    if out.is_file():
        result.figures = serve_figures(json.loads(out.read_text()))
        if result.figures["failed"]:
            result.status = "failed"
            result.reason = f"{result.figures['failed']} requests failed: {result.figures['errors'][:2]}"


SERVE_KEYS = ("successful", "failed", "duration_s", "output_throughput", "ttft_ms", "tpot_ms", "itl_ms", "errors")


def serve_figures(data: dict) -> dict:
    return {k: data["load"][k] for k in SERVE_KEYS}


def stage_overhead(result: StageResult, budget: float, work: Path) -> None:
    out = work / "overhead.json"
    run_command(result, [sys.executable, str(BENCH / "engine_overhead.py"), "--device", "cuda", "--dtype", "bfloat16",
                         "--batch-sizes", "1,32,256", "--steps", "10", "--out", str(out)], budget)
    if out.is_file():
        result.figures = overhead_figures(json.loads(out.read_text()))


def overhead_figures(data: dict) -> dict:
    return {"workload": data["workload"], "ms": data["ms"]}


def dry_figures(name: str) -> dict:
    """The figures' keys a real run fills, each None (the shape of the JSON without a GPU)."""
    keys = {"tests": ("tests", "failures", "errors", "skipped", "failed_tests"),
            "parity": ("triton_vs_torch", "graph_vs_eager", "overlapped_vs_serial", "passed"), "kernels": ("table",),
            "kernels-narrow": ("table", "by_format"),
            "offline": ("rows", "ratio_locus_over_transformers", "identical_greedy_share", "transformers_error"),
            "serve": SERVE_KEYS, "overhead": ("workload", "ms")}.get(name, (*DECODE_KEYS, "best_mode", "target_met"))
    figures = dict.fromkeys(keys)
    if name in TARGETS:
        figures["target_step_over_floor"] = TARGETS[name]
    return figures


def stage_parity(result: StageResult, budget: float, work: Path) -> None:
    out = work / "parity.json"
    run_command(result, [sys.executable, str(BENCH / "gpu_parity.py"), "--out", str(out)], budget)
    if out.is_file():
        result.figures = json.loads(out.read_text())
        if result.status == "ok" and not result.figures["passed"]:
            result.status, result.reason = "failed", "greedy tokens differ (see figures)"


RUNNERS = {"tests": stage_tests, "decode-small": lambda r, b, w: stage_decode(r, b, w, "small"),
           "decode-scout": lambda r, b, w: stage_decode(r, b, w, "scout-2l"), "parity": stage_parity,
           "kernels": stage_kernels, "kernels-narrow": stage_kernels_narrow, "offline": stage_offline,
           "serve": stage_serve, "overhead": stage_overhead}


# --- the suite ---------------------------------------------------------------------------------------
def _tail(text: str, chars: int = 3000) -> str:
    return text[-chars:]


def _last_error(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    errors = [line for line in lines if re.search(r"(Error|error|FAILED|Traceback)", line)]
    return (errors[-1] if errors else lines[-1] if lines else "no output")[:400]


def parse_budgets(items: list[str]) -> dict[str, float]:
    budgets = dict(BUDGETS)
    for item in items:
        name, _, value = item.partition("=")
        if name not in BUDGETS or not value:
            raise SystemExit(f"gpu_suite: --budget takes STAGE=SECONDS with STAGE one of {', '.join(STAGES)}, got {item!r}")
        budgets[name] = float(value)
    return budgets


def environment(dry_run: bool) -> dict:
    import torch

    env = {"torch": torch.__version__, "python": platform.python_version(), "cuda": torch.version.cuda}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    env["device"] = "dry-run" if dry_run else torch.cuda.get_device_name()
    # LOCUS_COMMIT: the commit of a tree copied without its history (a device machine's copy)
    env["commit"] = os.environ.get("LOCUS_COMMIT")
    try:
        env["commit"] = env["commit"] or subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                       check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        env["commit"] = None
    return env


def summary_row(r: StageResult) -> str:
    try:
        note = summary_note(r) if r.figures and r.status not in ("dry-run", "not run") else ""
    except (KeyError, TypeError, ValueError) as exc:  # the table must print whatever a stage left
        note = f"figures incomplete ({type(exc).__name__}: {exc})"
    reason = f" ({r.reason})" if r.reason else ""
    return f"| {r.name} | {r.status}{reason} | {r.seconds:.0f} | {note} |"


def narrow_note(by_format: dict) -> str:
    """Per T: each format's share of the copy bandwidth (narrow rows: dot form, speed against the model dtype)."""
    parts = []
    for t in dict.fromkeys(t for points in by_format.values() for t in points):
        cells = []
        for weights, points in by_format.items():
            if t not in points:
                continue
            p = points[t]
            cell = weights + (f" ({p['dot']})" if p["dot"] else "") + f" {p['bandwidth_share']:.0%} BW"
            if p["dot"] and p["speedup_vs_model"]:
                cell += f" {p['speedup_vs_model']:.2f}x"
            cells.append(cell)
        parts.append(f"T={t}: " + ", ".join(cells))
    return "; ".join(parts)


def summary_note(r: StageResult) -> str:
    f = r.figures
    if r.name == "tests":
        note = f"{f['tests'] - f['failures'] - f['errors'] - f['skipped']} passed, {f['failures'] + f['errors']} failed, {f['skipped']} skipped"
    elif r.name.startswith("decode"):
        steps = ", ".join(f"{m} {ms:.3f} ms ({f['step_over_floor'][m]:.2f}x)" for m, ms in f["step_ms"].items())
        note = (f"floor {f['floor_ms']:.3f} ms; {steps}; target <= {f['target_step_over_floor']}x: "
                f"{'met' if f['target_met'] else 'MISSED'}; skipped graphs: {f['graphs_skipped'] or 'none'}")
        split = f["step_split"].get(f["best_mode"]) or {}
        if split.get("reason") is None and split.get("replay_ms") is not None:
            note += (f"; {f['best_mode']} step = replay {split['replay_ms']:.3f} (kernels {split['kernel_sum_ms']:.3f} "
                     f"+ gaps {split['launch_gaps_ms']:.3f}) + host {split['host_ms']:.3f} ms")
    elif r.name == "parity":
        g, t = f["graph_vs_eager"], f["triton_vs_torch"]
        note = (f"graph vs eager: {g['tokens_identical']}/{g['prompts']} identical, max diff {g['logits_max_diff']}; "
                f"triton vs torch: argmax {t['argmax_identical']}/{t['prompts']}, max diff {t['logits_max_diff']:.2e}")
        o = f.get("overlapped_vs_serial")
        if o:
            note += f"; overlapped vs serial schedule: {o['tokens_identical']}/{o['prompts']} identical"
    elif r.name == "offline":
        note = ", ".join(f"{row['engine']} {row['output_tokens_per_s']:,.0f} tok/s" for row in f["rows"])
        if f.get("ratio_locus_over_transformers"):
            note += f"; locus / transformers {f['ratio_locus_over_transformers']:.2f}x"
    elif r.name == "serve":
        note = (f"{f['output_throughput']:,.0f} out tok/s, TTFT p50 {f['ttft_ms']['median']:.1f} ms, "
                f"TPOT p50 {f['tpot_ms']['median']:.2f} ms, {f['failed']} failed")
    elif r.name == "kernels-narrow":
        note = narrow_note(f["by_format"])
    elif r.name == "kernels":
        note = "table in the JSON"
    elif r.name == "overhead":
        note = "host / forward ms: " + ", ".join(f"{b} seqs {m['host']:.3f} / {m['forward']:.3f}" for b, m in f["ms"].items())
    else:
        note = ""
    return note


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated subset of {', '.join(STAGES)}")
    p.add_argument("--budget", action="append", default=[], metavar="STAGE=SECONDS", help="a stage's time budget")
    p.add_argument("--deadline", type=float, default=470.0,
                   help="seconds after which no further stage starts (and a running one gets only what is left)")
    p.add_argument("--out", default=None, help="default: results/gpu_suite_<device>.json")
    p.add_argument("--dry-run", action="store_true", help="run nothing; write a JSON of the right shape")
    args = p.parse_args(argv)
    stages = [s for s in args.stages.split(",") if s]
    unknown = [s for s in stages if s not in STAGES]
    if unknown:
        p.error(f"unknown stages {unknown}; choose from {', '.join(STAGES)}")
    budgets = parse_budgets(args.budget)

    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_suite: no CUDA device here; this suite measures what only a GPU can show "
              "(--dry-run writes the JSON's shape without one)", file=sys.stderr)
        return 2
    env = environment(args.dry_run)
    device_tag = re.sub(r"[^A-Za-z0-9]+", "_", env["device"]).strip("_")
    out = Path(args.out or ROOT / "results" / f"gpu_suite_{device_tag}.json")
    results = {name: StageResult(name) for name in stages}
    start = time.perf_counter()

    def report() -> dict:
        """The JSON as it stands (written after every stage, so a run cut short keeps what it measured)."""
        ran = [r for r in results.values() if r.status not in ("dry-run", "not run", "skipped")]
        targets = {name: {"target": results[name].figures.get("target_step_over_floor"),
                          "met": results[name].figures.get("target_met")} for name in TARGETS if name in results}
        data = {"format": FORMAT, "version": 1, **env,
                "command": " ".join(["python bench/gpu_suite.py", *(argv if argv is not None else sys.argv[1:])]),
                "dry_run": args.dry_run, "seconds": time.perf_counter() - start,
                "passed": bool(ran) and all(r.status == "ok" for r in ran),
                "complete": all(r.status not in ("skipped", "not run") for r in results.values()),
                "targets": targets, "stages": {name: asdict(r) for name, r in results.items()}}
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(data, indent=1) + "\n")
        return data

    with tempfile.TemporaryDirectory(prefix="locus-gpu-suite-") as tmp:
        for name in stages:
            r = results[name]
            left = args.deadline - (time.perf_counter() - start)
            if args.dry_run:
                r.status, r.reason, r.figures = "dry-run", "nothing run", dry_figures(name)
                continue
            if left < 15:
                r.status, r.reason = "skipped", f"the suite's deadline ({args.deadline:.0f} s) was reached"
                continue
            print(f"[gpu_suite] {name} (budget {min(budgets[name], left):.0f} s)", flush=True)
            try:
                RUNNERS[name](r, min(budgets[name], left), Path(tmp))
            except Exception as exc:  # noqa: BLE001 - a stage's own bug must not lose the others
                r.status, r.reason = "failed", f"the suite's stage code raised {type(exc).__name__}: {exc}"
            print(f"[gpu_suite] {name}: {r.status} in {r.seconds:.0f} s{f' ({r.reason})' if r.reason else ''}", flush=True)
            report()
    data = report()
    skipped = [name for name, r in results.items() if r.status == "skipped"]
    verdict = "PASSED" if data["passed"] else "FAILED" if any(
        r.status in ("ok", "failed", "timeout") for r in results.values()) else "nothing run"
    print(f"\nGPU suite on {env['device']} (torch {env['torch']}, CUDA {env['cuda']}, Triton {env['triton']}, "
          f"commit {env['commit']}): {verdict} in {data['seconds']:.0f} s; wrote {out}"
          + (f"\nnot run (deadline): python bench/gpu_suite.py --stages {','.join(skipped)}" if skipped else "") + "\n")
    print("| stage | status | s | figures |\n|---|---|---|---|")
    for r in results.values():
        print(summary_row(r))
    return 1 if verdict == "FAILED" else 0


if __name__ == "__main__":
    sys.exit(main())
