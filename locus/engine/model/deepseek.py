"""The DeepSeek-V3 / V2 variants of attention and the MoE block (parity target: transformers'
DeepseekV3ForCausalLM and DeepseekV2ForCausalLM).

Multi-head latent attention (T tokens, Hq heads, R kv_lora_rank, P qk_rope_head_dim, N qk_nope_head_dim,
V v_head_dim):
    q           = q_b(rmsnorm(q_a(x))) or q_proj(x)          [T, Hq, N + P]   (q_lora_rank None: one q_proj)
    latent, kpe = kv_a_proj_with_mqa(x) split               [T, R], [T, P]
    latent      = rmsnorm(latent)                           cached, with rope(kpe): R + P values per token
    k_nope, v   = kv_b_proj(latent) split per head          [S, Hq, N], [S, Hq, V]
    scores      = (q_nope . k_nope + rope(q_pe) . rope(kpe)) * scale
The cache keeps only the latent and the rotated key (kv_cache_dims). A prefill decompresses the
visible latents with kv_b_proj (k_nope, v per head); a decode step (one query per sequence) attends in the
latent space instead (the absorbed form): q_nope is mapped through kv_b_proj's key half to [Hq, R],
scored against the latents, and the weighted latent sum mapped through its value half to [Hq, V]. scale = (N + P)^-0.5, times yarn_get_mscale(factor,
mscale_all_dim)^2 under yarn; yarn also lengthens each rotation by its attention factor (rope.py).
V3's rope_interleave (and V2) rotate adjacent pairs, V3 without it the halves.

The MoE block (E experts, K top-k):
    V3: s = sigmoid(logits); choose by s + bias within the topk_group best of n_group groups (group score:
        its two best biased scores); w = s of the chosen (/ their sum if norm_topk_prob) * routed_scaling_factor
    V2: s = softmax(logits); greedy top-k, or within the topk_group best groups (group score: its best s);
        w = s of the chosen * routed_scaling_factor
    out = sum_k w_k * expert_{e_k}(x) + shared_experts(x)    weight scales the OUTPUT
Module names are Locus's (feed_forward.router, .experts, .shared_expert); checkpoint names are mapped
at load (locus/engine/checkpoint/names.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from locus.engine.model.attention import visible
from locus.engine.model.deepseek_config import V3, DeepseekModelConfig
from locus.engine.model.forward_batch import ForwardBatch
from locus.engine.model.kv_cache import KVCache
from locus.engine.model.layers import RMSNorm, SwiGLU
from locus.engine.model.moe import RoutedMoE
from locus.engine.model.rope import apply_rope, apply_rope_halves, yarn_attention_factor, yarn_get_mscale
from locus.routing.gate import TopK


def group_mask(group_scores: torch.Tensor, topk_group: int, num_experts: int) -> torch.Tensor:
    """[T, E] bool: the experts of each token's topk_group best groups (group_scores [T, G])."""
    T, G = group_scores.shape
    chosen = torch.zeros_like(group_scores, dtype=torch.bool)
    chosen.scatter_(1, torch.topk(group_scores, topk_group, dim=-1).indices, True)
    return chosen[:, :, None].expand(T, G, num_experts // G).reshape(T, num_experts)


def route_sigmoid_grouped(logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
                          norm_topk_prob: bool, scaling: float) -> TopK:
    """DeepSeek-V3: biased sigmoid scores choose (within the best groups), the unbiased ones weigh."""
    scores = torch.sigmoid(logits.float())
    choice = scores + bias.float()
    T, E = choice.shape
    group_scores = choice.view(T, n_group, E // n_group).topk(2, dim=-1).values.sum(-1)
    choice = choice.masked_fill(~group_mask(group_scores, topk_group, E), float("-inf"))
    ids = torch.topk(choice, top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return TopK(ids=ids, weights=weights * scaling)


def route_softmax_grouped(logits: torch.Tensor, top_k: int, n_group: int, topk_group: int,
                          scaling: float) -> TopK:
    """DeepSeek-V2: softmax scores, greedy (n_group 1) or within the topk_group groups of the best experts."""
    scores = torch.softmax(logits.float(), dim=-1)
    T, E = scores.shape
    if n_group > 1:
        group_scores = scores.view(T, n_group, E // n_group).max(dim=-1).values
        scores = scores.masked_fill(~group_mask(group_scores, topk_group, E), 0.0)
    weights, ids = torch.topk(scores, top_k, dim=-1)
    return TopK(ids=ids, weights=weights * scaling)


class DeepseekAttention(nn.Module):
    def __init__(self, config: DeepseekModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads = H = config.num_attention_heads
        self.nope, self.rope_dim, self.v_dim = config.qk_nope_head_dim, config.qk_rope_head_dim, config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        qk = config.qk_head_dim
        bias = config.attention_bias
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(config.hidden_size, H * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(config.hidden_size, config.q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
            self.q_b_proj = nn.Linear(config.q_lora_rank, H * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(config.hidden_size, config.kv_lora_rank + self.rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, config.rms_norm_eps)
        self.kv_b_proj = nn.Linear(config.kv_lora_rank, H * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(H * self.v_dim, config.hidden_size, bias=bias)
        self.q_lora = config.q_lora_rank is not None
        self.pairs = config.model_type != V3 or config.rope_interleave
        self.rope_length = yarn_attention_factor(config.rope)
        self.scale = qk ** -0.5
        if config.rope.rope_type != "default" and config.rope.mscale_all_dim:
            self.scale *= yarn_get_mscale(config.rope.factor, config.rope.mscale_all_dim) ** 2

    def rotate(self, x: torch.Tensor, rope: torch.Tensor) -> torch.Tensor:
        out = apply_rope(x, rope) if self.pairs else apply_rope_halves(x, rope)
        return out if self.rope_length == 1.0 else (out.float() * self.rope_length).to(x.dtype)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, rope: torch.Tensor, cache: KVCache | None) -> torch.Tensor:
        T, H = x.shape[0], self.num_heads
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)
        q_nope, q_pe = q.view(T, H, self.nope + self.rope_dim).split([self.nope, self.rope_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)[:, None]  # [T, 1, R]
        q = torch.cat([q_nope, self.rotate(q_pe, rope)], dim=-1)  # [T, H, N + P]
        k_pe = self.rotate(k_pe[:, None].contiguous(), rope)  # [T, 1, P]

        if cache is not None:
            cache.write(self.layer, batch, latent, k_pe)
            latents, k_pes, k_pos = cache.read(self.layer, batch, None)  # [B, S, 1, R], [B, S, 1, P]
        elif all(span.start == 0 for span in batch.spans):
            rows = batch.query_rows().clamp(min=0)  # without a cache each sequence sees only its own new tokens
            latents, k_pes, k_pos = latent[rows], k_pe[rows], batch.query_positions()
        else:
            raise ValueError("a span that continues a sequence needs a KV cache")
        attend = self._attend_absorbed if batch.query_rows().shape[1] == 1 else self._attend
        return self.o_proj(attend(q, batch, latents[:, :, 0], k_pes, k_pos).reshape(T, -1))

    def _mask(self, batch: ForwardBatch, k_pos: torch.Tensor) -> torch.Tensor:
        """[B, 1, Q, S] bool, shared with the other layers of the batch."""
        key = ("attention_mask", None)
        if key not in batch.memo:
            mask = visible(batch.query_positions(), k_pos, None)  # [B, Q, S]
            mask[..., 0] |= ~mask.any(-1)  # padding queries see one key so softmax stays finite
            batch.memo[key] = mask[:, None]
        return batch.memo[key]

    def _attend_absorbed(self, q: torch.Tensor, batch: ForwardBatch, latents: torch.Tensor, k_pes: torch.Tensor,
                         k_pos: torch.Tensor) -> torch.Tensor:
        """Decode (one query per sequence) in the latent space: kv_b_proj's key half is folded into the
        query and its value half applied after attention, so the S cached latents are never expanded
        to per-head keys and values (H x (N + V) per key). The same sums as _attend, in another order."""
        H, N, R = self.num_heads, self.nope, self.kv_lora_rank
        w = self.kv_b_proj.weight.view(H, N + self.v_dim, R)
        w_k, w_v = w[:, :N], w[:, N:]  # [H, N, R], [H, V, R]
        dtype = q.dtype
        rows = batch.query_rows().clamp(min=0)  # [B, 1]
        q_pad = q[rows].float()  # [B, 1, H, N + P]
        q_lat = torch.einsum("bqhn,hnr->bqhr", q_pad[..., :N], w_k.float())
        lat = latents.float()
        scores = (torch.einsum("bqhr,bsr->bhqs", q_lat, lat)
                  + torch.einsum("bqhp,bsp->bhqs", q_pad[..., N:], k_pes[:, :, 0].float())) * self.scale
        scores = scores.masked_fill(~self._mask(batch, k_pos), float("-inf"))
        o_lat = torch.einsum("bhqs,bsr->bqhr", torch.softmax(scores, dim=-1), lat)
        o = torch.einsum("bqhr,hvr->bqhv", o_lat, w_v.float())  # [B, 1, H, V]
        return batch.unpad(o).to(dtype)

    def _attend(self, q: torch.Tensor, batch: ForwardBatch, latents: torch.Tensor, k_pes: torch.Tensor,
                k_pos: torch.Tensor) -> torch.Tensor:
        """q [T, H, N + P]; latents [B, S, R], k_pes [B, S, 1, P] -> [T, H, V], all sequences in one padded call."""
        B, S = latents.shape[:2]
        kv = self.kv_b_proj(latents).view(B, S, self.num_heads, self.nope + self.v_dim)
        k_nope, values = kv.split([self.nope, self.v_dim], dim=-1)
        keys = torch.cat([k_nope, k_pes.expand(B, S, self.num_heads, self.rope_dim)], dim=-1)
        rows = batch.query_rows()  # [B, Q]
        q_pad = q[rows.clamp(min=0)]  # [B, Q, H, N + P]
        mask = self._mask(batch, k_pos)
        dtype = q.dtype
        if dtype in (torch.bfloat16, torch.float16) and q.device.type == "cpu":
            q_pad, keys, values = q_pad.float(), keys.float(), values.float()  # as attention.py, for speed
        o = F.scaled_dot_product_attention(q_pad.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                           attn_mask=mask, scale=self.scale)  # [B, H, Q, V]
        return batch.unpad(o.transpose(1, 2)).to(dtype)


class DeepseekMoEBlock(RoutedMoE):
    """V3's biased sigmoid or V2's softmax group-limited top-k (`rule`), the weight on each expert's
    output, n_shared_experts shared experts as one wider one."""

    weight_on_input = False

    def __init__(self, config: DeepseekModelConfig, moe_backend: str = "torch"):
        super().__init__(config, moe_backend, None,
                         SwiGLU(config.hidden_size, config.intermediate_size * config.n_shared_experts))
        self.config = config
        # V3's bias shifts which experts are chosen, never their weights; V2 has none.
        self.e_score_correction_bias = (nn.Parameter(torch.zeros(config.num_local_experts))
                                        if config.model_type == V3 else None)

    def rule(self, logits: torch.Tensor) -> TopK:
        """Router logits -> the chosen experts and their weights (the expert-parallel form calls it too)."""
        c = self.config
        if c.model_type == V3:
            return route_sigmoid_grouped(logits, self.e_score_correction_bias, self.top_k, c.n_group, c.topk_group,
                                         c.norm_topk_prob, c.routed_scaling_factor)
        return route_softmax_grouped(logits, self.top_k, c.n_group, c.topk_group, c.routed_scaling_factor)
