"""The Qwen3-MoE variants of attention and the MoE block (parity target: transformers' Qwen3MoeForCausalLM).

Attention differs from Llama-4's only in how q and k are placed before the shared attention math:
    q, k = rmsnorm_q(q), rmsnorm_k(k)      per head, over head_dim, each with its own [D] weight
    q, k = rope_halves(q), rope_halves(k)  every layer, dims m and m + D/2 rotated together
No chunks, no temperature tuning, full causal attention.

The MoE block (T tokens, E experts, K top-k, H hidden):
    p       = softmax(x @ W_gate^T) in float32          [T, E]
    top-k   = the K largest p; if norm_topk_prob, divided by their sum
    out     = sum_k w_k * expert_{e_k}(x)                [T, H]   weight scales the OUTPUT
No shared expert. Module names are Locus's (feed_forward.router, feed_forward.experts), so expert slices,
quantization and the trace recorder find them as for Llama-4; the checkpoint names are mapped at load
(locus/engine/checkpoint/names.py).
"""

from __future__ import annotations

import functools

import torch

from locus.engine.model.attention import Attention
from locus.engine.model.forward_batch import ForwardBatch
from locus.engine.model.layers import RMSNorm
from locus.engine.model.moe import RoutedMoE
from locus.engine.model.qwen3_config import Qwen3MoeModelConfig
from locus.engine.model.rope import apply_rope_halves
from locus.routing.gate import TopK


def route_softmax(logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> TopK:
    """Qwen3-MoE: the k most probable experts of a float32 softmax, optionally renormalised to sum to 1."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return TopK(ids=ids, weights=weights)


class Qwen3Attention(Attention):
    def __init__(self, config: Qwen3MoeModelConfig, layer: int):
        super().__init__(config, layer)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)

    def place(self, q: torch.Tensor, k: torch.Tensor, batch: ForwardBatch,
              rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope_halves(q, rope), apply_rope_halves(k, rope)


class Qwen3MoEBlock(RoutedMoE):
    """Softmax top-k (renormalised with norm_topk_prob), the weight on each expert's output, no shared expert."""

    weight_on_input = False

    def __init__(self, config: Qwen3MoeModelConfig, moe_backend: str = "torch"):
        super().__init__(config, moe_backend, functools.partial(route_softmax, top_k=config.num_experts_per_tok,
                                                                norm_topk_prob=config.norm_topk_prob), None)
