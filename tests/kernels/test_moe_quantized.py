"""Quantized expert weights (locus/kernels/moe_quantized.py): the reference's semantics, the CPU C
kernel's narrow-weight path against it (decode sizes, odd shapes, a rank's slice, weight on input and
output, float32 and bfloat16 activations), the dispatch of `fused_moe`, and the compiled custom op."""

from __future__ import annotations

import functools

import pytest
import torch
from moe_problems import half_expert_map, make_experts, make_routing

from locus.kernels import fused_moe, moe_cpu
from locus.kernels.formats import QuantizedTensor
from locus.kernels.moe_quantized import EXPERT_FORMATS, fused_moe_quantized_reference, quantize_experts
from locus.kernels.moe_reference import fused_moe_reference

needs_kernel = pytest.mark.skipif(not moe_cpu.available(), reason="no C compiler: the cpu backend is unavailable")

CASES = [  # T, K, E, H, I, routing kind
    (1, 1, 16, 256, 512, "random"),  # decode on the `small` shape
    (32, 1, 16, 256, 512, "random"),  # (the same weights as the line above)
    (7, 2, 4, 64, 64, "random"),
    (13, 2, 4, 40, 40, "random"),  # K % 32 = 8: a short last block; I % 16 = 8: leftover columns
    (5, 3, 8, 21, 19, "random"),  # every dimension odd: MXFP4's pad nibble, K % 8 leftover rows
    (20, 1, 16, 64, 600, "one_expert"),  # three row blocks; I over the 512-column block
    (30, 2, 16, 96, 64, "even_only"),  # idle experts
]


def problem(T, K, E, H, I, kind, dtype, fmt):
    ids, weights = make_routing(T, K, E, kind, seed=T + E)
    x, gate_up, down = make_experts(T, E, H, I, torch.float32, seed=H)
    gate_up, down = quantized_weights(E, H, I, fmt)
    return x.to(dtype), gate_up.clone(), down.clone(), ids, weights.to(dtype)


@functools.cache
def quantized_weights(E, H, I, fmt):  # quantizing is the slow part of these tests: once per shape
    _, gate_up, down = make_experts(1, E, H, I, torch.float32, seed=H)
    return quantize_experts(gate_up, down, fmt)


@pytest.fixture
def kernel_only(monkeypatch):
    """Fail if fused_moe_cpu falls back to the reference, and let the kernel take any row count."""
    def refuse(*args, **kwargs):
        raise AssertionError("fused_moe_cpu fell back to the reference")

    monkeypatch.setattr(moe_cpu, "fused_moe_quantized_reference", refuse)
    monkeypatch.setattr(moe_cpu, "CPU_MAX_ROWS_QUANTIZED", 10**9)


@pytest.mark.parametrize("fmt", EXPERT_FORMATS)
def test_reference_is_dequantize_then_reference(fmt):
    x, gate_up, down, ids, weights = problem(9, 2, 8, 64, 48, "random", torch.float32, fmt)
    expected = fused_moe_reference(x, gate_up.dequantize(), down.dequantize(), ids, weights)
    torch.testing.assert_close(fused_moe_quantized_reference(x, gate_up, down, ids, weights), expected,
                               atol=1e-6, rtol=1e-6)


def test_reference_with_expert_map_and_nothing_held():
    x, gate_up, down, ids, weights = problem(12, 2, 16, 64, 32, "random", torch.float32, "mxfp4")
    emap = half_expert_map(16)
    local_gu, local_down = gate_up[list(range(0, 16, 2))], down[list(range(0, 16, 2))]
    expected = fused_moe_reference(x, local_gu.dequantize(), local_down.dequantize(), ids, weights, True, emap)
    torch.testing.assert_close(fused_moe_quantized_reference(x, local_gu, local_down, ids, weights, True, emap),
                               expected, atol=1e-6, rtol=1e-6)
    odd = torch.ones_like(ids)  # every pair on expert 1, held elsewhere
    assert torch.equal(fused_moe_quantized_reference(x, local_gu, local_down, odd, weights, True, emap),
                       torch.zeros_like(x))


@pytest.mark.parametrize("fmt", EXPERT_FORMATS)
def test_quantization_error_is_small_against_float_weights(fmt):
    """What quantizing the weights costs at the output, on the `small` shape (the quality bench
    measures it on the trained model)."""
    ids, weights = make_routing(16, 1, 16, "random", seed=3)
    x = next(make_experts(16, 16, 256, 512, torch.float32, seed=3))
    _, gate_up, down = make_experts(1, 16, 256, 512, torch.float32, seed=256)  # what quantized_weights quantizes
    exact = fused_moe_reference(x, gate_up, down, ids, weights)
    q_gu, q_down = quantized_weights(16, 256, 512, fmt)
    rel = ((fused_moe_quantized_reference(x, q_gu, q_down, ids, weights) - exact).norm() / exact.norm()).item()
    assert rel < {"fp8": 0.06, "mxfp8": 0.06, "mxfp4": 0.25}[fmt], rel  # measured 0.044, 0.048, 0.19


