"""Expert-parallel serving under three placement plans: measured traffic, the replay's, throughput and
where the step time goes.

For each plan (round_robin, eplb, locality; `locality_placement` is the locality plan without its
grouping, the placement alone under balanced assignment) this starts `locus serve --model M --ep-ranks 4
--gpus-per-node 2 --plan P --record-trace T` (2 virtual nodes of 2 ranks, one torch thread per rank),
sends the same fixed mixed-domain workload (three task families whose prompts use disjoint
alphabets, tagged with the `x-locus-domain` header), reads `GET /ep/stats`, stops the server, and
replays the trace it recorded with `locus replay T --plan P --assign recorded`. The plans are made
from a planning trace recorded on the same model first (single process, other prompts of the same
families), all with the same number of expert slots per rank; `--expert-cap` is passed to every
`locus plan` (e.g. `eplb`, the balance-first cap for plans a live server admits by; default: none
passed, the planner's own default). `--untagged` sends no domain header
(as the `openai` client or any application does): a locality plan's grouper then places requests by
its prompt predictor.

For a plan with a grouping, the grouper's own replay is printed too: `locus replay T --plan P
--assign grouper` simulates the server's admissions (the grouper run through the admissions and
releases the server logged in the trace: equal to the measured bytes when the replay models the live
admission exactly) and `--arrivals closed --concurrency C` (the same grouper fed by a modelled
closed-loop client instead of the logged order: how far the model of arrivals is from the run).
With `eplb` among the plans, each grouper row also gets the issue's balance reference on its own served
requests (`eplb_balanced`: `locus replay T --plan EPLB --assign balanced`, EPLB's plan with each request
on the rank with the fewest tokens, knowing every request's length): the EPLB server's own figures
depend on when its requests finished, and move between runs of the same command by as much as the
margins the targets ask about (docs/planner.md, "Live admission and balance").

Printed per plan: inter-/intra-node bytes per token as measured by the ranks and as replayed (they
must be equal, to the byte), the attention and expert imbalance of the recorded assignment (the replay's
whole-run max/mean over ranks; expert: mean over layers / worst layer), output tokens per second over the workload, and the mean step time of
the ranks split into compute, exchange (MoE all-to-all, less the expert compute) and control (gloo
control collectives). On 2 shared cores the throughput and times are indicative only; the bytes are
exact.

    python bench/ep.py --out results/ep.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from serve_lib.common import BenchError
from serve_lib.domain_text import DomainText

from locus.errors import LocusError
from locus.routing.plan.placement import load_plan
from locus.routing.planners.layer_caps import parse_expert_cap_mode
from locus.routing.replay.assignment import assign_balanced, assign_recorded
from locus.routing.replay.load_bootstrap import paired_bootstrap, request_rank_loads
from locus.traces.reader import TraceReader
from locus.traces.prompt_families import FAMILIES, family_prompt
from serve_lib.table import print_table as markdown_table
from serve_lib.server import free_port, start_server, stop_server, wait_until_ready

PROG = "bench/ep.py"
PLANS = ("round_robin", "eplb", "locality", "locality_placement")
IMBALANCES = ("attention_imbalance", "expert_imbalance_mean", "expert_imbalance_worst")  # of the recorded assignment



def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small", help="preset or checkpoint directory (default: small)")
    p.add_argument("--topology", default="2x2", help="NODESxGPUS of the launch (default: 2x2)")
    p.add_argument("--slots", type=int, default=6, help="expert slots per rank, every plan (default: 6)")
    p.add_argument("--plans", default=",".join(PLANS[:3]),
                   help="comma-separated subset of round_robin,eplb,locality,locality_placement (the locality plan "
                   "without its grouping: placement alone, balanced assignment); default the first three")
    p.add_argument("--requests", type=int, default=48, help="requests in the measured workload (default: 48)")
    p.add_argument("--planning-requests", type=int, default=48, help="requests in the planning trace (default: 48)")
    p.add_argument("--output-len", type=int, default=32, help="tokens generated per request (default: 32)")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight (default: 16)")
    p.add_argument("--ep-timeout", type=float, default=120.0)
    p.add_argument("--expert-cap", metavar="CAP|auto[:FLOOR]|eplb[:SHARE]",
                   help="`locus plan --expert-cap` for every plan (default: not passed, the planner's default)")
    p.add_argument("--untagged", action="store_true", help="send no x-locus-domain header (tags withheld)")
    p.add_argument("--dispatch-format", default="model", choices=("model", "mxfp8", "mxint8"),
                   help="the servers' --ep-dispatch-format, replayed with the same (default: model)")
    p.add_argument("--combine-format", default="model", choices=("model", "mxfp8", "mxint8"),
                   help="the servers' --ep-combine-format, replayed with the same (default: model)")
    p.add_argument("--extra-serve-args", default="", help="more `locus serve` flags, as one string (e.g. '--ep-loop-nice 0')")
    p.add_argument("--out", help="write the results as JSON")
    p.add_argument("--keep", action="store_true", help="keep the work directory (traces, plans, server logs)")
    add_prompt_args(p)
    return p.parse_args(argv)


def add_prompt_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompts", default="auto", choices=("auto", "families", "text"),
                   help="families: synthetic prompt families (what a random preset routes by); text: held-out text "
                        "of a trained model's domains (heldout_sample.json, or --corpus); auto (default): text when "
                        "the model ships held-out text (mini), else families")
    p.add_argument("--corpus", default=None, help="a `locus train` corpus directory: text prompts from its held-out split")
    p.add_argument("--prompt-tokens", type=int, default=32, help="text prompts: tokens a prompt (default: 32)")


def prompt_source(args: argparse.Namespace) -> DomainText | None:
    """The text prompts the bench sends, or None for the synthetic families."""
    from locus.engine.checkpoint.loader import shipped_model

    model_dir = shipped_model(args.model) or Path(args.model)
    has_text = (model_dir / "heldout_sample.json").is_file() or args.corpus is not None
    if args.prompts == "families" or (args.prompts == "auto" and not has_text):
        return None
    try:
        return DomainText.load(model_dir, args.corpus, args.prompt_tokens)
    except BenchError as exc:
        raise SystemExit(f"{PROG}: {exc}") from None


def workload(count: int, offset: int, families: tuple[str, ...] = tuple(FAMILIES),
             text: DomainText | None = None) -> list[tuple[str, str]]:
    """(domain, prompt) of each request, in sending order, the families (or text domains) taken in turn."""
    if text is not None:
        return text.take(count, offset)
    return [(families[i % len(families)], family_prompt(families[i % len(families)], offset + i)) for i in range(count)]


def record_planning_trace(model: str, path: Path, requests: int, output_len: int,
                          families: tuple[str, ...] = tuple(FAMILIES), text: DomainText | None = None) -> None:
    """One process, no expert parallelism: the routing the planners plan from."""
    from locus.engine.frontend.build import build_engine
    from locus.engine.sampling.sampler import SamplingParams

    built = build_engine(model, moe_backend="torch", record_trace=str(path), model_name=Path(model).name)
    core, loaded = built.core, built.loaded
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    items = text.take(requests, 0, planning=True) if text is not None else workload(requests, 10_000, families)
    for i, (family, prompt) in enumerate(items):
        core.add_request(f"plan-{i}", loaded.tokenizer.encode(prompt), params, family)
    while core.has_unfinished():
        core.step()
    core.dump_recording()


def plan_command(args: argparse.Namespace, name: str, planning: Path, plan: Path) -> list[str]:
    """The `locus plan` arguments that make plan `name` from the planning trace."""
    planner = "locality" if name == "locality_placement" else name
    cap = ("--expert-cap", args.expert_cap) if args.expert_cap is not None else ()
    return ["plan", str(planning), "--topology", args.topology, "--slots", str(args.slots), "--planner", planner,
            *cap, "-o", str(plan)]


def check_args(args: argparse.Namespace) -> list[str]:
    """The plans to run, once every flag is known good: a bad plan name or expert cap stops the bench
    before the planning trace is recorded, not after."""
    plans = [p.strip() for p in args.plans.split(",") if p.strip()]
    if bad := [p for p in plans if p not in PLANS]:
        raise SystemExit(f"{PROG}: unknown plan(s) {bad}; choose from {', '.join(PLANS)}")
    if args.expert_cap is not None:
        try:
            parse_expert_cap_mode(args.expert_cap)
        except LocusError as exc:
            raise SystemExit(f"{PROG}: {exc}") from None
    return plans


def locus(*args: str, timeout: float = 600) -> str:
    done = subprocess.run([sys.executable, "-m", "locus.cli", *args], capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise SystemExit(f"{PROG}: locus {' '.join(args)} failed:\n{done.stderr}")
    return done.stdout


def serve_and_measure(args: argparse.Namespace, plan: Path, trace: Path, log: Path, text: DomainText | None) -> dict:
    nodes, gpus = (int(x) for x in args.topology.lower().split("x"))
    port = free_port()
    cmd = [sys.executable, "-m", "locus.cli", "serve", "--model", args.model, "--ep-ranks", str(nodes * gpus),
           "--gpus-per-node", str(gpus), "--plan", str(plan), "--record-trace", str(trace), "--moe-backend", "torch",
           "--ep-timeout", str(args.ep_timeout), "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
           "--ep-dispatch-format", args.dispatch_format, "--ep-combine-format", args.combine_format,
           *shlex.split(args.extra_serve_args)]
    base = f"http://127.0.0.1:{port}"
    server = start_server(cmd, threads=1, log_path=str(log))  # one torch thread per rank
    try:
        with httpx.Client(timeout=10.0, trust_env=False) as client:
            wait_until_ready(client, base, 300.0, server.proc, str(log))
        model = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]

        def send(item: tuple[str, str]) -> int:
            family, prompt = item
            body = {"model": model, "prompt": prompt, "max_tokens": args.output_len, "temperature": 0,
                    "ignore_eos": True}
            headers = {} if args.untagged else {"x-locus-domain": family}
            r = httpx.post(f"{base}/v1/completions", json=body, headers=headers, timeout=600)
            r.raise_for_status()
            return r.json()["usage"]["completion_tokens"]

        send(workload(1, offset=20_000, text=text)[0])  # warm-up: first-call costs stay out of the timed window
        before = httpx.get(f"{base}/ep/stats").json()
        start = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            out_tokens = sum(pool.map(send, workload(args.requests, offset=0, text=text)))
        seconds = time.perf_counter() - start
        stats = httpx.get(f"{base}/ep/stats").json()
    except BenchError as exc:
        raise SystemExit(f"{PROG}: {exc}") from None
    finally:
        stop_server(server, grace=120.0)  # SIGTERM: the server drains, merges the trace, exits
    if server.proc.returncode != 0:
        raise SystemExit(f"{PROG}: the server exited with {server.proc.returncode}; see {log}")
    return {"stats": stats, "before": before, "out_tokens": out_tokens, "seconds": seconds}


def step_split(stats: dict, before: dict) -> dict:
    """Mean over ranks of the workload's steps: ms per step, and the share of each part."""
    rows = []
    for now, then in zip(stats["per_rank"], before["per_rank"]):
        steps = now["steps"] - then["steps"]
        if steps:
            rows.append({k: (now[k] - then[k]) / steps for k in ("step_s", "compute_s", "exchange_s", "control_s")})
    mean = {k: sum(r[k] for r in rows) / len(rows) for k in rows[0]} if rows else {}
    return {"step_ms": 1e3 * mean.get("step_s", 0.0),
            **{part: mean.get(f"{part}_s", 0.0) / max(mean.get("step_s", 0.0), 1e-12) for part in ("compute", "exchange", "control")}}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plans = check_args(args)
    text = prompt_source(args)
    work = Path(tempfile.mkdtemp(prefix="locus-bench-ep-"))
    prompts = text.source if text is not None else f"{len(FAMILIES)} families"
    cap = f", expert cap {args.expert_cap}" if args.expert_cap is not None else ""
    print(f"{PROG}: model {args.model}, {args.topology} ranks, {args.slots} slots per rank{cap}; workload: {args.requests} "
          f"requests x {args.output_len} tokens, {prompts}, concurrency {args.concurrency}; work dir {work}",
          flush=True)
    planning = work / "planning-trace"
    record_planning_trace(args.model, planning, args.planning_requests, args.output_len, text=text)
    results = []
    for name in plans:
        plan = work / f"{name}.json"
        locus(*plan_command(args, name, planning, plan))
        if name == "locality_placement":  # the same placement, no grouping: the server assigns balanced
            doc = json.loads(plan.read_text())
            doc.pop("grouping", None)
            plan.write_text(json.dumps(doc, indent=1) + "\n")
        trace = work / f"{name}-trace"
        run = serve_and_measure(args, plan, trace, work / f"{name}-server.log", text)
        locus("replay", str(trace), "--plan", str(plan), "--assign", "recorded", "--json", str(work / f"{name}-replay.json"),
              "--dispatch-format", args.dispatch_format, "--combine-format", args.combine_format)
        replayed = json.loads((work / f"{name}-replay.json").read_text())
        stats = run["stats"]
        tokens = stats["tokens"]
        row = {
            "plan": name, "assignment": stats["assignment"], "untagged": args.untagged, "tokens": tokens,
            "measured": {"inter_node_bytes": stats["inter_node_bytes"], "intra_node_bytes": stats["intra_node_bytes"]},
            "replayed": {"inter_node_bytes": replayed["inter_node_bytes"], "intra_node_bytes": replayed["intra_node_bytes"],
                         "tokens": replayed["tokens"]},
            "inter_per_token": stats["inter_node_bytes"] / max(tokens, 1),
            "intra_per_token": stats["intra_node_bytes"] / max(tokens, 1),
            "replay_inter_per_token": replayed["inter_node_bytes"] / max(replayed["tokens"], 1),
            "replay_intra_per_token": replayed["intra_node_bytes"] / max(replayed["tokens"], 1),
            **{k: replayed[k] for k in IMBALANCES},
            "out_tokens": run["out_tokens"], "seconds": run["seconds"], "out_tok_s": run["out_tokens"] / run["seconds"],
            **step_split(stats, run["before"]),
        }
        row["equal"] = (row["measured"]["inter_node_bytes"] == row["replayed"]["inter_node_bytes"]
                        and row["measured"]["intra_node_bytes"] == row["replayed"]["intra_node_bytes"]
                        and tokens == replayed["tokens"])
        if stats["assignment"] == "grouper":  # the grouper simulated: through the logged arrivals, and a modelled client
            for key, extra in (("grouper_replay", ()), ("grouper_model", ("--arrivals", "closed", "--concurrency",
                                                                           str(args.concurrency)))):
                out = work / f"{name}-{key}.json"
                locus("replay", str(trace), "--plan", str(plan), "--assign", "grouper", *extra, "--json", str(out))
                sim = json.loads(out.read_text())
                row[key] = {"inter_node_bytes": sim["inter_node_bytes"], "intra_node_bytes": sim["intra_node_bytes"],
                            "inter_vs_measured": sim["inter_node_bytes"] / max(stats["inter_node_bytes"], 1) - 1}
        results.append(row)
        print(f"{name}: done ({run['seconds']:.1f} s)", flush=True)
    if "eplb" in plans:
        for row in results:
            if row["assignment"] == "grouper":
                row["eplb_balanced"] = eplb_reference(work, row["plan"], args)
                ref = row["eplb_balanced"]
                d = ref["expert_difference"]
                print(f"{row['plan']}'s served requests under EPLB, balanced: {ref['inter_per_token']:.1f} B/token, "
                      f"attention {ref['attention_imbalance']:.3f}, expert {ref['expert_imbalance_mean']:.3f} / "
                      f"{ref['expert_imbalance_worst']:.3f}; {row['plan']}'s expert mean minus it {d['point']:+.4f} "
                      f"(95 % over resampled served requests {d['ci95'][0]:+.4f} .. {d['ci95'][1]:+.4f})", flush=True)
    print_table(results)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"bench": "ep", "args": vars(args), "machine": {"cpus": os.cpu_count(),
                                   "python": platform.python_version()}, "results": results}, indent=1) + "\n")
        print(f"wrote {out}")
    ok = all(r["equal"] for r in results)
    if ok and not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"kept {work}")
    return 0 if ok else 1


