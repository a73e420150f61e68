"""Llama-4 text MoE model (the math of docs/design.md, "The model"; parity target: transformers' Llama4ForCausalLM),
and through the family's attention and MoE variants (families.py) Qwen3-MoE (Qwen3MoeForCausalLM).

Per decoder layer i (pre-norm residual):
    h   = x + attn_i(rmsnorm(x))          attention rules per layer: attention.py
    out = h + ffn_i(rmsnorm(h))           ffn_i = MoEBlock if i in moe_layers else dense SwiGLU

Module and parameter names equal the checkpoint's tensor names (`model.layers.3.feed_forward.router.
weight`, ...), so loading is a name-for-name copy. The forward pass takes a flat `ForwardBatch` of
one or more sequences and an optional KV cache; parallelism stays outside the model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from locus.engine.model.config import ModelConfig
from locus.engine.model.families import family_of
from locus.engine.model.forward_batch import ForwardBatch
from locus.engine.model.kv_cache import KVCache
from locus.engine.model.layers import RMSNorm, SwiGLU
from locus.engine.model.rope import compute_inv_freq, rotation
from locus.routing.gate import TopK


@dataclass
class ForwardOutput:
    hidden: torch.Tensor  # [T, H] after the final norm
    routing: dict[int, TopK] | None  # layer index -> routing decision, when asked for


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, moe_backend: str):
        super().__init__()
        self.is_moe = config.is_moe_layer(layer)
        family = family_of(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = family.attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.feed_forward: nn.Module = (
            family.moe_block(config, moe_backend) if self.is_moe
            else SwiGLU(config.hidden_size, config.intermediate_size_mlp)
        )

    def forward(self, x, batch, rope, cache) -> tuple[torch.Tensor, TopK | None]:
        h = x + self.self_attn(self.input_layernorm(x), batch, rope, cache)
        ffn_in = self.post_attention_layernorm(h)
        if self.is_moe:
            ffn_out, topk = self.feed_forward(ffn_in)
            return h + ffn_out, topk
        return h + self.feed_forward(ffn_in), None


class TextModel(nn.Module):
    def __init__(self, config: ModelConfig, moe_backend: str):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i, moe_backend) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Llama4ForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, moe_backend: str = "torch"):
        super().__init__()
        self.config = config
        self.model = TextModel(config, moe_backend)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.tie_weights()
        # A plain attribute, not a buffer: models are built on the meta device and then filled from a
        # checkpoint, which would leave a buffer uninitialised.
        self.inv_freq = compute_inv_freq(config.rope, config.head_dim)

    def tie_weights(self) -> None:
        """Share lm_head with the embedding when the config says so (again after any device move)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    def forward(self, batch: ForwardBatch, cache: KVCache | None = None, record_routing: bool = False) -> ForwardOutput:
        x = self.model.embed_tokens(batch.input_ids)
        if self.inv_freq.device != batch.positions.device:
            self.inv_freq = self.inv_freq.to(batch.positions.device)
        rope = rotation(self.inv_freq, batch.positions)
        routing: dict[int, TopK] | None = {} if record_routing else None
        for i, layer in enumerate(self.model.layers):
            x, topk = layer(x, batch, rope, cache)
            if routing is not None and topk is not None:
                routing[i] = topk
        return ForwardOutput(hidden=self.model.norm(x), routing=routing)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, vocab] float32 logits."""
        return self.lm_head(hidden).float()
