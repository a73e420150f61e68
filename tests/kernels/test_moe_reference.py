"""The torch fused-MoE (both strategies) against a per-(token, slot) loop written from the formula."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from moe_problems import assert_close, half_expert_map, make_experts, make_routing

from locus.kernels.moe_reference import PADDED_MAX_ROWS, choose_strategy, fused_moe_reference

H, I = 32, 48


def naive_moe(x, gate_up, down, ids, weights, weight_on_input, expert_map=None):
    """y[t] = sum_k expert_{e_k}(...) straight from the moe_reference docstring, in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            e = int(ids[t, k])
            if e >= 0 and expert_map is not None:
                e = int(expert_map[e])
            if e < 0:
                continue
            w = float(weights[t, k])
            x_in = x[t].double() * (w if weight_on_input else 1.0)
            gate, up = (x_in @ gate_up[e].double()).chunk(2)
            y = (F.silu(gate) * up) @ down[e].double()
            out[t] += y if weight_on_input else w * y
    return out.to(x.dtype)


CASES = [  # T, K, E, routing kind
    (1, 1, 4, "random"),
    (5, 2, 8, "random"),
    (32, 1, 16, "random"),  # decode-like: padded under "auto"
    (40, 2, 4, "one_expert"),  # every token on experts 0 and 1
    (64, 4, 16, "even_only"),  # half the experts get no tokens
]


@pytest.mark.parametrize("T, K, E, kind", CASES)
@pytest.mark.parametrize("strategy", ["loop", "padded", "auto"])
@pytest.mark.parametrize("weight_on_input", [True, False], ids=["w_in", "w_out"])
def test_strategies_match_the_formula(T, K, E, kind, strategy, weight_on_input):
    ids, weights = make_routing(T, K, E, kind)
    x, gate_up, down = make_experts(T, E, H, I, torch.float32)
    actual = fused_moe_reference(x, gate_up, down, ids, weights, weight_on_input, strategy=strategy)
    assert_close(actual, naive_moe(x, gate_up, down, ids, weights, weight_on_input))


@pytest.mark.parametrize("strategy", ["loop", "padded"])
def test_expert_map_and_skipped_pairs(strategy):
    T, K, E = 24, 2, 8
    ids, weights = make_routing(T, K, E)
    ids[::3, 0] = -1  # some pairs skipped outright
    x, gate_up, down = make_experts(T, E, H, I, torch.float32)
    expert_map = half_expert_map(E)
    local_up, local_down = gate_up[::2].contiguous(), down[::2].contiguous()
    actual = fused_moe_reference(x, local_up, local_down, ids, weights, True, expert_map, strategy=strategy)
    assert_close(actual, naive_moe(x, local_up, local_down, ids, weights, True, expert_map))


@pytest.mark.parametrize("strategy", ["loop", "padded"])
def test_nothing_held_here_gives_zero(strategy):
    ids, weights = make_routing(6, 1, 4)
    x, gate_up, down = make_experts(6, 2, H, I, torch.float32)
    expert_map = torch.tensor([-1, -1, -1, -1], dtype=torch.int32)
    out = fused_moe_reference(x, gate_up, down, ids, weights, True, expert_map, strategy=strategy)
    assert torch.equal(out, torch.zeros_like(x))


def test_bf16_padded_matches_loop():
    ids, weights = make_routing(32, 1, 16)
    x, gate_up, down = make_experts(32, 16, H, I, torch.bfloat16)
    loop = fused_moe_reference(x, gate_up, down, ids, weights, strategy="loop")
    assert_close(fused_moe_reference(x, gate_up, down, ids, weights, strategy="padded"), loop)


def test_auto_choice():
    assert choose_strategy([2, 1, 3, 0]) == "padded"  # small batch, most experts busy
    assert choose_strategy([PADDED_MAX_ROWS + 1, 1, 1, 1]) == "loop"  # one expert too busy to pad
    assert choose_strategy([5, 0, 0, 0]) == "loop"  # few experts used: padding would read all of them
    assert choose_strategy([0, 0, 0, 0]) == "loop"


def test_unknown_strategy_is_rejected():
    ids, weights = make_routing(2, 1, 4)
    x, gate_up, down = make_experts(2, 4, H, I, torch.float32)
    with pytest.raises(ValueError, match="unknown strategy 'fast'"):
        fused_moe_reference(x, gate_up, down, ids, weights, strategy="fast")
