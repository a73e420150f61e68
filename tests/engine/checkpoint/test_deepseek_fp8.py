"""DeepSeek-V3's block-scaled FP8 checkpoints (E4M3 weights with 128x128 `weight_scale_inv`) load
dequantized: a checkpoint written in FP8 gives the logits of its dequantized float twin."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from locus.engine.checkpoint.fp8_blocks import dequantize_blocks, quantize_blocks
from locus.engine.checkpoint.weights import load_model
from locus.engine.model.forward_batch import ForwardBatch
from locus.errors import LocusError
from tests.engine.model.deepseek_reference import make_deepseek_model
from tests.engine.model.hf_reference import prompt_ids, save_hf_model

pytest.importorskip("transformers")

FP8_CONFIG = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic", "fmt": "e4m3"}
# Widths past one 128 block, and not multiples of it, so that partial blocks are exercised.
SHAPES = dict(hidden_size=160, intermediate_size=200, moe_intermediate_size=136, kv_lora_rank=144, q_lora_rank=136)


def converted(name: str) -> bool:
    """DeepSeek-V3 converts its projections; embeddings, lm_head, norms and the router stay float."""
    return name.endswith("proj.weight") or name.endswith("proj_with_mqa.weight")


def write_pair(root: Path) -> tuple[Path, Path]:
    """An FP8 checkpoint and its dequantized float twin, from one random transformers model."""
    float_dir = save_hf_model(make_deepseek_model("v3", seed=3, **SHAPES), root / "float")
    tensors = load_file(str(float_dir / "model.safetensors"))
    fp8, twin = {}, {}
    for name, tensor in tensors.items():
        if converted(name):
            q, scale_inv = quantize_blocks(tensor)
            fp8[name], fp8[name + "_scale_inv"] = q, scale_inv
            twin[name] = dequantize_blocks(q, scale_inv, name)
        else:
            fp8[name] = twin[name] = tensor
    config = json.loads((float_dir / "config.json").read_text())
    out = []
    for label, content, quant in (("fp8", fp8, FP8_CONFIG), ("twin", twin, None)):
        d = root / label
        d.mkdir()
        save_file(content, str(d / "model.safetensors"), metadata={"format": "pt"})
        (d / "config.json").write_text(json.dumps({**config, "quantization_config": quant} if quant else config))
        out.append(d)
    return out[0], out[1]


def logits(model_dir: Path, ids: list[int]) -> torch.Tensor:
    model = load_model(model_dir)
    with torch.no_grad():
        return model.compute_logits(model(ForwardBatch.single(ids)).hidden)


def test_fp8_checkpoint_equals_its_dequantized_twin(tmp_path):
    fp8, twin = write_pair(tmp_path)
    held = load_file(str(fp8 / "model.safetensors"))
    assert held["model.layers.1.mlp.experts.0.gate_proj.weight"].dtype == torch.float8_e4m3fn
    assert tuple(held["model.layers.0.self_attn.kv_b_proj.weight_scale_inv"].shape) == (1, 2)  # 4*(16+12) x 144
    ids = prompt_ids(32)
    got, expected = logits(fp8, ids), logits(twin, ids)
    assert (got - expected).abs().max().item() < 1e-5
    # and the FP8 weights are the model's, not a degenerate stand-in: correlated with the float original
    original = logits(tmp_path / "float", ids)
    corr = torch.corrcoef(torch.stack([got.flatten(), original.flatten()]))[0, 1].item()
    assert corr > 0.7  # E4M3's 3 mantissa bits compound through 4 layers at the tests' large init


def test_block_scales_apply_per_block():
    weight = torch.randn(200, 300)
    q, scale_inv = quantize_blocks(weight)
    assert tuple(scale_inv.shape) == (2, 3)
    back = dequantize_blocks(q, scale_inv, "w")
    assert (back - weight).abs().max() <= weight.abs().max() * 2 ** -3  # E4M3 keeps 3 mantissa bits
    scale_inv[1, 2] *= 2  # one block's scale reaches only that block
    doubled = dequantize_blocks(q, scale_inv, "w")
    assert torch.equal(doubled[:128], back[:128]) and torch.equal(doubled[128:, :256], back[128:, :256])
    assert torch.allclose(doubled[128:, 256:], 2 * back[128:, 256:])


def test_a_missing_or_misshapen_scale_is_one_error_naming_the_tensor(tmp_path):
    fp8, _ = write_pair(tmp_path)
    tensors = load_file(str(fp8 / "model.safetensors"))
    name = "model.layers.0.self_attn.o_proj.weight"
    for label, change in (("missing", lambda t: t.pop(name + "_scale_inv")),
                          ("misshapen", lambda t: t.__setitem__(name + "_scale_inv", torch.ones(3, 3)))):
        broken = tmp_path / label
        shutil.copytree(fp8, broken)
        edited = dict(tensors)
        change(edited)
        save_file(edited, str(broken / "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(LocusError, match=name.replace(".", r"\.")) as err:
            load_model(broken)
        assert "\n" not in str(err.value)


def test_other_quantization_is_refused_at_load(tmp_path):
    fp8, _ = write_pair(tmp_path)
    config = json.loads((fp8 / "config.json").read_text())
    config["quantization_config"] = {**FP8_CONFIG, "weight_block_size": [64, 64]}
    (fp8 / "config.json").write_text(json.dumps(config))
    with pytest.raises(LocusError, match="weight_block_size"):
        load_model(fp8)


def test_multi_token_prediction_layers_are_skipped(tmp_path):
    """DeepSeek-V3's published checkpoints hold the MTP layer as model.layers.{num_hidden_layers}.*;
    Locus, as transformers, builds the model without it and loads the rest unchanged."""
    fp8, twin = write_pair(tmp_path)
    tensors = load_file(str(twin / "model.safetensors"))
    extra = {name.replace("model.layers.3.", "model.layers.4.", 1): t.clone() for name, t in tensors.items()
             if name.startswith("model.layers.3.")}
    extra["model.layers.4.eh_proj.weight"] = torch.zeros(160, 320)
    with_mtp = tmp_path / "mtp"
    shutil.copytree(twin, with_mtp)
    save_file({**tensors, **extra}, str(with_mtp / "model.safetensors"), metadata={"format": "pt"})
    ids = prompt_ids(16)
    assert torch.equal(logits(with_mtp, ids), logits(twin, ids))
