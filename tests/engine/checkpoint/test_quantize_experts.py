"""`--quantize-experts`: routed experts held in fp8 / mxfp8 / mxfp4 after loading (whole models and an
expert-parallel rank's slice), the model's output against its float twin, and the flag's plumbing
(offline LLM, `locus generate`, `locus serve`'s refusal under expert parallelism)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from locus.engine.checkpoint.loader import load
from locus.engine.checkpoint.quantize import dequantize_model_experts, moe_layers, quantize_model_experts
from locus.engine.frontend.llm import LLM
from locus.engine.model.forward_batch import ForwardBatch
from locus.engine.sampling.sampler import SamplingParams
from locus.errors import LocusError
from locus.kernels.formats import QuantizedTensor
from locus.kernels.moe_quantized import EXPERT_FORMATS, quantize_experts

PROMPT = list(range(3, 40))


def logits(model, ids=PROMPT):
    with torch.no_grad():
        return model.compute_logits(model(ForwardBatch.single(ids)).hidden)


@pytest.fixture(scope="module")
def float_logits():
    return logits(load("tiny", moe_backend="torch").model)


@pytest.mark.parametrize("fmt", EXPERT_FORMATS)
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_quantized_model_stays_close_to_float(float_logits, fmt, backend):
    model = load("tiny", moe_backend=backend, quantize_experts=fmt).model
    for experts in moe_layers(model):
        assert experts.weight_format == fmt and isinstance(experts.gate_up_proj, QuantizedTensor)
        assert "gate_up_proj" not in dict(experts.named_parameters())
    out = logits(model)
    rel = ((out - float_logits).norm() / float_logits.norm()).item()
    # measured 0.063, 0.050, 0.18: the random `tiny` routes differently once its hidden states move
    assert 0 < rel < {"fp8": 0.1, "mxfp8": 0.1, "mxfp4": 0.3}[fmt], rel


def test_backends_agree_on_quantized_experts():
    a = logits(load("tiny", moe_backend="torch", quantize_experts="mxfp4").model)
    b = logits(load("tiny", moe_backend="cpu", quantize_experts="mxfp4").model)
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_the_load_log_names_the_kernel_that_reads_the_experts(caplog):
    with caplog.at_level("INFO", logger="locus.engine"):
        load("tiny", moe_backend="triton", quantize_experts="fp8")
        load("tiny", moe_backend="torch", quantize_experts="mxfp4")
    assert "fp8 experts: the Triton kernels read them narrow with the 'dequant' dot form" in caplog.text
    assert "mxfp4 experts: the torch reference dequantizes the experts a batch uses, per call" in caplog.text


@pytest.mark.slow  # the tiny model through the Triton interpreter
@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_triton_backend_reads_quantized_experts(fmt):
    """The Triton kernels (the interpreter here) on the narrow experts give the torch reference's logits."""
    model = load("tiny", moe_backend="triton", quantize_experts=fmt).model
    expected = logits(load("tiny", moe_backend="torch", quantize_experts=fmt).model)
    torch.testing.assert_close(logits(model), expected, atol=1e-4, rtol=1e-4)


def test_a_ranks_slice_quantizes_only_its_slots():
    slices = {0: [5, 2], 1: [7, 7], 3: [0, 1]}  # the tiny preset's MoE layers 0, 1, 3
    whole = load("tiny", moe_backend="torch").model
    rank = load("tiny", moe_backend="torch", expert_slices=slices, quantize_experts="mxfp8").model
    for layer, ids in slices.items():
        held = rank.model.layers[layer].feed_forward.experts
        assert held.gate_up_proj.shape[0] == 2 and held.expert_ids == ids
        full = whole.model.layers[layer].feed_forward.experts
        expected, _ = quantize_experts(full.gate_up_proj[ids], full.down_proj[ids], "mxfp8")
        assert torch.equal(held.gate_up_proj.data.view(torch.uint8), expected.data.view(torch.uint8))
        assert torch.equal(held.gate_up_proj.scale, expected.scale)


def test_requantizing_and_dequantizing():
    model = load("tiny", moe_backend="torch", quantize_experts="mxfp8").model
    report = quantize_model_experts(model, "mxfp4")
    assert report.bytes_after < report.bytes_before and moe_layers(model)[0].weight_format == "mxfp4"
    dequantize_model_experts(model)
    experts = moe_layers(model)[0]
    assert experts.weight_format is None and isinstance(experts.gate_up_proj, torch.nn.Parameter)
    logits(model)  # still runs


def test_memory_report_counts_narrow_bytes():
    model = load("tiny", moe_backend="torch").model  # 3 MoE layers of 8 experts, H = I = 64, float32
    report = quantize_model_experts(model, "mxfp4")
    assert report.layers == 3
    assert report.bytes_before == 3 * 8 * 3 * 64 * 64 * 4
    assert report.bytes_after == 3 * 8 * 3 * 64 * 64 * (0.5 + 1 / 32)


def test_unknown_format_is_refused():
    with pytest.raises(LocusError, match="--quantize-experts 'int4'"):
        load("tiny", quantize_experts="int4")


def test_offline_llm_generates_with_quantized_experts():
    llm = LLM("tiny", moe_backend="cpu", quantize_experts="fp8")
    assert moe_layers(llm.engine.model)[0].weight_format == "fp8"
    out = llm.generate([PROMPT], SamplingParams(max_tokens=4, temperature=0.0))[0]
    assert len(out.outputs[0].token_ids) == 4


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "locus.cli", *args], capture_output=True, text=True, timeout=300)


@pytest.mark.slow  # runs `locus generate` as a subprocess
def test_generate_cli_takes_the_flag():
    done = run_cli("generate", "--model", "tiny", "--prompt", "ab", "--max-tokens", "2", "--quantize-experts", "mxfp4")
    assert done.returncode == 0, done.stderr


@pytest.mark.slow
def test_compiled_decode_with_quantized_experts_matches_eager():
    """--compile: the quantized experts are the opaque op locus::fused_moe_quantized in the graph."""
    from locus.engine.core.engine_core import EngineConfig

    params = SamplingParams(max_tokens=6, temperature=0.0)
    prompts = [list(range(3, 20)), list(range(5, 30))]
    eager = LLM("tiny", moe_backend="cpu", quantize_experts="mxfp4").generate(prompts, params)
    compiled = LLM("tiny", moe_backend="cpu", quantize_experts="mxfp4",
                   engine_config=EngineConfig(compile_decode=True, compile_buckets=(1, 2), max_num_seqs=2))
    assert [o.outputs[0].token_ids for o in compiled.generate(prompts, params)] == \
        [o.outputs[0].token_ids for o in eager]
