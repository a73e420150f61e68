"""Checks of the decode step-time model (locus/routing/replay/step_time.py) against measurements.

`kernels`: the expert-kernel part. The H200 roofline rows (`bench/moe_kernels.py --roofline`,
results/moe_roofline_NVIDIA_H200.json: one fused_moe call per row, uniform top-1 routing) are split by
token count: the rows with T in --fit-tokens fit the profile's kernel floor and efficiency curve, the
others are held out and predicted by the model (floor + every touched expert's roofline over the
efficiency at T*K/experts_touched tokens per expert), against their measured time. The fit:
  floor, slope  least squares of measured time on the roofline time over the fit rows with under two
                tokens per expert (one token per expert: the kernels' fixed cost shows alone);
  efficiency    each fit row's roofline time / (its time - floor), grouped by tokens per expert
                rounded to a power of two, the median of each group at that power of two.
`--write-profile` prints the figures for the profiles' expert_efficiency and expert_kernel_floor_s.

`ratio`: the locality/EPLB decode TPOT ratio on the shaped two-namespace network (bench/ep_network.py,
`mini` on 2x2 ranks, 3 slots, a wave of --streams requests of --output-len tokens). Records `mini`'s
routing offline (one process, greedy, as the bench's planning trace): a planning trace of
--planning-requests requests and --waves measured waves of prompts from the bench's measured pool;
plans eplb and locality with `locus plan` on the planning trace; replays every wave in the decode step
order under both plans (eplb: balanced assignment; locality: its grouper, all the wave admitted at once)
on the cpu-2core-tbf profile at each rate (its own composition, host_overlap, and the serial one beside
it); and compares the median of the per-wave ratios with the measured paired ratio of the given
bench/ep_network.py results (repeat i of the locality cluster over
repeat i of EPLB's, the same prompts; median over the pooled pairs).

    python bench/step_time_check.py kernels [--roofline results/moe_roofline_NVIDIA_H200.json] [--write-profile]
    python bench/step_time_check.py ratio --work DIR [--corpus RUN/corpus] \\
        --measured results/ep_network_mini_formats_8.json,... [--out OUT.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

PROG = "bench/step_time_check.py"
FIT_TOKENS = (1, 4, 16, 64, 256, 2048, 8192)
# NVIDIA's H200 SXM figures, as the h200-ib400 profile holds them
H200_BANDWIDTH, H200_PEAK = 4.8e12, 989e12


# --- kernels -----------------------------------------------------------------------------------
def roofline_seconds(row: dict, bandwidth: float, peak: float) -> tuple[float, float]:
    """(tokens per expert, the touched experts' roofline seconds) of one roofline row."""
    touched = row["experts_touched"]
    n = row["T"] * row["K"] / touched
    weights = 3 * row["H"] * row["I"] * 2
    flops = 6 * row["H"] * row["I"]
    return n, touched * max(weights / bandwidth, n * flops / peak)


def fit_kernels(rows: list[dict], fit_tokens=FIT_TOKENS, bandwidth=H200_BANDWIDTH, peak=H200_PEAK):
    """(floor seconds, [(tokens per expert, efficiency), ...]) from the rows whose T is in fit_tokens."""
    fit = [r for r in rows if r["T"] in fit_tokens]
    ideal = [(roofline_seconds(r, bandwidth, peak), r["ms"] * 1e-3) for r in fit]
    low = [(x, t) for (n, x), t in ideal if n < 2]
    slope, floor = np.polyfit([x for x, _ in low], [t for _, t in low], 1)
    groups: dict[int, list[float]] = {}
    for (n, x), t in ideal:
        groups.setdefault(int(round(np.log2(n))), []).append(x / (t - floor))
    curve = [(float(2 ** g), float(statistics.median(v))) for g, v in sorted(groups.items())]
    return float(floor), curve


def predict_row(row: dict, profile) -> float:
    """The model's seconds for one roofline row on `profile`: step_time.py's expert part for one rank
    and layer (its floor, and every touched expert's roofline over the profile's efficiency), with the
    row's mean tokens per expert for every touched expert."""
    n, ideal = roofline_seconds(row, profile.memory_bytes_per_s, profile.tensor_flops_per_s)
    return profile.expert_kernel_floor_s + ideal / float(profile.efficiency(n))


def check_kernels(args) -> dict:
    doc = json.loads(Path(args.roofline).read_text())
    rows = [r for r in doc["rows"] if r.get("weights", "bfloat16") == "bfloat16"]
    floor, curve = fit_kernels(rows)
    from locus.routing.replay.hardware import load_hardware

    profile = load_hardware("h200-ib400")
    in_profile = {"floor": profile.expert_kernel_floor_s, "curve": [list(p) for p in profile.expert_efficiency]}
    out = {"roofline": args.roofline, "fit_tokens": list(FIT_TOKENS), "floor_s": floor, "curve": curve,
           "profile": in_profile, "rows": []}
    print(f"fit on T in {FIT_TOKENS}: floor {floor * 1e6:.1f} us; efficiency "
          + ", ".join(f"{n:g}: {e:.3f}" for n, e in curve))
    print("| shape | T | tokens/expert | measured ms | model ms | error | fit or held out |")
    print("|---|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: (r["shape"], r["T"])):
        got = predict_row(r, profile)
        n, _ = roofline_seconds(r, H200_BANDWIDTH, H200_PEAK)
        held = r["T"] not in FIT_TOKENS
        err = got / (r["ms"] * 1e-3) - 1
        out["rows"].append({"shape": r["shape"], "T": r["T"], "tokens_per_expert": n, "measured_ms": r["ms"],
                            "model_ms": got * 1e3, "error": err, "held_out": held})
        print(f"| {r['shape']} | {r['T']} | {n:.2f} | {r['ms']:.4f} | {got * 1e3:.4f} | {100 * err:+.1f}% | "
              f"{'held out' if held else 'fit'} |")
    held = [abs(x["error"]) for x in out["rows"] if x["held_out"]]
    out["held_out_max_error"] = max(held)
    out["held_out_within_10pct"] = sum(e <= 0.10 for e in held)
    print(f"held out: {out['held_out_within_10pct']} of {len(held)} within 10%, worst {100 * max(held):.1f}%")
    if args.write_profile:
        print(json.dumps({"expert_kernel_floor_s": round(floor, 8),
                          "expert_efficiency": [[n, round(e, 4)] for n, e in curve]}))
    return out


# --- ratio -------------------------------------------------------------------------------------
def locus(*argv: str) -> str:
    done = subprocess.run([sys.executable, "-m", "locus.cli", *argv], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"{PROG}: locus {' '.join(argv)} failed:\n{done.stderr}")
    return done.stdout


def record(path: Path, items: list[tuple[str, str]], output_len: int) -> None:
    """mini's routing of `items` ((domain, prompt) pairs), one process, greedy: as bench/ep.py's planning trace."""
    from locus.engine.frontend.build import build_engine
    from locus.engine.sampling.sampler import SamplingParams

    built = build_engine("mini", moe_backend="torch", record_trace=str(path), model_name="mini")
    core, loaded = built.core, built.loaded
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    for i, (domain, prompt) in enumerate(items):
        core.add_request(f"r{i}", loaded.tokenizer.encode(prompt), params, domain)
    while core.has_unfinished():
        core.step()
    core.dump_recording()


def measured_ratios(paths: list[str], subject: str = "locality", against: str = "eplb") -> dict:
    """rate -> {"pairs", "paired_ratio" (median of subject_i / against_i), "medians" (the two medians)}."""
    pairs: dict[str, list[tuple[float, float]]] = {}
    for path in paths:
        data = json.loads(Path(path).read_text())
        runs = {(r["plan"], r.get("format", "model"), r["rate"]): [x["tpot_p50_ms"] for x in r["runs"]]
                for r in data["results"] if r["workload"] == "wave" and not r.get("overlap")}
        for (plan, fmt, rate), mine in runs.items():
            theirs = runs.get((against, fmt, rate))
            if plan == subject and fmt == "model" and theirs:
                pairs.setdefault(rate, []).extend(zip(mine, theirs))
    return {rate: {"pairs": len(p), "paired_ratio": statistics.median(a / b for a, b in p),
                   "subject_median_ms": statistics.median(a for a, _ in p),
                   "against_median_ms": statistics.median(b for _, b in p)} for rate, p in pairs.items()}


def rate_bytes_per_s(rate: str) -> float:
    if not rate.endswith("kbit"):
        raise SystemExit(f"{PROG}: a rate must be given as NNNkbit, got {rate!r}")
    return float(rate[:-4]) * 1e3 / 8


def check_ratio(args) -> dict:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from ep import prompt_source

    from locus.routing.grouping.live import simulate_live
    from locus.routing.plan.placement import load_plan
    from locus.routing.replay.assignment import assign_balanced
    from locus.routing.replay.hardware import load_hardware
    from locus.routing.replay.model_shape import load_model_shape
    from locus.routing.replay.simulator import replay
    from locus.traces.reader import TraceReader

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    text = prompt_source(argparse.Namespace(model="mini", prompts="text", corpus=args.corpus,
                                            prompt_tokens=args.prompt_tokens))
    planning, waves = work / "planning", work / "waves"
    if not (planning / "meta.json").is_file():
        record(planning, text.take(args.planning_requests, 0, planning=True), args.output_len)
    if not (waves / "meta.json").is_file():
        record(waves, text.take(args.waves * args.streams, 0), args.output_len)
    plans = {}
    for name in ("round_robin", "eplb", "locality"):
        path = work / f"{name}.json"
        if not path.is_file():
            locus("plan", str(planning), "--topology", "2x2", "--slots", "3", "--planner", name, "-o", str(path))
        plans[name] = load_plan(path)
    reader, shape = TraceReader(waves), load_model_shape("mini")
    base = load_hardware(args.hardware)
    measured = measured_ratios([p for p in args.measured.split(",") if p])
    rates = ["unshaped", *[r for r in args.rates.split(",") if r]]

    def tpot(plan_name: str, wave: int, hardware) -> dict:
        start, stop = wave * args.streams, (wave + 1) * args.streams
        plan = plans[plan_name]
        if plan_name == "locality":
            assignment = simulate_live(plan, reader, start, stop, "batch").assignment
        else:
            assignment = assign_balanced([r.tokens for r in reader.requests[start:stop]], 4, request_start=start)
        report = replay(reader, plan, plan.topology, assignment, step_order="decode", concurrency=args.streams,
                        hardware=hardware, model_shape=shape)
        return report.step_time

    serial_base = replace(base, host_overlap="none")  # the specified composition, for comparison
    out = {"work": str(work), "hardware": base.name, "host_overlap": base.host_overlap, "waves": args.waves,
           "rates": {}, "measured": measured}
    rows = []
    for rate in rates:
        per_plan, serial = {}, {}
        for name, profile in (("profile", base), ("serial", serial_base)):
            hardware = profile if rate == "unshaped" else profile.with_links(inter_bytes_per_s=rate_bytes_per_s(rate))
            times = {p: [tpot(p, w, hardware) for w in range(args.waves)] for p in ("round_robin", "eplb", "locality")}
            (per_plan if name == "profile" else serial).update(times)
        ratio = [a["tpot_p50_ms"] / b["tpot_p50_ms"] for a, b in zip(per_plan["locality"], per_plan["eplb"])]
        serial_ratio = [a["tpot_p50_ms"] / b["tpot_p50_ms"] for a, b in zip(serial["locality"], serial["eplb"])]
        serial_free = {p: [t["tpot_p50_ms"] - t["split_ms"]["overhead"] for t in v] for p, v in serial.items()}
        got = {"predicted_ms": {p: statistics.median(t["tpot_p50_ms"] for t in v) for p, v in per_plan.items()},
               "split_ms": {p: {part: statistics.median(t["split_ms"][part] for t in v) for part in v[0]["split_ms"]}
                            for p, v in per_plan.items()},
               "serial_ms": {p: statistics.median(t["tpot_p50_ms"] for t in v) for p, v in serial.items()},
               "model_part_ms": {p: statistics.median(v) for p, v in serial_free.items()},
               "predicted_ratio": statistics.median(ratio),
               "serial_ratio": statistics.median(serial_ratio),
               "measured": measured.get(rate)}
        if got["measured"]:
            got["error"] = got["predicted_ratio"] / got["measured"]["paired_ratio"] - 1
        out["rates"][rate] = got
        m = got["measured"]
        if m:
            got["serial_error"] = got["serial_ratio"] / m["paired_ratio"] - 1
        rows.append((rate, f"{got['predicted_ms']['eplb']:.1f}", f"{got['predicted_ms']['locality']:.1f}",
                     f"{m['against_median_ms']:.1f} / {m['subject_median_ms']:.1f}" if m else "-",
                     f"{got['predicted_ratio']:.3f}", f"{m['paired_ratio']:.3f} ({m['pairs']} pairs)" if m else "-",
                     f"{100 * got['error']:+.1f}%" if m else "-",
                     f"{got['serial_ratio']:.3f} ({100 * got['serial_error']:+.1f}%)" if m else f"{got['serial_ratio']:.3f}"))
    print(f"{base.name}, host_overlap {base.host_overlap}; the last column composes the same parts serially "
          f"(host_overlap none)")
    print("| link | predicted TPOT eplb ms | locality ms | measured eplb / locality ms (medians) | predicted ratio | "
          "measured paired ratio | error | serial composition's ratio (error) |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="check", required=True)
    k = sub.add_parser("kernels")
    k.add_argument("--roofline", default="results/moe_roofline_NVIDIA_H200.json")
    k.add_argument("--write-profile", action="store_true", help="print the fitted figures as profile JSON")
    k.add_argument("--out")
    r = sub.add_parser("ratio")
    r.add_argument("--work", required=True, help="where the recorded traces and plans go (kept and reused)")
    r.add_argument("--corpus", default=None, help="a `locus train` corpus directory: prompts from its held-out split")
    r.add_argument("--prompt-tokens", type=int, default=32)
    r.add_argument("--planning-requests", type=int, default=48)
    r.add_argument("--streams", type=int, default=16)
    r.add_argument("--output-len", type=int, default=48)
    r.add_argument("--waves", type=int, default=10)
    r.add_argument("--hardware", default="cpu-2core-tbf")
    r.add_argument("--rates", default="2846kbit,948kbit")
    r.add_argument("--measured", default="results/ep_network_mini_formats_8.json,results/ep_network_mini_formats_9.json,"
                                         "results/ep_network_mini_formats_10.json")
    r.add_argument("--out")
    args = p.parse_args(argv)
    out = check_kernels(args) if args.check == "kernels" else check_ratio(args)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