def eplb_reference(work: Path, name: str, args: argparse.Namespace) -> dict:
    """EPLB's plan over plan `name`'s served requests with balanced assignment: the balance reference, and
    the served run's expert imbalance minus it with its spread over resamples of the served requests
    (`expert_difference`: how far that difference would move on another served set of this size)."""
    out = work / f"{name}-eplb-balanced.json"
    trace, eplb_plan = work / f"{name}-trace", work / "eplb.json"
    locus("replay", str(trace), "--plan", str(eplb_plan), "--assign", "balanced",
          "--dispatch-format", args.dispatch_format, "--combine-format", args.combine_format, "--json", str(out))
    ref = json.loads(out.read_text())
    reader = TraceReader(trace)
    served_plan, reference_plan = load_plan(work / f"{name}.json"), load_plan(eplb_plan)
    topology = served_plan.topology
    served = assign_recorded(reader.requests, topology.ranks, 0, reader.meta.kv_bytes_per_token, topology.gpus_per_node)
    balanced = assign_balanced([r.tokens for r in reader.requests], topology.ranks)
    difference = paired_bootstrap(request_rank_loads(reader, served_plan, served),
                                  request_rank_loads(reader, reference_plan, balanced))
    return {"inter_per_token": ref["inter_node_bytes"] / max(ref["tokens"], 1), **{k: ref[k] for k in IMBALANCES},
            "expert_difference": difference.as_dict()}


