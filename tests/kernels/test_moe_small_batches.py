"""The small-batch (decode) kernel path against the reference: split-K, the one-program align, and
every value of every meta-parameter the tuner searches (bench/tune_moe.py), under the interpreter.

The interpreter runs every program in Python, so shapes are sized to each config: a reduction of
`split_k` BLOCK_K steps and 1.5 N-tiles (a ragged last tile). num_warps and num_stages change
nothing the interpreter runs, so they are left out of the coverage.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from moe_problems import (
    assert_close,
    capture_sync_free,
    half_expert_map,
    make_experts,
    make_routing,
    replay_with_new_routing,
    requires_gpu,
)

from locus.kernels import fused_moe
from locus.kernels.moe_configs import MoeConfig, decode_split_k, default_config
from locus.kernels.moe_gemm import split_plan
from locus.kernels.moe_reference import fused_moe_reference
from locus.kernels.moe_triton import fused_moe_triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from tune_moe import VALUES  # noqa: E402

# T -> (K, E, config, dtype, weight_on_input, expert map): every T of 1..8 with its own mix.
SMALL_T = {
    1: (1, 4, MoeConfig(16, 32, 16, 1, split_k=4), torch.float32, True, False),
    2: (2, 8, MoeConfig(16, 64, 32, 1, split_k=2), torch.float32, False, False),
    3: (1, 16, MoeConfig(16, 32, 32, 8, split_k=8), torch.float16, True, True),
    4: (2, 4, MoeConfig(32, 32, 16, 1, split_k=3), torch.float32, True, False),  # 3: not a power of two
    5: (1, 8, MoeConfig(16, 64, 16, 1, split_k=1), torch.float32, False, True),
    6: (2, 16, MoeConfig(16, 32, 64, 1, split_k=2), torch.float16, False, False),
    7: (1, 4, MoeConfig(16, 32, 16, 1, split_k=16), torch.float32, True, False),  # more splits than steps
    8: (2, 8, MoeConfig(16, 32, 32, 1, split_k=4), torch.float32, True, True),
}
H, I = 96, 80  # neither a multiple of 64: ragged K and N tiles


@pytest.mark.parametrize("T", sorted(SMALL_T))
def test_small_batches_match_reference(T):
    K, E, config, dtype, weight_on_input, with_map = SMALL_T[T]
    ids, weights = make_routing(T, K, E, seed=T)
    x, gate_up, down = make_experts(T, E, H, I, dtype, seed=T)
    expert_map = None
    if with_map:  # this rank holds the even experts: odd ones contribute zero
        expert_map, gate_up, down = half_expert_map(E), gate_up[::2].contiguous(), down[::2].contiguous()
    actual = fused_moe_triton(x, gate_up, down, ids, weights, weight_on_input, expert_map, config)
    assert_close(actual, fused_moe_reference(x, gate_up, down, ids, weights, weight_on_input, expert_map))


def test_split_with_negative_ids_and_existing_sizes():
    """A split on a batch past the one-program align (33 x 8 pairs), with skipped (-1) slots."""
    T, K, E = 33, 8, 16
    ids, weights = make_routing(T, K, E)
    ids[::5, 3] = -1
    x, gate_up, down = make_experts(T, E, 32, 32, torch.float32)
    config = MoeConfig(16, 32, 16, 1, split_k=2)
    actual = fused_moe_triton(x, gate_up, down, ids, weights, True, None, config)
    assert_close(actual, fused_moe_reference(x, gate_up, down, ids, weights, True))


def _coverage() -> list[MoeConfig]:
    """The tuner's value of each meta-parameter in turn, on a small base config."""
    base = MoeConfig(block_m=16, block_n=32, block_k=32, group_m=1, num_warps=4, num_stages=3, split_k=1)
    configs = []
    for name in ("split_k", "block_n", "block_k", "block_m", "group_m"):
        for value in VALUES[name]:
            if name == "group_m" and value not in (1, 8):
                continue  # with a block or two every group size > 1 orders tiles alike
            config = replace(base, **{name: value})
            if config not in configs:
                configs.append(config)
    return configs


