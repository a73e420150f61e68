"""Where a locality plan's inter-node token-layers come from, on a trace an expert-parallel server
recorded with it, and what the best placement and the best domain layout would have sent in hindsight
(docs/planner.md, "Where the locality plan's inter-node bytes come from").

For top-1 routing on two nodes (`mini` 2x2): a token-layer crosses exactly when its node holds no
replica of its expert, so the counts here equal `locus replay --assign recorded` (checked). Causes:
requests the grouper admitted off their domain's nodes (what they would cost on them); the placement
(the best one for the trace's own routing and assignment under the expert-load cap, on the trace's own
loads, by exhaustive search over every placement with distinct experts a GPU); the grouping (the best
placement for the plan's domain layout with every request on its domain's nodes, and, with --layouts,
over every layout with one domain split, token-balanced within the attention cap).

    python bench/locality_bound.py --trace TRACE --plan PLAN.json [--cap 1.10] [--layouts] [--out OUT.json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import numpy as np

from locus.routing.plan.placement import load_plan
from locus.traces.reader import TraceReader

PROG = "bench/locality_bound.py"


def rank_loads(h: np.ndarray, D: np.ndarray, G: int) -> np.ndarray:
    """Expected pairs per rank under the dispatch rule, top-1: h [R, E] copies, D [R, E] pairs by home rank."""
    R, E = h.shape
    load = np.zeros(R)
    for r in range(R):
        n = slice(r // G * G, r // G * G + G)
        for e in np.flatnonzero(D[r]):
            if h[r, e]:
                load[r] += D[r, e]
            elif h[n, e].sum():
                load[n] += D[r, e] * h[n, e] / h[n, e].sum()
            else:
                load += D[r, e] * h[:, e] / h[:, e].sum()
    return load


def best_placement(D: np.ndarray, G: int, S: int, cap: float) -> tuple[float, float]:
    """(crossing pairs, imbalance) of the best two-node placement of D [R, E] under max/mean <= cap."""
    R, E = D.shape
    subsets = np.array([np.isin(np.arange(E), c) for c in itertools.combinations(range(E), S)], dtype=int)
    pairs = [(a, b) for a in range(len(subsets)) for b in range(a, len(subsets))]  # a node's two GPUs
    held = np.array([subsets[a] + subsets[b] for a, b in pairs]) > 0  # [P, E]
    Dn = [D[:G].sum(0), D[G:].sum(0)]
    cross = [(Dn[n][None, :] * ~held).sum(1) for n in range(2)]
    best = (np.inf, np.nan)
    for i in np.argsort(cross[0], kind="stable"):
        if cross[0][i] >= best[0]:
            break
        total = np.where((held[i][None, :] | held).all(1), cross[0][i] + cross[1], np.inf)
        for j in np.argsort(total, kind="stable"):
            if total[j] >= best[0]:
                break
            for g0 in (pairs[i], pairs[i][::-1]):
                for g1 in (pairs[j], pairs[j][::-1]):
                    h = subsets[[*g0, *g1]]
                    imb = rank_loads(h, D, G).max() / (D.sum() / R)
                    if imb <= cap + 1e-12:
                        best = (float(total[j]), float(imb))
                        break
                if best[0] == total[j]:
                    break
    return best


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", required=True, help="a trace an expert-parallel server recorded with the plan")
    p.add_argument("--plan", required=True)
    p.add_argument("--cap", type=float, default=1.10, help="expert-load cap (max/mean rank load per layer)")
    p.add_argument("--attention-cap", type=float, default=1.10)
    p.add_argument("--layouts", action="store_true", help="also every layout with one domain split (slow)")
    p.add_argument("--out")
    args = p.parse_args(argv)
    reader, plan = TraceReader(args.trace), load_plan(args.plan)
    topo, meta = plan.topology, reader.meta
    G, S, R = topo.gpus_per_node, topo.slots_per_gpu, topo.ranks
    if topo.nodes != 2 or meta.top_k != 1 or plan.grouping is None:
        raise SystemExit(f"{PROG}: needs a locality plan on two nodes and a top-1 trace")
    reqs, off = reader.requests, reader.offsets
    if any(q.rank is None for q in reqs):
        raise SystemExit(f"{PROG}: {args.trace}: requests carry no rank (record it with an expert-parallel server)")
    ids = np.asarray(reader.expert_ids[:, :, 0], dtype=np.int64)  # [T, L]
    T, L, E = len(ids), ids.shape[1], meta.num_experts
    per_send = 2 * meta.hidden_size * meta.dtype_bytes
    home = np.repeat([q.rank for q in reqs], [q.tokens for q in reqs])
    weights = plan.grouping["domain_nodes"]
    held = np.zeros((L, R, E), dtype=int)
    for l in range(L):
        for r in range(R):
            np.add.at(held[l, r], plan.slots[l][r], 1)
    node_holds = np.stack([held[:, :G].sum(1), held[:, G:].sum(1)], 1) > 0  # [L, N, E]
    out = {"tokens": T}
    crossing = sum(int((~node_holds[l][home // G, ids[:, l]]).sum()) for l in range(L))
    out["plan"] = crossing * per_send / T
    # requests admitted off their domain's nodes, and what they would cross on them
    own = crossing
    off_nodes = off_tokens = 0
    for i, q in enumerate(reqs):
        w = np.asarray(weights.get(q.domain, [1.0, 1.0]))
        if w[q.rank // G] == 0:
            off_nodes, off_tokens = off_nodes + 1, off_tokens + q.tokens
            e = ids[off[i]:off[i + 1]]
            there = int(np.argmax(w))
            own += sum(int((~node_holds[l][there, e[:, l]]).sum()) - int((~node_holds[l][q.rank // G, e[:, l]]).sum())
                       for l in range(L))
    out["off_domain_requests"], out["off_domain_tokens"] = off_nodes, off_tokens
    out["on_domain_nodes"] = own * per_send / T
    # the best placement for this routing and assignment
    demand = np.zeros((L, R, E))
    for l in range(L):
        np.add.at(demand[l], (home, ids[:, l]), 1)
    placed = [best_placement(demand[l], G, S, args.cap) for l in range(L)]
    out["best_placement"] = sum(c for c, _ in placed) * per_send / T
    out["best_placement_imbalance"] = [i for _, i in placed]
    # the grouping: domain profiles, the plan's layout and (optionally) every one-split layout
    doms = sorted({q.domain for q in reqs})
    prof = np.zeros((len(doms), L, E))
    tok = np.zeros(len(doms))
    for i, q in enumerate(reqs):
        d = doms.index(q.domain)
        tok[d] += q.tokens
        for l in range(L):
            np.add.at(prof[d, l], ids[off[i]:off[i + 1], l], 1)

    def layout_bound(share0: np.ndarray) -> float:  # share0 [D]: each domain's share on node 0
        total = 0.0
        for l in range(L):
            n0, n1 = share0 @ prof[:, l], (1 - share0) @ prof[:, l]
            D = np.array([*[n0 / G] * G, *[n1 / G] * G])
            total += best_placement(D, G, S, args.cap)[0]
        return total * per_send / T

    share = np.array([(lambda w: w[0] / sum(w))(weights.get(d, [0.5, 0.5])) for d in doms])
    out["plan_layout"] = {d: float(x) for d, x in zip(doms, share)}
    out["plan_layout_bound"] = layout_bound(share)
    if args.layouts:
        best = None
        for split in range(len(doms)):
            others = [d for d in range(len(doms)) if d != split]
            for bits in itertools.product((0, 1), repeat=len(others)):
                s0 = np.zeros(len(doms))
                s0[[o for o, b in zip(others, bits) if b == 0]] = 1
                s0[split] = (T / 2 - tok @ s0) / tok[split]
                if not 0 <= s0[split] <= 1:
                    continue
                b = layout_bound(s0)
                if best is None or b < best[0]:
                    best = (b, {d: float(x) for d, x in zip(doms, s0)})
        out["best_layout_bound"], out["best_layout"] = best
    for key, value in out.items():
        print(f"{key:28s} {value}")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