def print_table(results: list[dict]) -> None:
    head = ("plan", "assign", "inter B/tok", "replay", "intra B/tok", "replay", "equal", "attn imb.",
            "expert imb. mean / worst", "grouper replay (model)", "out tok/s", "step ms", "compute", "exchange", "control")

    def simulated(r: dict) -> str:
        if "grouper_replay" not in r:
            return ""
        return (f"{r['grouper_replay']['inter_vs_measured']:+.1%} ({r['grouper_model']['inter_vs_measured']:+.1%})")

    rows = [(r["plan"], r["assignment"] + (", untagged" if r.get("untagged") else ""), f"{r['inter_per_token']:.1f}",
             f"{r['replay_inter_per_token']:.1f}", f"{r['intra_per_token']:.1f}", f"{r['replay_intra_per_token']:.1f}",
             "yes" if r["equal"] else "NO", f"{r['attention_imbalance']:.3f}",
             f"{r['expert_imbalance_mean']:.3f} / {r['expert_imbalance_worst']:.3f}", simulated(r), f"{r['out_tok_s']:.1f}", f"{r['step_ms']:.1f}",
             f"{r['compute']:.0%}", f"{r['exchange']:.0%}", f"{r['control']:.0%}") for r in results]
    markdown_table(head, rows)


if __name__ == "__main__":
    sys.exit(main())
