"""The MoE layers a model directory or a trace preset gives `locus plan import`
(locus/routing/plan/model_layers.py), checked against the engine's own config reader."""

from __future__ import annotations

import json

import pytest

from locus.engine.checkpoint.presets import PRESETS as ENGINE_PRESETS
from locus.engine.model.config import config_from_hf_dict
from locus.errors import LocusError
from locus.routing.plan.model_layers import config_moe_layers, model_moe_layers
from locus.traces.presets import PRESETS as TRACE_PRESETS

CONFIGS = [
    {"num_hidden_layers": 4},  # no step: every layer (transformers' default step is 1)
    {"model_type": "llama4_text", "num_hidden_layers": 48, "interleave_moe_layer_step": 2},  # Maverick
    {"model_type": "llama4_text", "num_hidden_layers": 6, "interleave_moe_layer_step": 3},
    {"model_type": "llama4_text", "num_hidden_layers": 6, "moe_layers": [0, 2, 5], "interleave_moe_layer_step": 2},
    {"model_type": "llama4", "text_config": {"num_hidden_layers": 8, "interleave_moe_layer_step": 2}},
    {"model_type": "llama4", "text_config": {"model_type": "llama4_text", "num_hidden_layers": 4,
                                             "moe_layers": [1, 3]}, "vision_config": {}},
]


@pytest.mark.parametrize("config", CONFIGS)
def test_a_config_gives_the_moe_layers_the_engine_reads(tmp_path, config):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert config_moe_layers(path) == config_from_hf_dict(config).moe_layers
    assert model_moe_layers(str(tmp_path)) == config_from_hf_dict(config).moe_layers


@pytest.mark.parametrize("name", sorted(ENGINE_PRESETS))
def test_a_saved_engine_preset_gives_its_moe_layers(tmp_path, name):
    """What `locus init-model` writes (to_hf_dict: moe_layers explicit) reads back the same."""
    config = ENGINE_PRESETS[name]
    (tmp_path / "config.json").write_text(json.dumps(config.to_hf_dict()))
    assert model_moe_layers(str(tmp_path)) == tuple(config.moe_layers)


def test_trace_presets_give_their_moe_layers_and_other_names_none():
    assert model_moe_layers("llama4-maverick") == tuple(range(1, 48, 2))
    assert model_moe_layers("LLAMA4-SCOUT") == tuple(range(48))
    assert all(model_moe_layers(name) == tuple(p.moe_layers) for name, p in TRACE_PRESETS.items())
    assert model_moe_layers("my-moe") is None


@pytest.mark.parametrize("config, message", [
    ([1, 2], "expected a JSON object"),
    ({"model_type": "llama4", "text_config": 3}, "text_config must be an object"),
    ({"model_type": "mixtral", "num_hidden_layers": 32}, "model_type 'mixtral' is not a Llama-4 model"),
    ({"model_type": "llama4", "text_config": {"model_type": "qwen3_moe"}}, "model_type 'qwen3_moe'"),
    ({"num_hidden_layers": "four"}, "is not an integer"),
    ({"num_hidden_layers": 4, "interleave_moe_layer_step": 0}, "interleave_moe_layer_step must be >= 1, got 0"),
    ({"num_hidden_layers": 2, "interleave_moe_layer_step": 3}, "names no layer"),
])
def test_a_config_that_does_not_give_them_is_refused_naming_the_file(tmp_path, config, message):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(LocusError, match=message) as e:
        model_moe_layers(str(tmp_path))
    assert str(path) in str(e.value) and "\n" not in str(e.value)
