"""The built-in model shapes (locus/engine/checkpoint/presets.py)."""

from __future__ import annotations

import pytest
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


def test_tiny_qwen3_moe_written_by_init_model_is_read_by_transformers_with_the_same_logits(tmp_path):
    """`locus init-model --preset tiny-qwen3-moe` writes what transformers' Qwen3MoeForCausalLM loads
    (its config.json and key names), and both compute the same logits."""
    transformers = pytest.importorskip("transformers")
    from locus.cli import main
    from locus.engine.checkpoint.loader import load
    from locus.engine.model.forward_batch import ForwardBatch

    out = tmp_path / "ck"
    assert main(["init-model", "--preset", "tiny-qwen3-moe", "--out", str(out)]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
    assert type(hf).__name__ == "Qwen3MoeForCausalLM"
    ours = load("tiny-qwen3-moe", device="cpu").model
    assert [i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "gate")] == [0, 1, 3] == \
        list(ours.config.moe_layers)
    ids = [1, 72, 101, 108, 108, 111] * 6
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0].float()
        got = ours.compute_logits(ours(ForwardBatch.single(ids)).hidden)
    assert (got - expected).abs().max().item() < 1e-4 and expected.std() > 0.1
