"""Qwen3-MoE config.json -> Locus's model config: transformers' defaults and layer rules, and one-line
refusals of what Locus does not implement."""

from __future__ import annotations

import json

import pytest

from locus.engine.model.config import config_from_hf_dict, load_config
from locus.engine.model.qwen3_config import Qwen3MoeModelConfig
from locus.errors import LocusError

# The fields of a published Qwen3-30B-A3B config.json (shapes only; no weights are needed to parse it).
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "decoder_sparse_step": 1, "eos_token_id": 151645, "head_dim": 128,
    "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02, "intermediate_size": 6144,
    "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [], "model_type": "qwen3_moe",
    "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32, "num_experts": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4, "output_router_logits": False,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
    "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936,
}


def test_a_published_config_maps_onto_locus_fields():
    c = config_from_hf_dict(QWEN3_30B_A3B)
    assert isinstance(c, Qwen3MoeModelConfig) and c.family == "qwen3_moe"
    assert (c.intermediate_size, c.intermediate_size_mlp) == (768, 6144)  # experts, dense layers
    assert (c.num_local_experts, c.num_experts_per_tok, c.norm_topk_prob) == (128, 8, True)
    assert c.moe_layers == tuple(range(48)) and all(c.uses_rope(i) for i in range(48))
    assert (c.head_dim, c.num_key_value_heads, c.attention_chunk_size) == (128, 4, None)
    assert c.rope.theta == 1000000.0 and c.rope.rope_type == "default"
    assert c.eos_token_ids == (151645,) and c.dtype == "bfloat16"


def test_defaults_and_dense_layer_rules_are_transformers():
    transformers = pytest.importorskip("transformers")
    for fields in ({}, {"decoder_sparse_step": 3, "num_hidden_layers": 7}, {"mlp_only_layers": [0, 5], "num_hidden_layers": 6}):
        hf = transformers.Qwen3MoeConfig(**fields)
        ours = config_from_hf_dict({"model_type": "qwen3_moe", **fields})
        hf_moe = tuple(i for i in range(hf.num_hidden_layers) if i not in hf.mlp_only_layers
                       and (i + 1) % hf.decoder_sparse_step == 0)
        assert ours.moe_layers == hf_moe
        assert (ours.num_key_value_heads, ours.num_local_experts, ours.num_experts_per_tok) == \
               (hf.num_key_value_heads, hf.num_experts, hf.num_experts_per_tok)
        assert (ours.intermediate_size, ours.intermediate_size_mlp) == (hf.moe_intermediate_size, hf.intermediate_size)
        assert ours.rope.theta == hf.rope_parameters["rope_theta"] and ours.rms_norm_eps == hf.rms_norm_eps


def test_to_hf_dict_is_read_back_by_transformers_and_by_locus():
    transformers = pytest.importorskip("transformers")
    c = config_from_hf_dict({**QWEN3_30B_A3B, "mlp_only_layers": [3], "decoder_sparse_step": 2})
    d = c.to_hf_dict()
    assert config_from_hf_dict(d) == c
    hf = transformers.Qwen3MoeConfig(**{k: v for k, v in d.items() if k not in ("model_type", "architectures")})
    assert (hf.moe_intermediate_size, hf.num_experts, hf.mlp_only_layers) == (768, 128, [3])


@pytest.mark.parametrize("change, message", [
    ({"use_sliding_window": True, "sliding_window": 4096},
     "use_sliding_window is true: Locus does not implement Qwen3's sliding-window attention"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"num_experts": 0}, "num_experts 0 (a dense-only model) is not supported"),
    ({"num_local_experts": 64}, "num_experts (128) and num_local_experts (64) disagree"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "unknown rope_type 'yarn'"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step must be >= 1, got 0"),
    ({"mlp_only_layers": [48]}, "mlp_only_layers [48] names a layer outside 0..47"),
    ({"num_experts_per_tok": 129}, "num_experts_per_tok (129) must be in 1..num_local_experts (128)"),
    ({"model_type": "qwen2_moe"}, "model_type 'qwen2_moe' is not a Llama-4 text model (supported: llama4, llama4_text, qwen3_moe, deepseek_v3, deepseek_v2)"),
])
def test_an_unsupported_value_is_one_line_naming_the_field(tmp_path, change, message):
    (tmp_path / "config.json").write_text(json.dumps({**QWEN3_30B_A3B, **change}))
    with pytest.raises(LocusError) as err:
        load_config(tmp_path)
    text = str(err.value)
    assert message in text and "\n" not in text and str(tmp_path / "config.json") in text


@pytest.mark.parametrize("fields", [{}, {"decoder_sparse_step": 2}, {"mlp_only_layers": [0, 7, 8]},
                                    {"decoder_sparse_step": 3, "mlp_only_layers": [2]}])
def test_the_planners_reader_of_moe_layers_agrees_with_the_engine(tmp_path, fields):
    """routing/ restates the rule (it may not import the engine): `locus plan import --model DIR` reads
    the MoE layers the engine builds."""
    from locus.routing.plan.model_layers import model_moe_layers

    raw = {**QWEN3_30B_A3B, "num_hidden_layers": 12, **fields}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    assert model_moe_layers(str(tmp_path)) == load_config(tmp_path).moe_layers


def test_kv_bytes_per_token_are_docs_models_figures():
    """docs/models.md's KV table: 2 x layers x KV heads x head_dim x dtype bytes, what the paged pool holds."""
    import torch

    from locus.engine.checkpoint.presets import PRESETS
    from locus.engine.model.kv_cache import PagedKVCache

    assert PagedKVCache.bytes_per_block(config_from_hf_dict(QWEN3_30B_A3B), 1, torch.bfloat16) == 98_304
    assert PagedKVCache.bytes_per_block(PRESETS["tiny-qwen3-moe"], 1, torch.float32) == 1_024