@pytest.mark.parametrize("config", _coverage(), ids=lambda c: f"m{c.block_m}n{c.block_n}k{c.block_k}g{c.group_m}s{c.split_k}")
def test_every_searched_value_runs_right(config):
    h = config.block_k * max(2, config.split_k)  # split_k slices of one step each (two at least)
    i = config.block_n + config.block_n // 2  # one and a half N-tiles
    ids, weights = make_routing(3, 1, 2, seed=1)
    x, gate_up, down = make_experts(3, 2, h, i, torch.float32, seed=1)
    actual = fused_moe_triton(x, gate_up, down, ids, weights, False, None, config)
    assert_close(actual, fused_moe_reference(x, gate_up, down, ids, weights, False))


def test_searched_values_are_covered():
    covered = {name: {getattr(c, name) for c in _coverage()} for name in ("split_k", "block_n", "block_k", "block_m")}
    assert all(covered[name] == set(VALUES[name]) for name in covered)


@pytest.mark.parametrize("width, block_k, split", [(5120, 128, 4), (96, 16, 16), (8192, 64, 3), (64, 32, 8), (33, 16, 2)])
def test_split_plan_covers_the_reduction_without_empty_slices(width, block_k, split):
    slices, per_slice = split_plan(width, block_k, split)
    assert 1 <= slices <= split and per_slice % block_k == 0
    assert (slices - 1) * per_slice < width <= slices * per_slice  # the last slice is not empty


def test_decode_defaults_split_only_where_the_grid_is_short():
    """One Llama-4 expert (T=1) fills 80 of 132 SMs unsplit: the default splits; a busy batch, a
    prefill batch, or a narrow expert (the small preset) does not."""
    assert decode_split_k(1, 8192, 5120, 64, 128) == 4
    assert default_config(1, 1, 16, torch.bfloat16, "NVIDIA H100 80GB HBM3", I=8192, H=5120).split_k == 4
    assert default_config(64, 1, 128, torch.bfloat16, "NVIDIA H100 80GB HBM3", I=8192, H=5120).split_k == 1
    assert default_config(4096, 1, 16, torch.bfloat16, "NVIDIA H100 80GB HBM3", I=8192, H=5120).split_k == 1
    assert default_config(1, 1, 16, torch.bfloat16, "NVIDIA H100 80GB HBM3", I=512, H=256).split_k == 1
    assert default_config(1, 1, 16, torch.float32, "cpu", I=8192, H=5120).split_k == 1


@pytest.mark.gpu
@requires_gpu
@pytest.mark.parametrize("split_k", [1, 4])
def test_decode_call_is_sync_free_and_captures_in_a_cuda_graph(split_k):
    """The whole Triton path at decode sizes: no host sync (sync debug mode "error"), and captured
    once into a CUDA graph it gives the reference's answer for new routing copied into its inputs."""
    T, K, E, h, i = 4, 1, 16, 512, 1024
    config = MoeConfig(16, 64, 64, 1, split_k=split_k)
    ids, weights = make_routing(T, K, E)
    x, gate_up, down = make_experts(T, E, h, i, torch.bfloat16)
    graph, out = capture_sync_free(lambda: fused_moe_triton(x, gate_up, down, ids, weights, True, None, config))
    for _ in replay_with_new_routing(graph, x, ids, weights, E):
        assert_close(out, fused_moe_reference(x, gate_up, down, ids, weights, True))


@pytest.mark.gpu
@requires_gpu
def test_small_batches_bf16_on_gpu_with_tuned_or_default_configs():
    for T in range(1, 9):
        ids, weights = make_routing(T, 1, 16, seed=T)
        x, gate_up, down = make_experts(T, 16, 1024, 2048, torch.bfloat16, seed=T)
        actual = fused_moe(x, gate_up, down, ids, weights, backend="triton")
        assert_close(actual, fused_moe_reference(x, gate_up, down, ids, weights))
