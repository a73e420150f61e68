"""Router math: from router logits to each token's top-k experts and their weights.

Shape legend: T tokens, E experts, K experts per token.

The engine serves Llama-4: top-k of the raw logits, weight = sigmoid(logit), no renormalisation.
The weight later scales the expert's *input* (see kernels/moe_reference.py). Traces of other models
(Qwen3-MoE, Mixtral, DeepSeek-V3) arrive with their experts already chosen (locus/traces/importers),
so their routers' math is not needed here.
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
