"""Qwen3-MoE checkpoints: Locus reads and writes the published tensor names, and a checkpoint it
cannot serve is refused in one line naming the tensor or field."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from locus.engine.checkpoint.presets import build_preset
from locus.engine.checkpoint.weights import load_model, save_checkpoint
from locus.engine.model.forward_batch import ForwardBatch
from locus.errors import LocusError


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    model = build_preset("tiny-qwen3-moe", seed=3)
    return model, save_checkpoint(model, tmp_path_factory.mktemp("q") / "ck")


def test_save_writes_the_published_names_and_loads_back_identically(written):
    model, path = written
    names = set(load_file(str(path / "model.safetensors")))
    assert {"model.layers.0.mlp.gate.weight", "model.layers.0.mlp.experts.15.down_proj.weight",
            "model.layers.2.mlp.gate_proj.weight", "model.layers.1.self_attn.q_norm.weight"} <= names
    assert not any("feed_forward" in n or "shared_expert" in n for n in names)
    assert json.loads((path / "config.json").read_text())["model_type"] == "qwen3_moe"
    ids = [1, 40, 50, 60, 70, 80]
    back = load_model(path)
    with torch.no_grad():
        assert torch.equal(back.compute_logits(back(ForwardBatch.single(ids)).hidden),
                           model.compute_logits(model(ForwardBatch.single(ids)).hidden))


def rewrite(src, dst, tensors=lambda t: t, config=lambda c: c):
    dst.mkdir()
    save_file(tensors(load_file(str(src / "model.safetensors"))), str(dst / "model.safetensors"), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config(json.loads((src / "config.json").read_text()))))
    return dst


def without(name):
    return lambda t: {k: v for k, v in t.items() if k != name}


def plus(name, tensor):
    return lambda t: {**t, name: tensor}


@pytest.mark.parametrize("tensors, config, message", [
    (without("model.layers.0.mlp.gate.weight"), None, "checkpoint is missing tensor 'model.layers.0.mlp.gate.weight'"),
    (without("model.layers.3.mlp.experts.7.up_proj.weight"), None,
     "(and per-expert 'model.layers.3.mlp.experts.7.up_proj.weight')"),
    (plus("model.layers.0.mlp.experts.gate_up_proj", torch.zeros(16, 64, 64)), None,
     "tensor 'model.layers.0.mlp.experts.gate_up_proj': Locus reads Qwen3-MoE experts one by one"),
    (plus("model.layers.0.mlp.shared_expert.gate_proj.weight", torch.zeros(4, 4)), None,
     "tensors the Qwen3-MoE model does not have: model.layers.0.mlp.shared_expert.gate_proj.weight"),
    (None, lambda c: {**c, "quantization_config": {"quant_method": "fbgemm_fp8"}},
     "quantization_config (fbgemm_fp8): pre-quantized Qwen3-MoE checkpoints are not supported"),
    (None, lambda c: {**c, "use_sliding_window": True, "sliding_window": 64}, "use_sliding_window is true"),
])
def test_what_locus_cannot_serve_is_one_line(written, tmp_path, tensors, config, message):
    path = rewrite(written[1], tmp_path / "bad", tensors or (lambda t: t), config or (lambda c: c))
    with pytest.raises(LocusError) as err:
        load_model(path)
    assert message in str(err.value) and "\n" not in str(err.value)
