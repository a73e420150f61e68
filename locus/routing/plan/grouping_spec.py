"""GroupingSpec: what the micro-batch grouper needs from a plan, stored as the plan's `grouping` object.

    {"version": 1,
     "domain_nodes": {"chat": [1.0, 1.0, 0.1, 0, ...], ...},  // per domain, its weight on every node
     "caps": {"expert": 1.1, "attention": 1.1},
     "expected_decode_tokens": 176.0,    // mean decode length of the planning data
     "kv_bytes_per_token": 196608,       // KV cache bytes one token occupies (all layers)
     "bytes_per_send": 20480,            // 2 * hidden * dtype_bytes: one token sent and combined back
     "top_k": 1,
     "prior_tokens": 16.0,               // pseudo-tokens of `expert_prior` mixed into a prefill signature
     "move_margin": 1.0,                 // move only if saved bytes > margin * migration bytes
     "expert_prior": [[...], ...],       // [L][E] planning-data expert popularity per layer (sums to 1)
     "predictor": {...}}                 // optional: a prompt's expected signature from its token ids
                                         // (locus/routing/plan/predictor.py), for untagged requests

Domain weights come from the planning data: the domains' token shares laid end to end over the
nodes (node n covers [n, n + 1) of the line), so a domain spans as few nodes as its share allows and
a node mixes at most a few domains; the locality planner orders the line so that domains using the
same experts share nodes (locus/routing/planners/domain_layout.py). The grouper keeps each domain's tokens split in these proportions.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from locus.routing.plan.predictor import TokenAffinity
from locus.routing.plan.caps import Caps
from locus.routing.plan.placement import PlanError

VERSION = 1
DEFAULT_PRIOR_TOKENS = 16.0

# KV cache bytes per token (all attention layers, bf16), from the public configs: Llama-4 (48 layers,
# 8 KV heads x 128), DeepSeek-V3 MLA (61 layers x (512 + 64) latent), Qwen3-235B (94 x 4 x 128),
# Mixtral (32 x 8 x 128). Other models: 2 * hidden * dtype_bytes per layer (K and V at full width, an
# upper bound for grouped-query attention) over layers 0..max(moe_layers).
KV_BYTES_PER_TOKEN = {
    "llama4-scout": 2 * 48 * 8 * 128 * 2,
    "llama4-maverick": 2 * 48 * 8 * 128 * 2,
    "deepseek-v3": 61 * (512 + 64) * 2,
    "qwen3-235b": 2 * 94 * 4 * 128 * 2,
    "mixtral-8x7b": 2 * 32 * 8 * 128 * 2,
}


def kv_bytes_per_token(model: str, hidden_size: int, dtype_bytes: int, moe_layers) -> int:
    known = KV_BYTES_PER_TOKEN.get(model.lower())
    if known is not None:
        return known
    return 2 * int(hidden_size) * int(dtype_bytes) * (max(int(x) for x in moe_layers) + 1)


@dataclass
class GroupingSpec:
    domain_nodes: dict[str, list[float]]
    caps: Caps
    expected_decode_tokens: float
    kv_bytes_per_token: int
    bytes_per_send: int
    top_k: int
    expert_prior: np.ndarray  # [L, E] float, rows sum to 1
    prior_tokens: float = DEFAULT_PRIOR_TOKENS
    move_margin: float = 1.0
    extra: dict = field(default_factory=dict)  # informational (planning summary), kept on round trip
    predictor: TokenAffinity | None = None  # places untagged requests by their prompt (predictor.py)

    def to_dict(self) -> dict:
        return {
            "version": VERSION,
            "domain_nodes": {d: [round(float(w), 6) for w in ws] for d, ws in self.domain_nodes.items()},
            "caps": self.caps.to_dict(),
            "expected_decode_tokens": float(self.expected_decode_tokens),
            "kv_bytes_per_token": int(self.kv_bytes_per_token),
            "bytes_per_send": int(self.bytes_per_send),
            "top_k": int(self.top_k),
            "prior_tokens": float(self.prior_tokens),
            "move_margin": float(self.move_margin),
            **({"extra": self.extra} if self.extra else {}),
            "expert_prior": np.round(self.expert_prior, 7).tolist(),
            **({"predictor": self.predictor.to_dict()} if self.predictor is not None else {}),
        }

    @classmethod
    def from_dict(cls, data: object, nodes: int, num_layers: int, num_experts: int,
                  moe_layers=None) -> "GroupingSpec":
        """Parse and check a plan's `grouping` object; errors name the field at fault. `moe_layers`: the
        plan's (a predictor must be for them; default: any of `num_layers` layers)."""
        if not isinstance(data, dict):
            raise PlanError("grouping must be an object")
        if data.get("version") != VERSION:
            raise PlanError(f"grouping version {data.get('version')!r} is not supported (this Locus reads {VERSION})")
        missing = [k for k in ("domain_nodes", "caps", "expected_decode_tokens", "kv_bytes_per_token",
                               "bytes_per_send", "top_k", "expert_prior") if k not in data]
        if missing:
            raise PlanError(f"grouping is missing field(s): {', '.join(missing)}")
        domains = data["domain_nodes"]
        if not isinstance(domains, dict):
            raise PlanError("grouping.domain_nodes must be an object {domain: [weight per node]}")
        for d, ws in domains.items():
            if (not isinstance(ws, list) or len(ws) != nodes or not all(_number(w) and w >= 0 for w in ws)
                    or sum(ws) <= 0):
                raise PlanError(f"grouping.domain_nodes[{d!r}] must list {nodes} non-negative weights, not all 0")
        caps = data["caps"]
        if not isinstance(caps, dict):
            raise PlanError("grouping.caps must be an object {expert, attention}")
        try:
            caps = Caps(**{k: caps[k] for k in ("expert", "attention") if k in caps})
        except TypeError as exc:
            raise PlanError(f"grouping.caps: {exc}") from None
        for key in ("expected_decode_tokens", "prior_tokens", "move_margin"):
            if key in data and (not _number(data[key]) or data[key] < 0):
                raise PlanError(f"grouping.{key} must be a non-negative number, got {data[key]!r}")
        for key in ("kv_bytes_per_token", "bytes_per_send", "top_k"):
            if not _integer(data[key]) or data[key] < 1:
                raise PlanError(f"grouping.{key} must be a positive integer, got {data[key]!r}")
        try:
            prior = np.asarray(data["expert_prior"], dtype=np.float64)
        except (TypeError, ValueError):
            raise PlanError("grouping.expert_prior must be a [layers][experts] array of numbers") from None
        if prior.shape != (num_layers, num_experts) or not np.isfinite(prior).all() or (prior < 0).any():
            raise PlanError(f"grouping.expert_prior must be [{num_layers}][{num_experts}] non-negative numbers, "
                            f"got shape {prior.shape}")
        return cls(
            domain_nodes={str(d): [float(w) for w in ws] for d, ws in domains.items()},
            caps=caps,
            expected_decode_tokens=float(data["expected_decode_tokens"]),
            kv_bytes_per_token=int(data["kv_bytes_per_token"]),
            bytes_per_send=int(data["bytes_per_send"]),
            top_k=int(data["top_k"]),
            expert_prior=normalise_rows(prior),
            prior_tokens=float(data.get("prior_tokens", DEFAULT_PRIOR_TOKENS)),
            move_margin=float(data.get("move_margin", 1.0)),
            extra=dict(data.get("extra") or {}),
            predictor=_predictor(data.get("predictor"), moe_layers, num_layers, num_experts),
        )


