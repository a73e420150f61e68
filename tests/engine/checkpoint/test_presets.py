"""The built-in model shapes (locus/engine/checkpoint/presets.py)."""

from __future__ import annotations

import torch

from locus.engine.model.model import Llama4ForCausalLM
from locus.engine.checkpoint.presets import PRESETS


def test_scout_2l_has_two_layers_of_llama4_scouts_shapes():
    """Built on the meta device (no memory): what a GPU measurement of `scout-2l` would allocate."""
    config = PRESETS["scout-2l"]
    with torch.device("meta"):
        model = Llama4ForCausalLM(config)
    layer = model.model.layers[0]
    assert all(layer.is_moe for layer in model.model.layers) and len(model.model.layers) == 2
    assert tuple(layer.feed_forward.experts.gate_up_proj.shape) == (16, 5120, 2 * 8192)
    assert tuple(layer.feed_forward.experts.down_proj.shape) == (16, 8192, 5120)
    assert tuple(layer.self_attn.q_proj.weight.shape) == (40 * 128, 5120)
    assert tuple(layer.self_attn.k_proj.weight.shape) == (8 * 128, 5120)
    assert tuple(model.lm_head.weight.shape) == (202048, 5120)
    assert config.num_experts_per_tok == 1 and config.dtype == "bfloat16"
    assert sum(p.numel() for p in model.parameters()) == 6_473_180_160
