"""Router math: from router logits to each token's top-k experts and their weights.

Shape legend: T tokens, E experts, K experts per token.

Three routers matter to Locus. The engine serves Llama-4; the trace tools must also understand the
others (traces of Qwen3-MoE, Mixtral and DeepSeek-V3):
- Llama-4: top-k of the raw logits, weight = sigmoid(logit), no renormalisation. The weight later
  scales the expert's *input* (see kernels/moe_reference.py).
- softmax top-k (Mixtral, Qwen3-MoE): softmax over all E, keep the top k, optionally renormalise.
- DeepSeek-V3: sigmoid scores plus a per-expert bias choose the experts (group-limited: the best
  `topk_group` of `n_group` groups, each group scored by the sum of its top-2 biased scores); the
  weights are the unbiased scores, renormalised, times `routed_scaling_factor`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TopK:
    """The routing decision for a batch of tokens."""

    ids: torch.Tensor  # [T, K] int64 expert ids
    weights: torch.Tensor  # [T, K] float32 routing weights


def route_llama4(logits: torch.Tensor, top_k: int) -> TopK:
    """Llama-4: the k largest logits, each weighted by its own sigmoid (computed in float32)."""
    values, ids = torch.topk(logits, top_k, dim=-1)
    return TopK(ids=ids, weights=torch.sigmoid(values.float()))


def route_softmax(logits: torch.Tensor, top_k: int, renormalize: bool = True) -> TopK:
    """Mixtral / Qwen3-MoE: softmax over all experts, top-k, optional renormalisation."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return TopK(ids=ids, weights=weights)


def route_deepseek_v3(
    logits: torch.Tensor,
    bias: torch.Tensor,
    top_k: int = 8,
    n_group: int = 8,
    topk_group: int = 4,
    routed_scaling_factor: float = 2.5,
) -> TopK:
    """DeepSeek-V3: biased sigmoid scores choose group-limited experts; unbiased scores weight them."""
    T, E = logits.shape
    if E % n_group:
        raise ValueError(f"{E} experts do not split into {n_group} groups")
    scores = torch.sigmoid(logits.float())  # [T, E]
    biased = scores + bias.float()
    group_scores = biased.view(T, n_group, E // n_group).topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
    best_groups = group_scores.topk(topk_group, dim=-1).indices  # [T, topk_group]
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
    expert_mask = group_mask.repeat_interleave(E // n_group, dim=1)  # [T, E]
    ids = biased.masked_fill(~expert_mask, float("-inf")).topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    weights = weights / weights.sum(dim=-1, keepdim=True) * routed_scaling_factor
    return TopK(ids=ids, weights=weights)
