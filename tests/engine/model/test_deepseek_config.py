"""DeepSeek-V3 / V2 config.json -> Locus's model config: the published shapes, transformers' defaults and
layer rules, and one-line refusals of what Locus does not implement."""

from __future__ import annotations

import json

import pytest
import torch

from locus.engine.model.config import config_from_hf_dict
from locus.engine.model.deepseek_config import DeepseekModelConfig
from locus.engine.model.kv_cache import PagedKVCache
from locus.errors import LocusError

# The fields of the published DeepSeek-V3 and DeepSeek-V2-Lite config.json files (shapes only).
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_nextn_predict_layers": 1, "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1,
    "n_routed_experts": 256, "ep_size": 1, "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8,
    "topk_group": 4, "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3,
    "norm_topk_prob": True, "scoring_func": "sigmoid", "hidden_act": "silu", "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-06, "tie_word_embeddings": False, "rope_theta": 10000, "bos_token_id": 0, "eos_token_id": 1,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "attention_bias": False, "torch_dtype": "bfloat16",
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
}
DEEPSEEK_V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": 102400,
    "hidden_size": 2048, "intermediate_size": 10944, "moe_intermediate_size": 1408, "num_hidden_layers": 27,
    "num_attention_heads": 16, "num_key_value_heads": 16, "n_shared_experts": 2, "n_routed_experts": 64,
    "ep_size": 1, "routed_scaling_factor": 1.0, "kv_lora_rank": 512, "q_lora_rank": None, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "greedy", "n_group": 1, "topk_group": 1,
    "num_experts_per_tok": 6, "moe_layer_freq": 1, "first_k_dense_replace": 1, "norm_topk_prob": False,
    "scoring_func": "softmax", "hidden_act": "silu", "max_position_embeddings": 163840, "rms_norm_eps": 1e-06,
    "rope_theta": 10000, "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707,
                                          "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096,
                                          "type": "yarn"},
    "bos_token_id": 100000, "eos_token_id": 100001, "torch_dtype": "bfloat16",
}


def test_deepseek_v3_maps_onto_locus_fields():
    c = config_from_hf_dict(DEEPSEEK_V3)
    assert isinstance(c, DeepseekModelConfig) and c.family == "deepseek" and c.model_type == "deepseek_v3"
    assert (c.intermediate_size, c.intermediate_size_mlp, c.num_local_experts) == (2048, 18432, 256)
    assert (c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim) == (1536, 512, 128, 64, 128)
    assert (c.n_group, c.topk_group, c.num_experts_per_tok, c.routed_scaling_factor) == (8, 4, 8, 2.5)
    assert c.moe_layers == tuple(range(3, 61)) and c.head_dim == 64
    assert c.rope.rope_type == "yarn" and (c.rope.factor, c.rope.mscale_all_dim) == (40.0, 1.0)
    assert c.rope.original_max_position_embeddings == 4096


def test_deepseek_v2_lite_maps_onto_locus_fields():
    c = config_from_hf_dict(DEEPSEEK_V2_LITE)
    assert c.model_type == "deepseek_v2" and c.q_lora_rank is None and c.topk_method == "greedy"
    assert c.moe_layers == tuple(range(1, 27)) and c.n_shared_experts == 2 and c.num_experts_per_tok == 6
    assert c.rope.mscale == pytest.approx(0.707)


def test_kv_cache_bytes_are_the_latent_and_the_rope_key():
    """61 layers x (512 + 64) x 2 bytes for V3 in bfloat16: the compressed form, not 128 heads of k and v."""
    v3 = config_from_hf_dict(DEEPSEEK_V3)
    assert PagedKVCache.bytes_per_block(v3, 1, torch.bfloat16) == 61 * (512 + 64) * 2 == 70272
    v2 = config_from_hf_dict(DEEPSEEK_V2_LITE)
    assert PagedKVCache.bytes_per_block(v2, 1, torch.bfloat16) == 27 * 576 * 2


