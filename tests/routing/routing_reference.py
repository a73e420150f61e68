"""Brute-force, one-token-at-a-time references for the dispatch rule and the replay metrics.

Written straight from the wording of docs/design.md ("Topology, placement plan, dispatch rule", "Metrics"), with plain Python loops and sets, so the vectorised code
is checked against something that shares none of its tricks (no tables, no bitmasks).
"""

from __future__ import annotations

import math


def reference_destination(layer_slots, gpus_per_node: int, src: int, expert: int, position: int) -> int:
    """layer_slots[rank] = expert ids held by that rank (one layer)."""
    replicas = sorted(rank for rank, held in enumerate(layer_slots) for e in held if e == expert)
    node = src // gpus_per_node
    tiers = (
        [r for r in replicas if r == src],
        [r for r in replicas if r // gpus_per_node == node],
        [r for r in replicas if r // gpus_per_node != node],
    )
    for tier in tiers:
        if tier:
            return tier[position % len(tier)]
    raise AssertionError(f"expert {expert} has no replica")


def reference_node_aware(layer_slots, gpus_per_node: int, src: int, experts, position: int) -> list[int]:
    """The node-aware rule for one token's experts (one layer), straight from docs/replay.md's wording:
    own rank, else own node as under `position`; remote experts: forced nodes, then greedy cover while
    a node serves two uncovered experts; the rest by `position` over all their replicas."""
    G = gpus_per_node
    node = src // G
    out, remote = [], {}
    for k, e in enumerate(experts):
        replicas = sorted(r for r, held in enumerate(layer_slots) for x in held if x == e)
        if e < 0:
            out.append(-1)
        elif src in replicas or any(r // G == node for r in replicas):
            out.append(reference_destination(layer_slots, G, src, e, position))
        else:
            out.append(None)
            remote[k] = sorted({r // G for r in replicas})
    chosen = {ns[0] for ns in remote.values() if len(ns) == 1}
    while True:
        uncovered = [k for k, ns in remote.items() if len(ns) > 1 and not chosen & set(ns)]
        count = {n: sum(n in remote[k] for k in uncovered) for n in range(len(layer_slots) // G)}
        best = max(count.values())
        if best < 2:  # no node would serve two uncovered experts: they route as under `position`
            break
        ties = [n for n in sorted(count) if count[n] == best]
        chosen.add(ties[position % len(ties)])
    for k, ns in remote.items():
        reach = [n for n in ns if n in chosen] or ns
        replicas = sorted(r for r, held in enumerate(layer_slots) for x in held if x == experts[k] and r // G in reach)
        out[k] = replicas[position % len(replicas)]
    return out


def reference_steps(requests, ranks, num_ranks, batch_tokens, order):
    """The replay's steps, each a list of (src rank, position, row)."""
    rows = [(ranks[i], pos, row) for i, req in enumerate(requests) for pos, row in enumerate(req)]
    if order == "trace":
        return [rows[i : i + batch_tokens] for i in range(0, len(rows), batch_tokens)]
    queues = [[x for x in rows if x[0] == r] for r in range(num_ranks)]  # each rank's own queue
    per_rank = max(1, batch_tokens // num_ranks)
    steps = []
    for j in range(0, max(len(q) for q in queues), per_rank):
        steps.append([x for q in queues for x in q[j : j + per_rank]])
    return steps


def reference_replay(slots, gpus_per_node, requests, ranks, hidden, dtype_bytes, batch_tokens,
                     inter_gbps, intra_gbps, latency_us, order="trace", rule="position") -> dict:
    """slots [L][R][S]; requests = list of per-request rows [n][L][K]; ranks[i] = request i's rank;
    rule: the dispatch rule, "position" or "node-aware"."""
    L, R = len(slots), len(slots[0])
    G = gpus_per_node
    unit = 2 * hidden * dtype_bytes
    rows = [(ranks[i], pos, row) for i, req in enumerate(requests) for pos, row in enumerate(req)]
    out = dict(pairs=0, own_rank=0, own_node=0, inter_sends=0, intra_sends=0, intra_pairs=0)
    loads = [[0] * R for _ in range(L)]
    tokens = [0] * R
    step_imb, step_attn, a2a = [], [], 0.0
    for step in reference_steps(requests, ranks, R, batch_tokens, order):
        step_loads = [[0] * R for _ in range(L)]
        inter_r = [[0] * R for _ in range(L)]
        intra_r = [[0] * R for _ in range(L)]
        step_tokens = [0] * R
        for src, pos, row in step:
            tokens[src] += 1
            step_tokens[src] += 1
            for l in range(L):
                nodes, peers, tier2_pairs = set(), set(), 0
                if rule == "node-aware":
                    chosen = reference_node_aware(slots[l], G, src, row[l], pos)
                else:
                    chosen = [reference_destination(slots[l], G, src, e, pos) if e >= 0 else -1 for e in row[l]]
                for e, d in zip(row[l], chosen):
                    if e < 0:
                        continue
                    out["pairs"] += 1
                    loads[l][d] += 1
                    step_loads[l][d] += 1
                    if d == src:
                        out["own_rank"] += 1
                    if d // G == src // G:
                        out["own_node"] += 1
                    else:
                        nodes.add(d // G)
                    if d % G != src % G:  # tier 2: not the source itself, not a remote node's proxy
                        peers.add(d)
                        tier2_pairs += 1
                out["inter_sends"] += len(nodes)
                out["intra_sends"] += len(peers)
                out["intra_pairs"] += tier2_pairs
                inter_r[l][src] += len(nodes)
                intra_r[l][src] += len(peers)
        imbs = [max(x) / (sum(x) / R) for x in step_loads if sum(x)]
        if imbs:
            step_imb.append((sum(imbs) / len(imbs), max(imbs)))
        step_attn.append(max(step_tokens) / (sum(step_tokens) / R))
        for l in range(L):
            busy = max(max(inter_r[l][r] * unit / (inter_gbps * 1e9), intra_r[l][r] * unit / (intra_gbps * 1e9))
                       for r in range(R))
            a2a += 2 * latency_us * 1e-6 + busy
    layer_imb = [max(x) / (sum(x) / R) for x in loads if sum(x)]
    n_tokens = len(rows)
    return dict(
        tokens=n_tokens,
        routings=out["pairs"],
        inter_node_bytes=unit * out["inter_sends"],
        inter_node_bytes_nodedup=unit * (out["pairs"] - out["own_node"]),
        intra_node_bytes=unit * out["intra_sends"],
        intra_node_bytes_nodedup=unit * out["intra_pairs"],
        inter_node_bytes_per_token=unit * out["inter_sends"] / n_tokens,
        locality=out["own_node"] / out["pairs"] if out["pairs"] else math.nan,
        own_rank_share=out["own_rank"] / out["pairs"] if out["pairs"] else math.nan,
        expert_imbalance_mean=sum(layer_imb) / len(layer_imb),
        expert_imbalance_worst=max(layer_imb),
        step_expert_imbalance_mean=sum(m for m, _ in step_imb) / len(step_imb),
        step_expert_imbalance_worst=max(w for _, w in step_imb),
        attention_imbalance=max(tokens) / (sum(tokens) / R),
        step_attention_imbalance_mean=sum(step_attn) / len(step_attn),
        step_attention_imbalance_worst=max(step_attn),
        a2a_seconds=a2a,
        steps=len(step_attn),
    )
