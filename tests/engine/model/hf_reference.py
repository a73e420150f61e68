"""Random tiny transformers Llama4ForCausalLM checkpoints, the parity reference for Locus's model."""

from __future__ import annotations

from pathlib import Path

import torch

BASE_CONFIG = dict(
    vocab_size=300, hidden_size=64, intermediate_size=48, intermediate_size_mlp=96, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=1,
    interleave_moe_layer_step=1, attention_chunk_size=16, use_qk_norm=True, attn_temperature_tuning=True,
    floor_scale=4, attn_scale=0.5, max_position_embeddings=256, tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    # A larger init than the default 0.02 makes logits, routing and attention patterns vary enough
    # that a wrong rule shows up as a large logit difference.
    initializer_range=0.15, bos_token_id=1, eos_token_id=2, pad_token_id=0,
)


def make_hf_model(seed: int = 0, **overrides):
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    config = Llama4TextConfig(**{**BASE_CONFIG, **overrides})
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = Llama4ForCausalLM(config).eval()
    return model


def save_hf_model(model, path: Path) -> Path:
    model.save_pretrained(str(path), safe_serialization=True)
    return path


def prompt_ids(n: int = 48, vocab: int = 300, seed: int = 1) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


@torch.no_grad()
def hf_logits(model, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0].float()
