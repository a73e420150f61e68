"""The whole Triton fused-MoE path against fused_moe_reference, through the public `fused_moe`.

Shapes stay small (H=32, I=64) because on CPU every Triton program runs in the interpreter. The case
list covers T in {1, 7, 64, 300}, K in {1, 2, 8}, E in {4, 16, 128} without the full product; each
case runs in fp32 and fp16 and with the weight on the input and on the output.
"""

from __future__ import annotations

import pytest
import torch
from moe_problems import DEVICE, assert_close, half_expert_map, make_experts, make_routing, requires_gpu

from locus.kernels import MOE_BACKENDS, fused_moe, resolve_backend
from locus.kernels.moe_configs import MoeConfig
from locus.kernels.moe_reference import fused_moe_reference
from locus.kernels.moe_triton import fused_moe_triton

H, I = 32, 64

CASES = [  # T, K, E, routing kind
    (1, 1, 4, "random"),
    (1, 8, 128, "random"),
    (7, 2, 16, "random"),
    (7, 8, 128, "random"),
    (64, 1, 128, "random"),
    (64, 8, 16, "random"),
    (300, 2, 4, "random"),
    (300, 1, 16, "one_expert"),  # every token on expert 0
    (64, 2, 16, "one_expert"),  # every token on experts 0 and 1
    # half the experts get no tokens; the interpreter takes seconds per call at this size
    pytest.param(300, 2, 128, "even_only", marks=pytest.mark.slow),
]


def run_both(T, K, E, kind, dtype, weight_on_input, with_map, config=None, seed=0):
    ids, weights = make_routing(T, K, E, kind, seed=seed)
    x, gate_up, down = make_experts(T, E, H, I, dtype, seed=seed)
    expert_map = None
    if with_map:  # this rank holds the even experts only
        expert_map, gate_up, down = half_expert_map(E), gate_up[::2].contiguous(), down[::2].contiguous()
    if config is None:
        actual = fused_moe(x, gate_up, down, ids, weights, weight_on_input, expert_map, backend="triton")
    else:
        actual = fused_moe_triton(x, gate_up, down, ids, weights, weight_on_input, expert_map, config)
    expected = fused_moe_reference(x, gate_up, down, ids, weights, weight_on_input, expert_map)
    return actual, expected


@pytest.mark.parametrize("T, K, E, kind", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("weight_on_input", [True, False], ids=["w_in", "w_out"])
def test_matches_reference(T, K, E, kind, dtype, weight_on_input):
    assert_close(*run_both(T, K, E, kind, dtype, weight_on_input, with_map=False))


@pytest.mark.parametrize("T, K, E", [(7, 2, 4), (64, 8, 16), pytest.param(300, 2, 128, marks=pytest.mark.slow)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("weight_on_input", [True, False], ids=["w_in", "w_out"])
def test_local_expert_map_holding_half(T, K, E, dtype, weight_on_input):
    actual, expected = run_both(T, K, E, "random", dtype, weight_on_input, with_map=True)
    assert_close(actual, expected)


@pytest.mark.slow  # 2,400 pairs through the Triton interpreter
def test_largest_batch_top8():
    assert_close(*run_both(300, 8, 16, "random", torch.float16, True, with_map=False))


def test_tokens_with_no_local_expert_get_zero():
    T, K, E = 20, 1, 8
    ids, weights = make_routing(T, K, E)
    x, gate_up, down = make_experts(T, E, H, I, torch.float32)
    expert_map = half_expert_map(E)
    out = fused_moe(x, gate_up[::2], down[::2], ids, weights, expert_map=expert_map, backend="triton")
    remote = ids[:, 0] % 2 == 1
    assert remote.any() and (~remote).any()
    assert (out[remote] == 0).all() and (out[~remote] != 0).any()


def test_negative_ids_are_skipped():
    T, K, E = 9, 2, 4
    ids, weights = make_routing(T, K, E)
    ids[::3, 1] = -1
    x, gate_up, down = make_experts(T, E, H, I, torch.float32)
    actual = fused_moe(x, gate_up, down, ids, weights, backend="triton")
    assert_close(actual, fused_moe_reference(x, gate_up, down, ids, weights))


@pytest.mark.parametrize("config", [
    MoeConfig(block_m=32, block_n=16, block_k=16, group_m=2),
    MoeConfig(block_m=64, block_n=32, block_k=16, group_m=8),
])
def test_other_block_sizes(config):
    # 8 experts, 13-21 pairs each: 8 M-blocks, so group_m 2 and 8 both order whole groups of tiles
    assert_close(*run_both(64, 2, 8, "random", torch.float32, True, with_map=False, config=config))


def test_empty_batch():
    x, gate_up, down = make_experts(0, 4, H, I, torch.float32)
    ids = torch.zeros(0, 2, dtype=torch.int64, device=DEVICE)
    out = fused_moe(x, gate_up, down, ids, torch.zeros(0, 2, device=DEVICE), backend="triton")
    assert out.shape == (0, H)


def test_backend_choice():
    from locus.kernels.moe_cpu import available

    assert MOE_BACKENDS == ("auto", "torch", "triton", "cpu")
    assert resolve_backend("auto", torch.device("cpu")) == ("cpu" if available() else "torch")
    assert resolve_backend("auto", torch.device("cuda", 0)) == "triton"
    assert resolve_backend("triton", torch.device("cpu")) == "triton"
    with pytest.raises(ValueError, match="unknown MoE backend"):
        resolve_backend("cutlass", torch.device("cpu"))
    with pytest.raises(ValueError, match="cpu MoE backend runs on CPU tensors"):
        resolve_backend("cpu", torch.device("cuda", 0))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU interpreter set-up")
def test_kernels_are_interpreted_without_gpu():
    from locus.kernels.moe_gemm import is_interpreted

    assert is_interpreted(), "tests/conftest.py should have switched Triton to its interpreter"


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("weight_on_input", [True, False])
def test_bf16_on_gpu(weight_on_input):
    T, K, E, h, i = 300, 2, 16, 256, 512
    ids, weights = make_routing(T, K, E)
    x, gate_up, down = make_experts(T, E, h, i, torch.bfloat16)
    actual = fused_moe(x, gate_up, down, ids, weights, weight_on_input, backend="auto")
    assert_close(actual, fused_moe_reference(x, gate_up, down, ids, weights, weight_on_input))


@pytest.mark.gpu
@requires_gpu
def test_tuned_default_configs_on_gpu():
    """The GPU default tiles for decode and prefill-sized batches give the reference's answer."""
    for T in (1, 64, 2048):
        ids, weights = make_routing(T, 1, 16)
        x, gate_up, down = make_experts(T, 16, 512, 1024, torch.float16)
        actual = fused_moe(x, gate_up, down, ids, weights, backend="triton")
        assert_close(actual, fused_moe_reference(x, gate_up, down, ids, weights))