def _predictor(data: object, moe_layers, num_layers: int, num_experts: int) -> TokenAffinity | None:
    if data is None:
        return None
    if moe_layers is None:  # not told the plan's layers: the predictor's own, if there are as many
        layers = data.get("moe_layers") if isinstance(data, dict) else None
        if not isinstance(layers, list) or len(layers) != num_layers:
            raise PlanError(f"grouping.predictor.moe_layers must list the plan's {num_layers} MoE layers")
        moe_layers = layers
    return TokenAffinity.from_dict(data, moe_layers, num_experts)


def spec_of(plan) -> GroupingSpec:
    """The plan's grouping, parsed; a clear error if the plan has none (e.g. a baseline plan)."""
    if plan.grouping is None:
        raise PlanError(f"the {plan.planner} plan has no grouping object; plan with `locus plan --planner locality`")
    return GroupingSpec.from_dict(plan.grouping, plan.topology.nodes, len(plan.moe_layers), plan.num_experts,
                                  plan.moe_layers)


def domain_node_weights(domains: list[str], tokens: np.ndarray, nodes: int,
                        order: list[str] | None = None) -> dict[str, list[float]]:
    """Each tagged domain's share of the tagged planning tokens laid end to end over [0, nodes): its
    overlap with every node's unit interval. `order`: the domains' order on the line (every tagged
    domain once; the locality planner chooses it by expert affinity, domain_layout.py); without it,
    largest domains first, so they own whole nodes."""
    names, per = domain_tokens(domains, tokens)
    if order is None:
        index = sorted(range(len(names)), key=lambda i: (-per[i], names[i]))
    else:
        if sorted(order) != names:
            raise PlanError(f"domain order {order} must name every tagged domain once: {names}")
        index = [names.index(d) for d in order]
    share = per / max(per.sum(), 1.0) * nodes
    out, left = {}, 0.0
    for i in index:
        right = left + share[i]
        lo, hi = np.arange(nodes), np.arange(1, nodes + 1)
        overlap = np.clip(np.minimum(hi, right) - np.maximum(lo, left), 0.0, None)
        if overlap.sum() <= 0:  # a domain with no tokens: no preference
            overlap = np.ones(nodes)
        out[names[i]] = [float(w) for w in overlap]
        left = right
    return out


def domain_tokens(domains: list[str], tokens: np.ndarray) -> tuple[list[str], np.ndarray]:
    """The tagged domains (tagged_domains) and their tokens."""
    names = tagged_domains(domains)
    per = np.array([tokens[np.asarray(domains) == d].sum() for d in names], dtype=np.float64)
    return names, per


def tagged_domains(domains: list[str]) -> list[str]:
    """The tagged domains, sorted ("" is no tag, what the engine recorder writes)."""
    return sorted(set(d for d in domains if d))


def normalise_rows(counts: np.ndarray) -> np.ndarray:
    """Rows of the last axis scaled to sum 1 (uniform where a row is all zero)."""
    counts = np.asarray(counts, dtype=np.float64)
    total = counts.sum(-1, keepdims=True)
    uniform = np.full_like(counts, 1.0 / counts.shape[-1])
    return np.where(total > 0, counts / np.where(total > 0, total, 1.0), uniform)


def _number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _integer(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
