"""PlanSummary: what `locus plan` prints about a plan, measured on its planning data.

Figures are expectations under the load and cost models (expected_load.py, node_cost.py) for the
grouping of the planning requests the plan was computed for; they are not results (replay another
part of the trace for those).
  locality                share of (token, k) pairs whose expert has a replica on the token's node
  inter-node bytes/token  node_cost's expected bytes (independent draws from each request's own
                          prefill / decode distribution, on its prefill / decode node)
  expert imbalance        per layer, max / mean of the expected rank loads; mean over layers, worst
  attention imbalance     max / mean tokens per rank of the planning grouping

Shape legend: R requests, L MoE layers, N nodes, E experts.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, field

import numpy as np

from locus.routing.planners.expected_load import rank_loads
from locus.routing.plan.placement import node_replicas
from locus.routing.grouping.node_cost import NodeCostModel
from locus.traces.metrics import max_over_mean

LITTLE_TO_WIN = 0.05  # expected reduction vs eplb below which `locus plan` says there is little to win


@dataclass
class PlanSummary:
    planner: str
    model: str
    topology: str
    slots_per_gpu: int
    requests: tuple[int, int]
    tokens: int
    locality: float
    inter_node_bytes_per_token: float
    expert_imbalance_mean: float
    expert_imbalance_worst: float
    attention_imbalance: float
    plan_seconds: float
    grouping: str  # how the planning requests were assigned to nodes
    fallback_layers: list[int] = field(default_factory=list)  # layers that took EPLB's balance instead
    eplb_inter_node_bytes_per_token: float | None = None  # expected, EPLB + balanced assignment, same data
    # the cap of every MoE layer: `--expert-cap auto` {"floor", "layers"}, `eplb` {"share", "ceiling", "layers"}
    expert_caps: dict | None = None

    @property
    def expected_reduction_vs_eplb(self) -> float | None:
        if not self.eplb_inter_node_bytes_per_token:
            return None
        return 1.0 - self.inter_node_bytes_per_token / self.eplb_inter_node_bytes_per_token

    def to_dict(self) -> dict:
        return {**asdict(self), "expected_reduction_vs_eplb": self.expected_reduction_vs_eplb}

    def format_table(self) -> str:
        rows = [
            ("planner", f"{self.planner} ({self.model}, {self.topology}, {self.slots_per_gpu} slots/GPU)"),
            ("planning requests",
             f"{self.requests[0]}:{self.requests[1]} ({self.tokens:,} tokens), grouped by {self.grouping}"),
            ("locality (expected, planning data)", f"{100 * self.locality:.1f} %"),
            ("inter-node bytes/token (expected)", f"{self.inter_node_bytes_per_token:,.0f}"),
            ("expert imbalance (mean / worst layer)",
             f"{self.expert_imbalance_mean:.3f} / {self.expert_imbalance_worst:.3f}"),
            ("attention imbalance", f"{self.attention_imbalance:.3f}"),
            ("plan time", f"{self.plan_seconds:.2f} s"),
        ]
        if self.expert_caps:
            mode = "eplb" if "share" in self.expert_caps else "auto"
            rows.append((f"expert cap ({mode}, per layer)", _describe_caps(self.expert_caps)))
        if self.fallback_layers:
            rows.append(("layers on EPLB balance", ", ".join(str(x) for x in self.fallback_layers)))
        reduction = self.expected_reduction_vs_eplb
        if reduction is not None:
            eplb = f"{self.eplb_inter_node_bytes_per_token:,.0f} (locality: {-100 * reduction:+.1f} %)"
            rows.insert(4, ("  vs eplb, balanced (expected)", eplb))
            if reduction < LITTLE_TO_WIN:
                rows.append(("note", f"the planning data shows little expert locality to exploit (expected "
                             f"{100 * reduction:.1f} % fewer inter-node bytes than eplb); expect little gain"))
        width = max(len(name) for name, _ in rows)
        return "\n".join(f"{name:<{width}}  {value}" for name, value in rows)


def eplb_bytes_per_token(meta, spec, signatures, topology, pool=None) -> float:
    """Expected inter-node bytes per token of EPLB with balanced assignment on the same requests (`pool`: as
    expected_bytes_per_token's)."""
    from locus.routing.replay.assignment import assign_balanced
    from locus.routing.planners.baselines import eplb

    plan = eplb(signatures.all_pairs(), meta.moe_layers, topology)
    node = assign_balanced(signatures.tokens, topology.ranks).ranks // topology.gpus_per_node
    return expected_bytes_per_token(plan, spec, signatures, node, node, meta.moe_layers, pool)


def expected_bytes_per_token(plan, spec, signatures, prefill_node: np.ndarray, decode_node: np.ndarray,
                             moe_layers, pool=None) -> float:
    """node_cost's expected inter-node bytes per token over the planning requests (no prior mixed in).
    `pool`: a planners.layer_pool.LayerPool holding these signatures, which scores each node's requests in
    its workers (the same figures)."""
    cost = dataclasses.replace(NodeCostModel.from_plan(plan, spec, moe_layers), prior_tokens=0.0)
    total = 0.0
    prompt = signatures.prompt_tokens.astype(np.float64)
    decode = (signatures.tokens - signatures.prompt_tokens).astype(np.float64)
    for phase, node, n in (("prefill", prefill_node, prompt), ("decode", decode_node, decode)):
        if pool is None:
            on_node = cost.expected_bytes_on(getattr(signatures, phase), node)  # [R] on each request's node
        else:
            on_node = pool.bytes_on(cost, signatures, phase, node)
        total += float((on_node * n).sum())
    return total / max(float(signatures.tokens.sum()), 1.0)


def demand_figures(slots: np.ndarray, demand: np.ndarray, pull: np.ndarray | None = None) -> tuple[float, float, float]:
    """(locality, mean imbalance, worst imbalance) of slots [L, R, S] for demand [L, N, E] (pull: the
    remote split, expected_load.py; None: the even spread)."""
    L, N, E = demand.shape
    x = node_replicas(slots, N, E)
    total = float(demand.sum())
    locality = float((demand * (x > 0)).sum() / total) if total > 0 else 1.0
    imb = max_over_mean(rank_loads(slots, demand, pull))
    return locality, float(imb.mean()), float(imb.max())


def attention_imbalance(tokens: np.ndarray, prefill_rank: np.ndarray, decode_rank: np.ndarray,
                        prompt_tokens: np.ndarray, num_ranks: int) -> float:
    loads = np.bincount(prefill_rank, weights=prompt_tokens, minlength=num_ranks)
    loads += np.bincount(decode_rank, weights=tokens - prompt_tokens, minlength=num_ranks)
    return float(max_over_mean(loads))


def _describe_caps(chosen: dict) -> str:
    """The per-layer caps in one line. `--expert-cap auto`: the floor, and the layers (MoE index) raised above
    it; `eplb[:SHARE]`: the share, and every layer's cap (MoE index: cap), each EPLB's figure or below."""
    if "share" in chosen:
        caps = chosen["layers"]
        shown = ", ".join(f"{i}: {c:.3f}" for i, c in enumerate(caps[:8])) + (", ..." if len(caps) > 8 else "")
        return (f"share {chosen['share']:g} of EPLB's slack, at most {chosen['ceiling']:.3f}; kept (MoE index: cap) "
                f"{shown}; lowest {min(caps):.3f}, highest {max(caps):.3f}")
    floor, caps = chosen["floor"], chosen["layers"]
    raised = [(i, c) for i, c in enumerate(caps) if c > floor]
    if not raised:
        return f"floor {floor:.3f} on every layer"
    shown = ", ".join(f"{i}: {c:.3f}" for i, c in raised[:8]) + (", ..." if len(raised) > 8 else "")
    return f"floor {floor:.3f}, above it on {len(raised)} of {len(caps)} layers (the best figure reached, MoE index: cap) {shown}"
