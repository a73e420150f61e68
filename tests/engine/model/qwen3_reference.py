"""Random tiny transformers Qwen3MoeForCausalLM checkpoints, the parity reference for Locus's Qwen3-MoE."""

from __future__ import annotations

import torch

QWEN3_CONFIG = dict(
    vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
    norm_topk_prob=False, decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=256,
    tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    # As in hf_reference.py: a larger init than 0.02 so that a wrong rule shows as a large logit difference.
    initializer_range=0.15, bos_token_id=1, eos_token_id=2, pad_token_id=0,
)


def make_qwen3_model(seed: int = 0, **overrides):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(**{**QWEN3_CONFIG, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    return Qwen3MoeForCausalLM(config).eval()