@needs_kernel
@pytest.mark.parametrize("T, K, E, H, I, kind", CASES)
@pytest.mark.parametrize("fmt", EXPERT_FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_kernel_matches_reference(kernel_only, T, K, E, H, I, kind, fmt, dtype):
    x, gate_up, down, ids, weights = problem(T, K, E, H, I, kind, dtype, fmt)
    for weight_on_input in (True, False):
        actual = moe_cpu.fused_moe_cpu(x, gate_up, down, ids, weights, weight_on_input)
        expected = fused_moe_quantized_reference(x, gate_up, down, ids, weights, weight_on_input)
        if dtype == torch.float32:  # the same float32 weights on both sides: only the summation order differs
            torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5)
        else:  # the reference rounds weights, g, u and silu(g)*u to bfloat16, the kernel keeps float32
            torch.testing.assert_close(actual.float(), expected.float(), atol=5e-2, rtol=5e-2)


@needs_kernel
@pytest.mark.parametrize("fmt", EXPERT_FORMATS)
def test_kernel_on_a_ranks_strided_slice(kernel_only, fmt):
    x, gate_up, down, ids, weights = problem(40, 2, 16, 48, 80, "random", torch.float32, fmt)
    emap = half_expert_map(16)
    gu, dn = gate_up[slice(0, 16, 2)], down[slice(0, 16, 2)]  # strided views of the whole tensors
    assert gu.data.stride(0) == 2 * gate_up.data.stride(0)
    actual = moe_cpu.fused_moe_cpu(x, gu, dn, ids, weights, True, emap)
    torch.testing.assert_close(actual, fused_moe_quantized_reference(x, gu, dn, ids, weights, True, emap),
                               atol=1e-5, rtol=1e-5)


@needs_kernel
def test_kernel_reads_special_scales():
    """E8M0 byte 0 (2^-127, a float32 subnormal) and 255 (NaN) decode as the formats module does."""
    x, gate_up, down, ids, weights = problem(4, 1, 2, 64, 32, "random", torch.float32, "mxfp8")
    gate_up.scale[0, 0, :5] = 0
    gate_up.scale[1, 1, 3] = 255
    actual = moe_cpu.fused_moe_cpu(x, gate_up, down, ids, weights)
    expected = fused_moe_quantized_reference(x, gate_up, down, ids, weights)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=1e-5, equal_nan=True)
    assert actual[(ids[:, 0] == 1)].isnan().any() and not actual[(ids[:, 0] == 0)].isnan().any()


@needs_kernel
def test_prefill_sized_batches_use_the_reference(monkeypatch):
    calls = []
    monkeypatch.setattr(moe_cpu, "fused_moe_quantized_reference",
                        lambda *a: calls.append(1) or fused_moe_quantized_reference(*a))
    x, gate_up, down, ids, weights = problem(moe_cpu.CPU_MAX_ROWS_QUANTIZED + 1, 1, 2, 32, 32, "one_expert",
                                             torch.float32, "mxfp8")
    moe_cpu.fused_moe_cpu(x, gate_up, down, ids, weights)
    assert calls


@pytest.mark.parametrize("backend", ["torch", "cpu", "auto", "triton"])  # triton: its GEMMs read them (the interpreter)
def test_fused_moe_takes_quantized_weights(backend):
    if backend == "cpu" and not moe_cpu.available():
        pytest.skip("no C compiler")
    x, gate_up, down, ids, weights = problem(6, 2, 8, 64, 32, "random", torch.float32, "fp8")
    out = fused_moe(x, gate_up, down, ids, weights, backend=backend)
    torch.testing.assert_close(out, fused_moe_quantized_reference(x, gate_up, down, ids, weights), atol=1e-5, rtol=1e-5)


def test_mixed_or_misshapen_weights_are_refused():
    x, gate_up, down, ids, weights = problem(4, 1, 4, 64, 32, "random", torch.float32, "mxfp8")
    with pytest.raises(ValueError, match="plain tensor"):
        fused_moe_quantized_reference(x, gate_up, down.dequantize(), ids, weights)
    _, other_down = quantize_experts(gate_up.dequantize(), down.dequantize(), "mxfp4")
    with pytest.raises(ValueError, match="gate_up is mxfp8 but down is mxfp4"):
        fused_moe_quantized_reference(x, gate_up, other_down, ids, weights)
    with pytest.raises(ValueError, match="unknown expert weight format"):
        quantize_experts(gate_up.dequantize(), down.dequantize(), "int4")


def test_compiled_graph_calls_the_quantized_op():
    x, gate_up, down, ids, weights = problem(5, 2, 8, 64, 32, "random", torch.float32, "mxfp4")

    def routed(x):
        return fused_moe(x * 1.0, gate_up, down, ids, weights, backend="torch")

    torch._dynamo.reset()
    compiled = torch.compile(routed, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x), routed(x))


def test_bytes_per_expert_drop_against_bfloat16():
    bf16 = 2 * 16 * 256 * 512 * 3
    ratio = {fmt: bf16 / sum(q.nbytes for q in quantized_weights(16, 256, 512, fmt)) for fmt in EXPERT_FORMATS}
    assert ratio["mxfp8"] == pytest.approx(2 / (1 + 1 / 32)) and ratio["mxfp4"] == pytest.approx(2 / (0.5 + 1 / 32))
    assert 1.9 < ratio["fp8"] < 2.0
    assert isinstance(quantized_weights(16, 256, 512, "fp8")[0], QuantizedTensor)
