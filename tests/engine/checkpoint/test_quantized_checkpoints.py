"""Pre-quantized checkpoints (locus/engine/checkpoint/quantized.py): Meta's FBGEMM FP8 layout and
gpt-oss-style MXFP4 experts, written small here, against their dequantized twins and (the twin, whose
values the FP8 checkpoint stands for) against transformers; malformed ones refused by name."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from locus.engine.checkpoint.quantize import moe_layers
from locus.engine.checkpoint.weights import load_model
from locus.engine.model.forward_batch import ForwardBatch
from locus.errors import LocusError
from locus.kernels.formats import QuantizedTensor
from tests.engine.checkpoint.quantized_checkpoints import write_quantized
from tests.engine.model.hf_reference import hf_logits, make_hf_model, prompt_ids, save_hf_model

IDS = prompt_ids(40)
KEEP = ["model.layers.0.self_attn", "model.layers.*.feed_forward.router", "lm_head"]  # three rule kinds


def logits_of(model, ids=IDS):
    with torch.no_grad():
        return model.compute_logits(model(ForwardBatch.single(ids)).hidden)


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    pytest.importorskip("transformers")
    # hidden 64 and expert width 64: MXFP4 blocks need both input sizes to be multiples of 32
    hf = make_hf_model(seed=5, intermediate_size=64, num_experts_per_tok=1)
    return save_hf_model(hf, tmp_path_factory.mktemp("hf") / "ck"), hf


@pytest.fixture(scope="module")
def fp8(hf_checkpoint, tmp_path_factory):
    return write_quantized(load_model(hf_checkpoint[0]), hf_checkpoint[0], tmp_path_factory.mktemp("fp8"),
                           "fbgemm_fp8", KEEP)


@pytest.fixture(scope="module")
def mxfp4(hf_checkpoint, tmp_path_factory):
    return write_quantized(load_model(hf_checkpoint[0]), hf_checkpoint[0], tmp_path_factory.mktemp("mx"), "mxfp4",
                           ["model.layers.1"])


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_fp8_checkpoint_matches_its_dequantized_twin(fp8, backend):
    q, twin = fp8
    model = load_model(q, moe_backend=backend)
    for experts in moe_layers(model):
        assert experts.weight_format == "fp8" and isinstance(experts.down_proj, QuantizedTensor)
        assert experts.down_proj.scale.shape == (4, 1, 64)  # [E, 1, H]: the checkpoint's [E, H, 1] turned
    torch.testing.assert_close(logits_of(model), logits_of(load_model(twin, moe_backend=backend)), atol=1e-4, rtol=1e-4)


def test_fp8_checkpoint_against_transformers(fp8, hf_checkpoint):
    """transformers reads fbgemm_fp8 only on a GPU with fbgemm-gpu: it runs the twin (the values the
    FP8 tensors stand for) instead, and the original float model for scale."""
    from transformers import Llama4ForCausalLM

    q, twin = fp8
    ours = logits_of(load_model(q))
    hf_twin = Llama4ForCausalLM.from_pretrained(str(twin), torch_dtype=torch.float32, attn_implementation="eager")
    torch.testing.assert_close(ours, hf_logits(hf_twin.eval(), IDS), atol=2e-4, rtol=2e-4)
    original = hf_logits(hf_checkpoint[1], IDS)
    # what FP8 costs (0.15 here: these random weights are drawn large so that any wrong rule shows;
    # bench/quantized_quality.py measures the trained model)
    assert 0 < ((ours - original).norm() / original.norm()).item() < 0.3


def test_modules_to_not_convert_stay_float(fp8, hf_checkpoint):
    q, _ = fp8
    tensors = load_file(str(q / "model.safetensors"))
    assert tensors["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float32  # a prefix rule
    assert tensors["model.layers.1.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    assert tensors["model.layers.2.feed_forward.router.weight"].dtype == torch.float32  # a regex rule
    assert tensors["model.layers.2.feed_forward.shared_expert.up_proj.weight"].dtype == torch.float8_e4m3fn
    assert tensors["lm_head.weight"].dtype == torch.float32
    float_model, model = load_model(hf_checkpoint[0]), load_model(q)
    assert torch.equal(model.model.layers[0].self_attn.q_proj.weight, float_model.model.layers[0].self_attn.q_proj.weight)
    scale = tensors["model.layers.1.self_attn.q_proj.weight_scale"]
    assert torch.equal(model.model.layers[1].self_attn.q_proj.weight,
                       tensors["model.layers.1.self_attn.q_proj.weight"].float() * scale)


def test_multimodal_prefix(fp8, tmp_path, hf_checkpoint):
    q, twin = write_quantized(load_model(hf_checkpoint[0]), hf_checkpoint[0], tmp_path, "fbgemm_fp8",
                              ["language_model.model.layers.0.self_attn", "router", "lm_head"], prefix="language_model.")
    tensors = load_file(str(q / "model.safetensors"))
    assert tensors["language_model.model.layers.0.self_attn.k_proj.weight"].dtype == torch.float32
    torch.testing.assert_close(logits_of(load_model(q)), logits_of(load_model(twin)), atol=1e-4, rtol=1e-4)


def test_a_ranks_slice_reads_only_its_experts(fp8):
    q, _ = fp8
    slices = {layer: [3, 1] for layer in range(4)}
    model = load_model(q, expert_slices=slices)
    whole = load_model(q)
    for layer in range(4):
        held, full = (m.model.layers[layer].feed_forward.experts for m in (model, whole))
        assert held.gate_up_proj.shape == (2, 64, 128)
        assert torch.equal(held.gate_up_proj.dequantize(), full.gate_up_proj.dequantize()[[3, 1]])
        assert torch.equal(held.down_proj.scale, full.down_proj.scale[[3, 1]])


def test_triton_backend_keeps_experts_fp8(fp8, caplog):
    """The Triton kernels read FP8 experts as they are: nothing is dequantized at load, and the load
    log names the path (the interpreter's form here)."""
    q, _ = fp8
    with caplog.at_level("INFO", logger="locus.engine"):
        model = load_model(q, moe_backend="triton")
    assert all(e.weight_format == "fp8" for e in moe_layers(model))
    assert "routed experts of 4 MoE layers held in fp8; the Triton kernels read them narrow with the 'dequant' dot " \
           "form" in caplog.text


@pytest.mark.slow  # two models through the Triton interpreter
def test_fp8_checkpoint_on_triton_matches_its_twin(fp8):
    q, twin = fp8
    torch.testing.assert_close(logits_of(load_model(q, moe_backend="triton")),
                               logits_of(load_model(twin, moe_backend="triton")), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_mxfp4_experts_match_their_twin(mxfp4, backend):
    q, twin = mxfp4
    model = load_model(q, moe_backend=backend)
    formats = [e.weight_format for e in moe_layers(model)]
    assert formats == ["mxfp4", None, "mxfp4", "mxfp4"]  # layer 1 is in modules_to_not_convert
    torch.testing.assert_close(logits_of(model), logits_of(load_model(twin, moe_backend=backend)), atol=1e-4, rtol=1e-4)


# ---- malformed checkpoints: one message naming the tensor or field

def rewrite(src, dst, drop=(), change=None, config=None):
    import shutil

    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    for name in drop:
        del tensors[name]
    for name, value in (change or {}).items():
        tensors[name] = value
    save_file(tensors, str(dst / "model.safetensors"))
    if config:
        body = json.loads((dst / "config.json").read_text())
        body["quantization_config"].update(config)
        (dst / "config.json").write_text(json.dumps(body))
    return dst


def test_missing_scale_is_refused(fp8, tmp_path):
    bad = rewrite(fp8[0], tmp_path / "b", drop=["model.layers.1.self_attn.o_proj.weight_scale"])
    with pytest.raises(LocusError, match=r"missing tensor 'model\.layers\.1\.self_attn\.o_proj\.weight_scale'"):
        load_model(bad)
    bad = rewrite(fp8[0], tmp_path / "c", drop=["model.layers.2.feed_forward.experts.down_proj_scale"])
    with pytest.raises(LocusError, match=r"missing tensor 'model\.layers\.2\.feed_forward\.experts\.down_proj_scale'"):
        load_model(bad)


def test_misshapen_scale_is_refused(fp8, tmp_path):
    name = "model.layers.1.self_attn.v_proj.weight_scale"
    bad = rewrite(fp8[0], tmp_path / "b", change={name: torch.ones(1, 32)})
    with pytest.raises(LocusError, match=rf"tensor '{name}' has shape \(1, 32\), expected \(32, 1\)"):
        load_model(bad)
    name = "model.layers.0.feed_forward.experts.gate_up_proj_scale"
    bad = rewrite(fp8[0], tmp_path / "c", change={name: torch.ones(4, 128, 1)})
    with pytest.raises(LocusError, match=rf"'{name}' has shape \(4, 128, 1\)"):
        load_model(bad)


def test_unsupported_quant_method_is_refused(fp8, tmp_path):
    bad = rewrite(fp8[0], tmp_path / "b", config={"quant_method": "gptq"})
    with pytest.raises(LocusError, match=r"quantization_config\.quant_method 'gptq' is not supported"):
        load_model(bad)


def test_bad_modules_to_not_convert_is_refused(fp8, tmp_path):
    bad = rewrite(fp8[0], tmp_path / "b", config={"modules_to_not_convert": ["model.layers.(0"]})
    with pytest.raises(LocusError, match=r"modules_to_not_convert entry 'model\.layers\.\(0' is not a valid pattern"):
        load_model(bad)


def test_fp8_tensor_of_a_kept_module_is_refused(fp8, tmp_path):
    bad = rewrite(fp8[0], tmp_path / "b", config={"modules_to_not_convert": KEEP + ["model.layers.1.self_attn"]})
    with pytest.raises(LocusError, match=r"'model\.layers\.1\.self_attn\.q_proj\.weight' is float8_e4m3fn, but "
                                         r"quantization_config keeps its module unconverted"):
        load_model(bad)


def test_scale_of_the_wrong_dtype_is_refused(fp8, tmp_path):
    name = "model.layers.3.self_attn.q_proj.weight_scale"
    bad = rewrite(fp8[0], tmp_path / "b", change={name: torch.ones(64, 1, dtype=torch.bfloat16)})
    with pytest.raises(LocusError, match=rf"tensor '{name}' is bfloat16, expected float32"):
        load_model(bad)
