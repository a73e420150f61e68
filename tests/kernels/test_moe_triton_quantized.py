"""The Triton fused MoE reading fp8 / mxfp8 / mxfp4 expert weights (moe_dot_forms.py, moe_gemm.py):
every dot form against its reference under the interpreter (decode sizes T = 1..8 and larger ones,
split-K, weight on input and output, an expert map, odd shapes, special scales), the choice of the
form per device and its fallback, and on a GPU bf16 parity, a sync-free call and a CUDA graph.

The interpreter's bfloat16 tl.dot is wrong in Triton 3.9 (it multiplies the raw bits), so 16-bit
checks of the plain-dot forms run in float16 here; tl.dot_scaled runs in both.

The interpreter's time grows with the M-blocks the routed experts fill, so the problems route over 4
experts (8 for the expert map, 4 of them local): every block is still partly padded and masked."""

from __future__ import annotations

import functools
import logging
from types import SimpleNamespace

import pytest
import torch
from moe_problems import (
    DEVICE,
    capture_sync_free,
    half_expert_map,
    make_experts,
    make_routing,
    replay_with_new_routing,
    requires_gpu,
)

import locus.kernels.backends as backends
from locus.kernels import fused_moe, moe_dot_forms, moe_gemm, moe_triton
from locus.kernels.moe_configs import MoeConfig
from locus.kernels.moe_dot_forms import choose_dot
from locus.kernels.moe_quantized import (
    EXPERT_FORMATS,
    fused_moe_quantized_reference,
    fused_moe_w8a8_reference,
    quantize_experts,
)
from locus.kernels.moe_triton import fused_moe_triton

TOL = {torch.float32: 2e-5, torch.float16: 1e-2, torch.bfloat16: 5e-2}  # atol = rtol against the reference
SMALL = MoeConfig(block_m=16, block_n=32, block_k=32, group_m=1)  # many K steps and N tiles on small shapes


@functools.cache
def weights(E, H, I, fmt):  # quantizing is slow on CPU: once per shape and format
    _, gate_up, down = make_experts(1, E, H, I, torch.float32, seed=H + I)
    return quantize_experts(gate_up, down, fmt)


def problem(T, K, E, H, I, fmt, dtype, seed=0):
    ids, topk_weights = make_routing(T, K, E, seed=seed + T)
    x = next(make_experts(T, E, H, I, torch.float32, seed=seed + T))
    gate_up, down = weights(E, H, I, fmt)
    return x.to(dtype), gate_up, down, ids, topk_weights.to(dtype)


def check(actual, expected, dtype):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual.float(), expected.float(), atol=TOL[dtype], rtol=TOL[dtype], equal_nan=True)


@pytest.mark.parametrize("T", range(1, 9))
@pytest.mark.parametrize("fmt", EXPERT_FORMATS)
def test_decode_sizes_match_the_reference(fmt, T):
    """The portable form at every decode size: split-K over 1-3 slices, weight on input and output."""
    x, gate_up, down, ids, w = problem(T, 2, 4, 96, 64, fmt, torch.float32)
    config = MoeConfig(16, 32, 32, 1, split_k=1 + T % 3)
    on_input = T % 2 == 1
    actual = fused_moe_triton(x, gate_up, down, ids, w, on_input, None, config, dot="dequant")
    check(actual, fused_moe_quantized_reference(x, gate_up, down, ids, w, on_input), torch.float32)


@pytest.mark.parametrize("T, K, E, H, I", [(64, 2, 16, 64, 64),
                                           pytest.param(300, 1, 16, 64, 96, marks=pytest.mark.slow)])
@pytest.mark.parametrize("fmt", EXPERT_FORMATS)
def test_larger_batches_with_the_default_config(fmt, T, K, E, H, I):
    x, gate_up, down, ids, w = problem(T, K, E, H, I, fmt, torch.float32)
    check(fused_moe(x, gate_up, down, ids, w, backend="triton"),
          fused_moe_quantized_reference(x, gate_up, down, ids, w), torch.float32)


