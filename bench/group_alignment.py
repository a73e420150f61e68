"""Group-limited routing is node-limited routing (issue 57, scope 4): on a recorded trace of the
tiny DeepSeek-V3 (16 experts in 4 groups, top-4 within the 2 best groups), compare EPLB (global and
hierarchical) with the locality plan, without and with `--align-groups`: inter-node bytes, remote nodes
per token, groups split across nodes and the nodes-per-token bound, balance.

Each plan is made on the first half of the trace's requests and replayed on the second (the evaluation
protocol, docs/design.md); the EPLB rows under the balanced assignment, the locality rows under the
plan's grouper as a live server admits (`--assign grouper`). Every figure comes from `locus plan` and
`locus replay --json`, run in this process.

    python bench/group_alignment.py [--corpus DIR] [--trace DIR] [--topologies 2x2:5,4x2:3] [--out FILE.json]

Without an existing --trace, one is recorded first with the offline engine: the prompts of
bench/mini_trace.py (held-out text of mini's four domains, domain-tagged), fed to `tiny-deepseek-v3`
through its byte tokenizer.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

MODEL = "tiny-deepseek-v3"
GROUPS = 4  # the preset's n_group
PLANS = (  # (name, `locus plan` flags, `locus replay` assignment)
    ("eplb (global)", ["--planner", "eplb"], "balanced"),
    ("eplb (hierarchical)", ["--planner", "eplb", "--expert-groups", str(GROUPS)], "balanced"),
    ("locality", ["--planner", "locality"], "grouper"),
    ("locality --align-groups", ["--planner", "locality", "--align-groups"], "grouper"),
)


def record_trace(out: Path, corpus: str | None, per_domain: int, max_tokens: int, seed: int) -> None:
    from locus.engine.checkpoint.loader import shipped_model
    from locus.training.tokenizer import load_trained
    from mini_trace import record
    from serve_lib.domain_text import domain_prompts

    mini = shipped_model("mini")
    if mini is None:
        raise SystemExit("locus/assets/mini is missing (its held-out sample gives the prompts)")
    tok = load_trained(mini / "tokenizer.json")
    prompts = domain_prompts(tok, corpus, mini / "heldout_sample.json", per_domain, 48)
    row = record(MODEL, prompts, out.parent, max_tokens, seed)
    if Path(row["trace"]) != out:
        Path(row["trace"]).rename(out)
    print(f"recorded {row['requests']} requests, {row['tokens']:,} tokens in {row['seconds']} s -> {out}", file=sys.stderr)


def locus(*argv: str) -> str:
    """Run a locus command in this process; its stdout, or SystemExit with its output on failure."""
    from locus.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(list(argv))
    if code != 0:
        raise SystemExit(f"locus {' '.join(argv)} failed ({code}):\n{buf.getvalue()}")
    return buf.getvalue()


def run_case(trace: Path, topology: str, slots: int, cap: str, work: Path) -> list[dict]:
    rows = []
    for name, flags, assign in PLANS:
        tag = f"{topology}_{name.split()[0]}{'_aligned' if '--align-groups' in flags else ''}"
        tag += "_h" if "--expert-groups" in flags else ""
        plan, out = work / f"{tag}.plan.json", work / f"{tag}.replay.json"
        locus("plan", str(trace), "--topology", topology, "--slots", str(slots), "--requests", "0:0.5",
              "--expert-cap", cap, "-o", str(plan), *flags)
        locus("replay", str(trace), "--plan", str(plan), "--requests", "0.5:1.0", "--assign", assign, "--json", str(out))
        r = json.loads(out.read_text())
        counts = r["remote_nodes"]
        reached = sum(i * c for i, c in enumerate(counts)) / max(sum(counts), 1)
        g = r["expert_groups"]
        rows.append({
            "topology": topology, "slots": slots, "plan": name, "assignment": assign, "expert_cap": cap,
            "inter_node_bytes_per_token": r["inter_node_bytes_per_token"], "locality": r["locality"],
            "remote_nodes_mean": reached, "remote_nodes_max": max((i for i, c in enumerate(counts) if c), default=0),
            "remote_nodes": counts, "split_groups": g["split_groups"], "layer_groups": g["layer_groups"],
            "node_bound": g["node_bound"], "aligned_bound": g["aligned_bound"], "rows_over_limit": g["rows_over_limit"],
            "expert_imbalance_mean": r["expert_imbalance_mean"], "expert_imbalance_worst": r["expert_imbalance_worst"],
            "attention_imbalance": r["attention_imbalance"], "tokens": r["tokens"],
        })
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| topology, slots | plan (assignment) | inter-node B/token | vs eplb hier. | remote nodes / token-layer "
             "(mean / max) | groups split | nodes bound | expert imb. mean / worst | attention imb. |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        base = next(x for x in rows if x["topology"] == r["topology"] and x["plan"] == "eplb (hierarchical)")
        delta = r["inter_node_bytes_per_token"] / base["inter_node_bytes_per_token"] - 1
        lines.append(
            f"| {r['topology']}, {r['slots']} | {r['plan']} ({r['assignment']}) | {r['inter_node_bytes_per_token']:,.0f} "
            f"| {delta:+.1%} | {r['remote_nodes_mean']:.3f} / {r['remote_nodes_max']} | {r['split_groups']} of "
            f"{r['layer_groups']} | {r['node_bound']} | {r['expert_imbalance_mean']:.3f} / "
            f"{r['expert_imbalance_worst']:.3f} | {r['attention_imbalance']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", default="results/tmp/dsv3_trace/tiny-deepseek-v3",
                    help="the tiny-deepseek-v3 trace (recorded here first if missing)")
    ap.add_argument("--corpus", help="recording: a `locus train` corpus directory, its held-out documents as prompts "
                    "(default: the few in mini's heldout_sample.json)")
    ap.add_argument("--requests-per-domain", type=int, default=60, help="recording: prompts a domain (default 60)")
    ap.add_argument("--max-tokens", type=int, default=32, help="recording: sampled tokens a request (default 32)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--topologies", default="2x2:5,4x2:3", help="NxG:SLOTS, comma-separated (default 2x2:5,4x2:3)")
    ap.add_argument("--expert-cap", default="auto", help="every plan's --expert-cap (default auto)")
    ap.add_argument("--out", default="results/group_alignment.json")
    ap.add_argument("--work", default="results/tmp/group_alignment", help="where the plans and replay reports go")
    args = ap.parse_args(argv)

    trace = Path(args.trace)
    if not (trace / "meta.json").is_file():
        trace.parent.mkdir(parents=True, exist_ok=True)
        record_trace(trace, args.corpus, args.requests_per_domain, args.max_tokens, args.seed)
    work = Path(args.work)  # the plans and replay reports behind the rows
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    for case in args.topologies.split(","):
        topology, _, slots = case.partition(":")
        rows += run_case(trace, topology, int(slots), args.expert_cap, work)
    print(table(rows))
    doc = {"trace": str(trace), "model": MODEL, "command": "python bench/group_alignment.py " + " ".join(argv or sys.argv[1:]),
           "plan_requests": "0:0.5", "replay_requests": "0.5:1.0", "rows": rows}
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
