"""Grouped GEMMs (Triton) against their torch references, on a layout from the align reference."""

from __future__ import annotations

import pytest
import torch
from moe_problems import assert_close, make_experts, make_routing

from locus.kernels.moe_align import align_routing_reference
from locus.kernels.moe_configs import MoeConfig
from locus.kernels.moe_gemm import (
    multiply_down,
    multiply_down_reference,
    multiply_gate_up,
    multiply_gate_up_reference,
)

# (T, K, E, H, I, config): the small tiles make several K-loop steps, several N tiles, ragged edges.
CASES = [
    (7, 2, 4, 32, 64, MoeConfig(block_m=16, block_n=64, block_k=64, group_m=1)),
    (32, 2, 8, 48, 40, MoeConfig(block_m=16, block_n=16, block_k=16, group_m=4)),  # several groups of 4 M-blocks
    (45, 1, 4, 80, 24, MoeConfig(block_m=32, block_n=16, block_k=32, group_m=8)),
]


def computed_rows(routing):
    rows = routing.sorted_pair_ids[: int(routing.num_padded.item())]
    return rows[rows < routing.num_pairs].long()


@pytest.mark.parametrize("T, K, E, H, I, config", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("weighted", [True, False])
def test_gate_up_matches_reference(T, K, E, H, I, config, dtype, weighted):
    x, gate_up, _ = make_experts(T, E, H, I, dtype)
    ids, weights = make_routing(T, K, E)
    routing = align_routing_reference(ids, E, config.block_m)
    actual = multiply_gate_up(x, gate_up, routing, weights, weighted, config)
    expected = multiply_gate_up_reference(x, gate_up, routing, weights, weighted)
    rows = computed_rows(routing)
    assert_close(actual[rows], expected[rows])


@pytest.mark.parametrize("T, K, E, H, I, config", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("weighted", [True, False])
def test_down_matches_reference(T, K, E, H, I, config, dtype, weighted):
    _, _, down = make_experts(T, E, H, I, dtype)
    h = torch.randn(T * K, I, generator=torch.Generator().manual_seed(5)).to(down.device, dtype)
    ids, weights = make_routing(T, K, E, "even_only")  # odd experts stay empty
    routing = align_routing_reference(ids, E, config.block_m)
    out = torch.full((T * K, H), 7.0, dtype=dtype, device=down.device)
    actual = multiply_down(h, down, routing, weights, weighted, config, out=out)
    assert actual is out
    assert_close(actual, multiply_down_reference(h, down, routing, weights, weighted))


def test_strided_weights():
    """Expert weights stored [E, out, in] (per-expert checkpoints) and passed as transposed views."""
    T, K, E, H, I = 30, 2, 4, 32, 48
    config = MoeConfig(block_m=16, block_n=16, block_k=16)
    x, gate_up, down = make_experts(T, E, H, I, torch.float32)
    gate_up_t = gate_up.transpose(1, 2).contiguous().transpose(1, 2)
    down_t = down.transpose(1, 2).contiguous().transpose(1, 2)
    ids, weights = make_routing(T, K, E)
    routing = align_routing_reference(ids, E, config.block_m)
    h = multiply_gate_up(x, gate_up_t, routing, weights, True, config)
    assert_close(h, multiply_gate_up_reference(x, gate_up, routing, weights, True))
    y = multiply_down(h, down_t, routing, weights, False, config)
    assert_close(y, multiply_down_reference(h, down, routing, weights, False))


def test_rejects_mismatched_inputs():
    T, K, E, H, I = 4, 1, 2, 32, 32
    config = MoeConfig(block_m=16)
    x, gate_up, down = make_experts(T, E, H, I, torch.float32)
    ids, weights = make_routing(T, K, E)
    routing = align_routing_reference(ids, E, 16)
    with pytest.raises(ValueError, match="dtype"):
        multiply_gate_up(x.half(), gate_up, routing, weights, True, config)
    with pytest.raises(ValueError, match="block_m"):
        multiply_gate_up(x, gate_up, routing, weights, True, MoeConfig(block_m=32))
    with pytest.raises(ValueError, match="gate_up"):
        multiply_gate_up(x, gate_up[:, :16], routing, weights, True, config)
    with pytest.raises(ValueError, match="down"):
        multiply_down(torch.zeros(T * K, I), down[:, :16], routing, weights, False, config)