@pytest.mark.parametrize("H, I", [(72, 40), (21, 19)])  # K % 32 = 8 (a short last block); every size odd
@pytest.mark.parametrize("fmt", EXPERT_FORMATS)
def test_odd_shapes(fmt, H, I):
    x, gate_up, down, ids, w = problem(5, 3, 4, H, I, fmt, torch.float32)
    for split in (1, 2):
        actual = fused_moe_triton(x, gate_up, down, ids, w, True, None, MoeConfig(16, 32, 32, 1, split_k=split),
                                  dot="dequant")
        check(actual, fused_moe_quantized_reference(x, gate_up, down, ids, w), torch.float32)


@pytest.mark.parametrize("fmt", EXPERT_FORMATS)
def test_float16_activations(fmt):
    x, gate_up, down, ids, w = problem(6, 2, 4, 96, 64, fmt, torch.float16)
    for on_input in (True, False):
        actual = fused_moe_triton(x, gate_up, down, ids, w, on_input, None, SMALL, dot="dequant")
        check(actual, fused_moe_quantized_reference(x, gate_up, down, ids, w, on_input), torch.float16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4"])
def test_dot_scaled_form(fmt, dtype):
    x, gate_up, down, ids, w = problem(7, 2, 4, 72, 40, fmt, dtype)
    for on_input, split in ((True, 1), (False, 2)):
        config = MoeConfig(16, 32, 32, 1, split_k=split)
        actual = fused_moe_triton(x, gate_up, down, ids, w, on_input, None, config, dot="scaled")
        check(actual, fused_moe_quantized_reference(x, gate_up, down, ids, w, on_input), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_fp8_form_is_w8a8(dtype):
    """The FP8 tensor-core form equals its own reference (activations quantized per row) tightly, and
    the weight-only reference within what quantizing the activations costs."""
    x, gate_up, down, ids, w = problem(8, 2, 4, 96, 64, "fp8", dtype)
    for on_input, split in ((True, 1), (False, 3)):
        config = MoeConfig(16, 32, 32, 1, split_k=split)
        actual = fused_moe_triton(x, gate_up, down, ids, w, on_input, None, config, dot="fp8")
        check(actual, fused_moe_w8a8_reference(x, gate_up, down, ids, w, on_input), dtype)
        weight_only = fused_moe_quantized_reference(x, gate_up, down, ids, w, on_input).float()
        rel = ((actual.float() - weight_only).norm() / weight_only.norm()).item()
        assert 1e-3 < rel < 0.06, rel  # E4M3 activations: a few percent, and not zero (the form ran)


@pytest.mark.parametrize("fmt", EXPERT_FORMATS)
def test_expert_map_and_a_ranks_strided_slice(fmt):
    """A rank holding the even experts as strided views of the whole tensors; odd experts are
    skipped and a batch routed only to them gives zeros."""
    x, gate_up, down, ids, w = problem(9, 2, 8, 64, 48, fmt, torch.float32)
    emap = half_expert_map(8)
    local_gu, local_down = gate_up[slice(0, 8, 2)], down[slice(0, 8, 2)]
    assert local_gu.data.stride(0) == 2 * gate_up.data.stride(0)
    for split in (1, 2):
        actual = fused_moe_triton(x, local_gu, local_down, ids, w, True, emap, MoeConfig(16, 32, 32, 1, split_k=split),
                                  dot="dequant")
        check(actual, fused_moe_quantized_reference(x, local_gu, local_down, ids, w, True, emap), torch.float32)
    odd = torch.ones_like(ids)
    out = fused_moe_triton(x, local_gu, local_down, odd, w, True, emap, SMALL)
    assert torch.equal(out, torch.zeros_like(x))


@pytest.mark.parametrize("dot", ["dequant", "scaled"])
def test_special_scales_as_the_formats_module(dot):
    """E8M0 byte 0 (2^-127) reads as a tiny scale, 255 (NaN) makes its block NaN, in both MX forms."""
    dtype = torch.float32 if dot == "dequant" else torch.float16
    x, gate_up, down, ids, w = problem(4, 1, 2, 64, 32, "mxfp8", dtype)
    gate_up = gate_up.clone()
    gate_up.scale[0, 0, :5] = 0
    gate_up.scale[1, 1, 3] = 255
    ids = torch.tensor([[0], [1], [0], [1]], device=DEVICE)
    actual = fused_moe_triton(x, gate_up, down, ids, w, True, None, SMALL, dot=dot)
    check(actual, fused_moe_quantized_reference(x, gate_up, down, ids, w), dtype)
    assert actual[1].isnan().all() and not actual[0].isnan().any()


@pytest.mark.parametrize("native", [True, False], ids=["hw-convert", "bit-decode"])
@pytest.mark.parametrize("fmt", ["fp8", "mxfp8"])
def test_e4m3_bytes_decode_with_and_without_the_hardware_conversion(fmt, native, monkeypatch):
    """GPUs before sm_89 have no E4M3 conversion: the kernels decode the bits (the interpreter here
    runs both ways); subnormals (0x01, 0x83), -0, +-448 and NaN (0x7F) as the formats module. (The
    interpreter's own E4M3 conversion reads 0x7F as 480, so NaN is checked where the bits are decoded
    or a GPU converts.)"""
    monkeypatch.setattr(moe_gemm, "fp8_native", lambda device: native)
    x, gate_up, down, ids, w = problem(4, 1, 2, 64, 32, fmt, torch.float32)
    gate_up = gate_up.clone()
    special = torch.tensor([0x01, 0x83, 0x80, 0x7E, 0xFE, 0x08, 0x88], dtype=torch.uint8)
    gate_up.data.view(torch.uint8)[0, 3, :7] = special.to(DEVICE)
    nan = not native or DEVICE.type == "cuda"
    if nan:
        gate_up.data.view(torch.uint8)[1, 40, 5] = 0x7F
    ids = torch.tensor([[0], [1], [0], [1]], device=DEVICE)
    actual = fused_moe_triton(x, gate_up, down, ids, w, True, None, SMALL, dot="dequant")
    check(actual, fused_moe_quantized_reference(x, gate_up, down, ids, w), torch.float32)
    assert actual[1].isnan().all() == nan and not actual[0].isnan().any()


def test_fused_moe_no_longer_sends_narrow_weights_to_the_reference(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("the triton backend ran the torch reference")

    monkeypatch.setattr(backends, "fused_moe_quantized_reference", refuse)  # where run_fused_moe looks it up
    x, gate_up, down, ids, w = problem(3, 2, 8, 64, 32, "mxfp4", torch.float32)
    out = fused_moe(x, gate_up, down, ids, w, backend="triton")
    check(out, fused_moe_quantized_reference(x, gate_up, down, ids, w), torch.float32)


def test_choice_of_dot_form(monkeypatch):
    """"dequant" on every device, dtype and batch size (measured fastest on an H200, docs/kernels.md);
    LOCUS_MOE_DOT selects another form within check_dot's rules."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.delenv("LOCUS_MOE_DOT", raising=False)
    assert choose_dot("mxfp4", torch.bfloat16, cpu) == "dequant"  # the interpreter: portable
    assert choose_dot("float", torch.bfloat16, cuda) == "dequant"
    for capability in ((8, 0), (8, 9), (9, 0), (10, 0)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        for fmt in EXPERT_FORMATS:
            for dtype in (torch.bfloat16, torch.float16, torch.float32):
                for rows in (0.0, 1, 4, moe_dot_forms.DECODE_ROWS + 1, 512):
                    chosen = choose_dot(fmt, dtype, cuda, rows_per_expert=rows)
                    assert chosen == "dequant", (capability, fmt, dtype, rows)
    monkeypatch.setenv("LOCUS_MOE_DOT", "dequant")
    assert choose_dot("mxfp4", torch.bfloat16, cuda) == "dequant"
    monkeypatch.setenv("LOCUS_MOE_DOT", "scaled")
    assert choose_dot("mxfp8", torch.bfloat16, cuda) == "scaled"
    assert choose_dot("mxfp4", torch.bfloat16, cpu) == "scaled"  # the interpreter's dot_scaled is right
    with pytest.raises(ValueError, match="refused for mxfp4 experts: tl.dot_scaled with e2m1 weights was measured "
                                         "wrong on CUDA .*H200.*Triton 3.6"):
        choose_dot("mxfp4", torch.bfloat16, cuda)
    monkeypatch.setenv("LOCUS_MOE_DOT", "fp8")
    assert choose_dot("fp8", torch.bfloat16, cuda, rows_per_expert=4) == "fp8"
    with pytest.raises(ValueError, match="mxfp4 expert weights take the dot forms dequant, scaled"):
        choose_dot("mxfp4", torch.bfloat16, cuda)


def test_mxfp4_scaled_form_is_refused_on_cuda():
    """An explicit dot="scaled" on CUDA mxfp4 weights is refused before any kernel runs; the GEMMs
    pass their activations' device to the check (stand-ins: only dtype, device and format are read)."""
    cuda = torch.device("cuda")
    on_cuda = SimpleNamespace(dtype=torch.bfloat16, device=cuda)
    with pytest.raises(ValueError, match="refused for mxfp4 experts"):
        moe_gemm._dot_form(SimpleNamespace(format="mxfp4"), on_cuda, "scaled")
    assert moe_gemm._dot_form(SimpleNamespace(format="mxfp8"), on_cuda, "scaled") == "scaled"
    with pytest.raises(ValueError, match="refused for mxfp4 experts.*use the 'dequant' dot form"):
        moe_dot_forms.check_dot("scaled", "mxfp4", torch.bfloat16, cuda)
    moe_dot_forms.check_dot("scaled", "mxfp8", torch.bfloat16, cuda)  # mxfp8's dot_scaled is right
    moe_dot_forms.check_dot("scaled", "mxfp4", torch.bfloat16, torch.device("cpu"))
    moe_dot_forms.check_dot("dequant", "mxfp4", torch.bfloat16, cuda)


def test_unusable_forms_and_tiles_are_refused():
    x, gate_up, down, ids, w = problem(2, 1, 4, 64, 32, "mxfp8", torch.float32)
    with pytest.raises(ValueError, match="takes bfloat16 or float16 activations"):
        fused_moe_triton(x, gate_up, down, ids, w, dot="scaled")
    with pytest.raises(ValueError, match="not 'fp8'"):
        fused_moe_triton(x, gate_up, down, ids, w, dot="fp8")
    with pytest.raises(ValueError, match="block_k >= 32"):
        fused_moe_triton(x, gate_up, down, ids, w, config=MoeConfig(16, 32, 16, 1))
    fp8_gate_up, _ = weights(4, 64, 32, "fp8")
    with pytest.raises(ValueError, match="gate_up is fp8 but down is mxfp8"):
        fused_moe_triton(x, fp8_gate_up, down, ids, w)


def test_a_form_that_fails_to_build_falls_back_once(monkeypatch, caplog):
    """If the device's fast form cannot be built here, the call (and every later one) runs the
    portable form, with one warning."""
    x, gate_up, down, ids, w = problem(3, 1, 4, 64, 32, "mxfp4", torch.float16)
    monkeypatch.setattr(moe_triton, "choose_dot", lambda *args: "scaled")
    monkeypatch.setattr(moe_triton, "_FALLBACK", set())
    real, tried = moe_triton.multiply_gate_up, []

    def broken(*args):
        tried.append(args[-1])
        if args[-1] == "scaled":
            raise RuntimeError("PassManager::run failed")
        return real(*args)

    monkeypatch.setattr(moe_triton, "multiply_gate_up", broken)
    with caplog.at_level(logging.WARNING, logger="locus.kernels"):
        first = fused_moe_triton(x, gate_up, down, ids, w, config=SMALL)
        second = fused_moe_triton(x, gate_up, down, ids, w, config=SMALL)
    assert tried == ["scaled", "dequant", "dequant"]
    assert [r.message for r in caplog.records if "failed" in r.message] == [
        "Triton fused MoE: the 'scaled' dot form failed on mxfp4 experts (RuntimeError: PassManager::run failed); "
        "using 'dequant'"]
    check(first, fused_moe_quantized_reference(x, gate_up, down, ids, w), torch.float16)
    assert torch.equal(first, second)


def test_a_failure_of_the_portable_form_is_raised(monkeypatch):
    x, gate_up, down, ids, w = problem(3, 1, 4, 64, 32, "mxfp4", torch.float16)
    monkeypatch.setattr(moe_triton, "choose_dot", lambda *args: "scaled")
    monkeypatch.setattr(moe_triton, "_FALLBACK", set())

    def broken(*args):
        raise RuntimeError(f"broken {args[-1]}")

    monkeypatch.setattr(moe_triton, "multiply_gate_up", broken)
    with pytest.raises(RuntimeError, match="broken dequant"):
        fused_moe_triton(x, gate_up, down, ids, w, config=SMALL)
    assert not moe_triton._FALLBACK


def test_forms_per_format_are_listed():
    assert set(moe_dot_forms.FORM_OF_FORMAT) == set(EXPERT_FORMATS)
    assert all(form in moe_dot_forms.DOT_FORMS for forms in moe_dot_forms.FORM_OF_FORMAT.values() for form in forms)


def gpu_forms(fmt):
    """The dot forms this GPU runs for `fmt` weights: mxfp4's "scaled" is refused on CUDA."""
    forms = ["dequant"]
    capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else (0, 0)
    if fmt == "mxfp8" and capability >= moe_dot_forms.SCALED_CAPABILITY:
        forms.append("scaled")
    if fmt == "fp8" and capability >= moe_dot_forms.FP8_CAPABILITY:
        forms.append("fp8")
    return forms


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("fmt", EXPERT_FORMATS)
def test_bf16_parity_on_gpu_every_form(fmt):
    """Decode sizes and a prefill size, bf16, each form this GPU has, default (tuned or not) configs
    (every T of 1..8 runs under the interpreter; here a few, to keep the compiles short)."""
    for T in (1, 4, 8, 512):
        x, gate_up, down, ids, w = problem(T, 1, 16, 1024, 2048, fmt, torch.bfloat16)
        if fmt == "mxfp4":
            with pytest.raises(ValueError, match="refused for mxfp4 experts"):
                fused_moe_triton(x, gate_up, down, ids, w, dot="scaled")
        for dot in gpu_forms(fmt):
            actual = fused_moe_triton(x, gate_up, down, ids, w, dot=dot)
            expected = (fused_moe_w8a8_reference if dot == "fp8" else fused_moe_quantized_reference)(
                x, gate_up, down, ids, w)
            check(actual, expected, torch.bfloat16)


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("fmt", EXPERT_FORMATS)
def test_narrow_decode_is_sync_free_and_captures_in_a_cuda_graph(fmt):
    T, K, E = 4, 1, 16
    x, gate_up, down, ids, w = problem(T, K, E, 512, 1024, fmt, torch.bfloat16)
    for dot in gpu_forms(fmt):
        config = MoeConfig(16, 64, 64, 1, split_k=4)
        graph, out = capture_sync_free(
            lambda dot=dot: fused_moe_triton(x, gate_up, down, ids, w, True, None, config, dot=dot))
        reference = fused_moe_w8a8_reference if dot == "fp8" else fused_moe_quantized_reference
        for _ in replay_with_new_routing(graph, x, ids, w, E):
            check(out, reference(x, gate_up, down, ids, w), torch.bfloat16)