def test_dense_layer_rule_with_moe_layer_freq():
    c = config_from_hf_dict({**DEEPSEEK_V2_LITE, "num_hidden_layers": 8, "first_k_dense_replace": 2,
                             "moe_layer_freq": 3})
    assert c.moe_layers == (3, 6)


def test_defaults_are_transformers():
    transformers = pytest.importorskip("transformers")
    for model_type, cls in (("deepseek_v3", transformers.DeepseekV3Config),
                            ("deepseek_v2", transformers.DeepseekV2Config)):
        fields = {"num_experts_per_tok": 6} if model_type == "deepseek_v2" else {}
        hf = cls(**fields)
        ours = config_from_hf_dict({"model_type": model_type, **fields})
        assert ours.moe_layers == tuple(range(hf.first_k_dense_replace, hf.num_hidden_layers))
        assert (ours.num_local_experts, ours.num_experts_per_tok, ours.n_shared_experts) == \
               (hf.n_routed_experts, hf.num_experts_per_tok, hf.n_shared_experts)
        assert (ours.q_lora_rank, ours.kv_lora_rank, ours.v_head_dim) == (hf.q_lora_rank, hf.kv_lora_rank, hf.v_head_dim)
        assert (ours.intermediate_size, ours.intermediate_size_mlp) == (hf.moe_intermediate_size, hf.intermediate_size)
        assert ours.routed_scaling_factor == hf.routed_scaling_factor and ours.eos_token_ids == (hf.eos_token_id,)


def test_to_hf_dict_is_read_back_by_locus():
    for raw in (DEEPSEEK_V3, DEEPSEEK_V2_LITE):
        c = config_from_hf_dict({k: v for k, v in raw.items() if k != "quantization_config"})
        assert config_from_hf_dict(c.to_hf_dict()) == c


@pytest.mark.parametrize("change, field", [
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 64]}}, "quantization_config"),
    ({"quantization_config": {"quant_method": "awq", "bits": 4}}, "quantization_config"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_type 'dynamic'"),
    ({"topk_method": "group_limited_greedy"}, "topk_method"),
    ({"scoring_func": "softmax"}, "scoring_func"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"ep_size": 8}, "ep_size"),
    ({"n_group": 3}, "n_group"),
    ({"topk_group": 9}, "topk_group"),
])
def test_unsupported_v3_values_are_refused_naming_the_field(change, field):
    with pytest.raises(LocusError) as err:
        config_from_hf_dict({**DEEPSEEK_V3, **change}, "ck/config.json")
    message = str(err.value)
    assert message.startswith("ck/config.json") and field in message and "\n" not in message


@pytest.mark.parametrize("change, field", [
    ({"topk_method": "noaux_tc"}, "topk_method"),
    ({"norm_topk_prob": True}, "norm_topk_prob"),
    ({"num_experts_per_tok": None}, "num_experts_per_tok"),
])
def test_unsupported_v2_values_are_refused_naming_the_field(change, field):
    with pytest.raises(LocusError) as err:
        config_from_hf_dict({**DEEPSEEK_V2_LITE, **change}, "ck/config.json")
    assert field in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("config", [
    {"model_type": "deepseek_v3", "num_hidden_layers": 61},  # first_k_dense_replace defaults to 3
    {"model_type": "deepseek_v2", "num_hidden_layers": 27, "num_experts_per_tok": 6},  # and to 0
    {**DEEPSEEK_V2_LITE, "num_hidden_layers": 9, "first_k_dense_replace": 2, "moe_layer_freq": 2},
    DEEPSEEK_V3,
])
def test_locus_plan_reads_the_moe_layers_the_engine_does(tmp_path, config):
    """routing/plan/model_layers.py restates the rule (routing may not import the engine)."""
    from locus.routing.plan.model_layers import model_moe_layers

    (tmp_path / "config.json").write_text(json.dumps(config))
    assert model_moe_layers(str(tmp_path)) == config_from_hf_dict(config).moe_layers
