"""Llama-4 attention: GQA with per-layer position rules.

Every attention rule of docs/design.md ("The model") lives here:
- RoPE layers (`no_rope_layers[i] == 1`): pairwise RoPE, then (if `use_qk_norm`) an L2 norm of q and k
  over head_dim, and causal attention *within chunks* of `attention_chunk_size` tokens.
- NoPE layers: no rotation, causal attention over everything, and (if `attn_temperature_tuning`) q is
  scaled by 1 + attn_scale * log(1 + floor((pos + 1) / floor_scale)) at absolute position pos, which
  keeps attention sharp at long range.

Shape legend: T batch tokens, S visible key positions, Hq query heads, Hkv key/value heads, D head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from locus.engine.model.config import ModelConfig
from locus.engine.model.forward_batch import ForwardBatch
from locus.engine.model.kv_cache import KVCache
from locus.engine.model.layers import l2_normalize
from locus.engine.model.rope import apply_rope


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, chunk_size: int | None) -> torch.Tensor:
    """[..., Tq, S] bool: key position j is visible to query position t iff j <= t (and same chunk).

    q_pos [..., Tq], k_pos [..., S]; padding (-1) on either side is never visible.
    """
    q, k = q_pos[..., :, None], k_pos[..., None, :]
    mask = (k <= q) & (k >= 0) & (q >= 0)
    if chunk_size is not None:
        mask &= (k // chunk_size) == (q // chunk_size)
    return mask


def attend_one_query(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Decode attention, one query per sequence: q [B, Hq, D], keys/values [B, S, Hkv, D], mask [B, S]
    (True = visible) -> [B, Hq, D]. Two batched matmuls and a softmax, the Hq / Hkv query heads of a
    KV head side by side; on CPU this ran in 0.085 ms where SDPA's flash kernel took 0.12 (32
    sequences, 8 query and 2 KV heads, 128 keys)."""
    B, Hq, D = q.shape
    Hkv = keys.shape[2]
    # [B, Hkv, S, D] copies with D contiguous: the compiled graph gathers the paged rows into them
    # with vector loads (a [B, Hkv, D, S] operand made it gather element by element).
    keys, values = keys.transpose(1, 2).contiguous(), values.transpose(1, 2).contiguous()
    scores = torch.matmul(q.view(B, Hkv, Hq // Hkv, D), keys.transpose(-1, -2)) * scale  # [B, Hkv, G, S]
    scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), values).view(B, Hq, D)


def temperature_scale(positions: torch.Tensor, attn_scale: float, floor_scale: float) -> torch.Tensor:
    """[T] float32 query scale of NoPE layers."""
    return torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = D = config.head_dim
        self.eps = config.rms_norm_eps
        self.use_rope = config.uses_rope(layer)
        self.use_qk_norm = config.use_qk_norm and self.use_rope
        self.use_temperature = config.attn_temperature_tuning and not self.use_rope
        self.attn_scale, self.floor_scale = config.attn_scale, config.floor_scale
        self.chunk_size = config.attention_chunk_size if self.use_rope else None
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * D, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * D, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * D, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * D, config.hidden_size, bias=bias)

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        batch: ForwardBatch,
        rope: torch.Tensor,  # [T, D/2] complex rotations (compiled: [T, D/2, 2] cos, sin)
        cache: KVCache | None,
    ) -> torch.Tensor:
        T = x.shape[0]
        q = self.q_proj(x).view(T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(T, self.num_kv_heads, self.head_dim)
        q, k = self.place(q, k, batch, rope)

        if cache is not None:
            cache.write(self.layer, batch, k, v)
            o = cache.attend(self.layer, batch, q, self.chunk_size, self.head_dim ** -0.5)
            if o is not None:  # the cache attends itself (paged decode attention)
                return self.o_proj(o.reshape(T, -1))
            keys, values, k_pos = cache.read(self.layer, batch, self.chunk_size)
        elif all(span.start == 0 for span in batch.spans):
            rows = batch.query_rows().clamp(min=0)  # without a cache each sequence sees only its own new tokens
            keys, values, k_pos = k[rows], v[rows], batch.query_positions()
        else:
            raise ValueError("a span that continues a sequence needs a KV cache")
        return self.o_proj(self._attend(q, batch, keys, values, k_pos).reshape(T, -1))

    def place(self, q: torch.Tensor, k: torch.Tensor, batch: ForwardBatch,
              rope: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D], k [T, Hkv, D] as attention compares them: Llama-4's RoPE, qk-norm and
        temperature rules (another family overrides this: qwen3.py)."""
        if self.use_rope:
            q, k = apply_rope(q, rope), apply_rope(k, rope)
        if self.use_qk_norm:
            q, k = l2_normalize(q, self.eps), l2_normalize(k, self.eps)
        if self.use_temperature:
            scale = temperature_scale(batch.positions, self.attn_scale, self.floor_scale)
            q = (q * scale[:, None, None]).to(q.dtype)
        return q, k

    def _attend(self, q: torch.Tensor, batch: ForwardBatch, keys: torch.Tensor, values: torch.Tensor,
                k_pos: torch.Tensor) -> torch.Tensor:
        """All sequences in one padded SDPA call. q [T, Hq, D]; keys/values [B, S, Hkv, D] -> [T, Hq, D]."""
        rows = batch.query_rows()  # [B, Q]
        q_pad = q[rows.clamp(min=0)]  # [B, Q, Hq, D]
        key = ("attention_mask", self.chunk_size)  # a batch reads the same key positions for a given chunk size
        if key not in batch.memo:  # the same for every layer of this kind
            mask = visible(batch.query_positions(), k_pos, self.chunk_size)  # [B, Q, S]
            # Padding queries see nothing; give them one key so softmax stays finite (their rows are dropped).
            mask[..., 0] |= ~mask.any(-1)
            batch.memo[key] = mask[:, None]
        mask = batch.memo[key]
        dtype = q.dtype
        if dtype in (torch.bfloat16, torch.float16) and q.device.type == "cpu":
            # CPU SDPA in half precision is several times slower than in float32 (docs/engine.md,
            # "float32 SDPA for bf16/fp16 on CPU"), and the float32 softmax is what GPU kernels do anyway.
            q_pad, keys, values = q_pad.float(), keys.float(), values.float()
        if q_pad.shape[1] == 1 and q.device.type == "cpu":
            o = attend_one_query(q_pad[:, 0], keys, values, mask[:, 0, 0], self.head_dim ** -0.5)  # [B, Hq, D]
            return batch.unpad(o[:, None]).to(dtype)
        o = F.scaled_dot_product_attention(
            q_pad.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask,
            scale=self.head_dim ** -0.5, enable_gqa=self.num_heads != self.num_kv_heads,
        )  # [B, Hq, Q, D]
        return batch.unpad(o.transpose(1, 2)).to(dtype)  # [T, Hq, D]
