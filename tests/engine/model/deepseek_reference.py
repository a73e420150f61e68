"""Random tiny transformers DeepseekV3ForCausalLM / DeepseekV2ForCausalLM checkpoints, the parity
reference for Locus's DeepSeek family."""

from __future__ import annotations

import torch

COMMON = dict(
    vocab_size=300, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, kv_lora_rank=16,
    qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, max_position_embeddings=256, tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    # As in hf_reference.py: a larger init than 0.02 so that a wrong rule shows as a large logit difference.
    initializer_range=0.15, bos_token_id=1, eos_token_id=2, pad_token_id=0,
)
V3_CONFIG = dict(COMMON, q_lora_rank=24, n_group=2, topk_group=1, first_k_dense_replace=1, n_shared_experts=1,
                 routed_scaling_factor=2.5, norm_topk_prob=True)
V2_CONFIG = dict(COMMON, q_lora_rank=None, first_k_dense_replace=1, n_shared_experts=2, topk_method="greedy")


def make_deepseek_model(version: str = "v3", seed: int = 0, **overrides):
    """A random model; V3's e_score_correction_bias (zero at init) is drawn too, so that choosing by the
    biased score and weighing by the unbiased one differ."""
    import transformers

    if version == "v3":
        config = transformers.DeepseekV3Config(**{**V3_CONFIG, **overrides})
        cls = transformers.DeepseekV3ForCausalLM
    else:
        config = transformers.DeepseekV2Config(**{**V2_CONFIG, **overrides})
        cls = transformers.DeepseekV2ForCausalLM
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            bias = getattr(getattr(layer.mlp, "gate", None), "e_score_correction_bias", None)
            if bias is not None:
                bias.copy_(torch.randn(bias.shape) * 0.3)
    return model
