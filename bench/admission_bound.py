"""How much expert balance can a live admission buy by its choice of rank within a node? (issue 54, item 3)

A trace a live expert-parallel server recorded (`bench/ep.py --keep`: WORK/locality-trace) keeps each
request's node. This re-picks the rank of every request within its node, in the order the server admitted
them, by what the admission would know of the request's routing, and gives the whole-run expert imbalance
(mean over layers / worst layer) and attention imbalance of each choice, beside the served ranks and EPLB's
plan with balanced assignment over the same requests (the issue's reference):

  as served          the recorded ranks
  whole routing      each request's own loads per rank, prompt and decode rows: an oracle, no server has
                     them when it admits a request
  prompt routing     its prompt rows' loads, scaled to its length: what a server knows after the prefill,
                     at the earliest
  predicted routing  the plan's prompt predictor's signature of its prompt, spread over the replicas of
                     each expert's dispatch tier evenly, scaled to its length: what a server can know when
                     it admits the request (plans with a predictor, traces with token ids)
  realised so far    nothing of the request: the rank whose experts the requests admitted before it
                     loaded least (feedback)
  predicted, booked  the predicted routing, and of the requests before it only their predicted loads
                     (what a grouper that is told no realised loads can book)

Except the last, every choice also sees the loads the requests admitted before it realised (fed back from
the ranks). The choice: the rank whose resulting expert imbalance (mean over layers, the known loads added) is lowest;
`realised so far`: the rank with the lowest busiest-layer load over the layer's mean. Under `--guard G`
a rank is passed over when its admitted tokens would exceed G x their mean plus the request (none fits:
the rank with the fewest); `none`: no guard. Ties go to the fewer tokens admitted, then the lower rank.

    python bench/admission_bound.py --trace WORK/locality-trace --plan WORK/locality.json \\
        --reference WORK/eplb.json --out results/admission_bound.json
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from locus.errors import LocusError  # noqa: E402
from locus.routing.dispatch_rule import build_dispatch_table  # noqa: E402
from locus.routing.plan.grouping_spec import spec_of  # noqa: E402
from locus.routing.plan.placement import load_plan  # noqa: E402
from locus.routing.replay.assignment import Assignment, assign_balanced, assign_recorded  # noqa: E402
from locus.routing.replay.load_bootstrap import expert_imbalance, request_rank_loads  # noqa: E402
from locus.routing.replay.simulator import plan_in_trace_order  # noqa: E402
from locus.traces.metrics import max_over_mean  # noqa: E402
from locus.traces.format import TraceFormatError  # noqa: E402
from locus.traces.reader import TraceReader  # noqa: E402

GUARDS = ("none", "1.03", "1.02")
KNOWLEDGE = ("whole routing", "prompt routing", "predicted routing", "realised so far", "predicted, booked")


@dataclass
class Row:
    choice: str
    guard: str
    expert_imbalance_mean: float
    expert_imbalance_worst: float
    attention_imbalance: float


def imbalances(loads: np.ndarray, ranks: np.ndarray, tokens: np.ndarray, R: int) -> tuple[float, float, float]:
    """(expert mean over layers, worst layer, attention) of the whole run; loads [Q, R', L, R] per candidate
    rank (or [Q, L, R] as placed)."""
    placed = loads[np.arange(len(ranks)), ranks] if loads.ndim == 4 else loads
    total = placed.sum(0).astype(np.float64)  # [L, R]
    attention = float(max_over_mean(np.bincount(ranks, weights=tokens, minlength=R)))
    return expert_imbalance(total), float(np.nanmax(max_over_mean(total, np.nan))), attention


def repick(nodes: np.ndarray, order: np.ndarray, tokens: np.ndarray, whole: np.ndarray, known: np.ndarray | None,
           guard: float | None, G: int, booked: np.ndarray | None = None) -> np.ndarray:
    """Each request's rank within its node (module docstring): whole [Q, R, L, R] its loads on each
    candidate rank; known: what the choice sees of them (None: nothing, feedback); booked: what is added
    up of the requests already placed (None: their realised loads, `whole`)."""
    booked = whole if booked is None else booked
    Q, R = whole.shape[0], whole.shape[1]
    acc = np.zeros(whole.shape[2:], dtype=np.float64)  # [L, R] loads placed so far
    admitted = np.zeros(R)
    ranks = np.empty(Q, dtype=np.int64)
    for i in order:
        candidates = list(range(nodes[i] * G, (nodes[i] + 1) * G))
        if guard is not None:
            limit = guard * (admitted.sum() + tokens[i]) / R + tokens[i]
            fits = [r for r in candidates if admitted[r] + tokens[i] <= limit]
            candidates = fits or [min(candidates, key=lambda r: (admitted[r], r))]

        def score(r: int) -> float:
            if known is None:
                mean = np.maximum(acc.mean(1), 1.0)
                return float((acc[:, r] / mean).max())
            return expert_imbalance(acc + known[i, r])

        rank = min(candidates, key=lambda r: (score(r), admitted[r], r))
        ranks[i] = rank
        acc += booked[i, rank]
        admitted[rank] += tokens[i]
    return ranks


def predicted_loads(reader, plan, tokens: np.ndarray, prompts: np.ndarray) -> np.ndarray | None:
    """[Q, R, L, R]: each request's expected loads on every candidate rank from its prompt's predicted
    signature (None: the plan has no predictor or the trace no token ids)."""
    predictor = spec_of(plan).predictor
    if predictor is None or reader.token_ids is None:
        return None
    table = build_dispatch_table(plan_in_trace_order(plan, reader.meta.moe_layers))
    L, R, E = len(reader.meta.moe_layers), table.num_ranks, table.num_experts
    start = table.start.reshape(L, R, E + 1)[..., 1:]
    count = table.count.reshape(L, R, E + 1)[..., 1:]
    spread = np.zeros((L, R, E, R))  # [layer, source rank, expert, destination]: the tier's replicas evenly
    for layer, src, e in np.ndindex(L, R, E):
        first, n = start[layer, src, e], count[layer, src, e]
        np.add.at(spread[layer, src, e], table.replica_ranks[first : first + n].astype(np.int64), 1.0 / n)
    offsets = np.asarray(reader.offsets)
    signature = predictor.signatures([np.asarray(reader.token_ids[offsets[i] : offsets[i] + prompts[i]])
                                      for i in range(len(prompts))])  # [Q, L, E] predicted prefill pairs
    per_token = signature / np.maximum(prompts, 1)[:, None, None]
    return np.einsum("qle,lsed->qsld", per_token, spread) * tokens[:, None, None, None]


def run(trace: str, plan_path: str, reference_path: str, guards=GUARDS) -> list[Row]:
    reader = TraceReader(trace)
    plan, reference = load_plan(plan_path), load_plan(reference_path)
    topology = plan.topology
    R, G, Q = topology.ranks, topology.gpus_per_node, len(reader.requests)
    served = assign_recorded(reader.requests, R, 0, reader.meta.kv_bytes_per_token, G)
    if served.splits:
        raise LocusError(f"{trace}: requests moved after their prefill (--ep-moves); the bound re-picks one rank a request")
    admitted = [r.admitted for r in reader.requests]
    if any(a is None for a in admitted):
        raise LocusError(f"{trace}: the requests carry no admission order (record it with an expert-parallel server)")
    tokens = np.array([r.tokens for r in reader.requests], dtype=np.float64)
    prompts = np.array([r.prompt_tokens for r in reader.requests], dtype=np.int64)
    everyone = [Assignment("on", 0, np.full(Q, r)) for r in range(R)]
    whole = np.stack([request_rank_loads(reader, plan, a) for a in everyone], axis=1)  # [Q, R, L, R]
    prompt = np.stack([request_rank_loads(reader, plan, a, first_rows=prompts) for a in everyone], axis=1)
    scale = (tokens / np.maximum(prompts, 1))[:, None, None, None]
    order = np.argsort(np.asarray(admitted), kind="stable")
    nodes = served.ranks // G

    balanced = assign_balanced(tokens.astype(np.int64), R)
    rows = [Row("eplb, balanced (reference)", "-", *imbalances(request_rank_loads(reader, reference, balanced),
                                                               balanced.ranks, tokens, R)),
            Row("as served", "-", *imbalances(whole, served.ranks, tokens, R))]
    predicted = predicted_loads(reader, plan, tokens, prompts)
    for guard in guards:
        g = None if guard == "none" else float(guard)
        for choice, known in zip(KNOWLEDGE, (whole, prompt * scale, predicted, None, predicted)):
            if choice.startswith("predicted") and known is None:
                continue  # no predictor in the plan, or no token ids in the trace
            booked = predicted if choice == "predicted, booked" else None
            ranks = repick(nodes, order, tokens, whole, known, g, G, booked)
            rows.append(Row(choice, guard, *imbalances(whole, ranks, tokens, R)))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trace", required=True, help="a trace a live expert-parallel server recorded")
    p.add_argument("--plan", required=True, help="the plan it served (with its grouping)")
    p.add_argument("--reference", required=True, help="EPLB's plan for the same cluster (the reference)")
    p.add_argument("--guard", action="append", metavar="none|G",
                   help=f"attention guards to try (repeatable; default {', '.join(GUARDS)})")
    p.add_argument("--out", help="write the rows as JSON")
    args = p.parse_args(argv)
    guards = tuple(args.guard or GUARDS)
    for g in guards:
        if g != "none":
            try:
                if float(g) < 1.0:
                    raise ValueError
            except ValueError:
                p.error(f"--guard must be none or a number >= 1.0, not {g!r}")
    try:
        rows = run(args.trace, args.plan, args.reference, guards)
    except (LocusError, TraceFormatError, OSError) as e:  # a bad trace or plan: named, no traceback
        p.error(str(e))
    print("| rank within the node chosen by | attention guard | expert imb. mean / worst | attention imb. |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {r.choice} | {r.guard} | {r.expert_imbalance_mean:.4f} / {r.expert_imbalance_worst:.4f} | "
              f"{r.attention_imbalance:.4f} |")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"benchmark": "admission_bound", "trace": args.trace, "plan": args.plan,
                                              "rows": [asdict(r) for r in rows]}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
