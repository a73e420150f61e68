"""Router math against transformers' Llama4Router and hand-computed cases."""

from __future__ import annotations

import pytest
import torch

from locus.routing.gate import route_deepseek_v3, route_llama4, route_softmax


def test_llama4_matches_transformers_router():
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama4.modeling_llama4 import Llama4Router

    config = transformers.Llama4TextConfig(hidden_size=32, num_local_experts=8, num_experts_per_tok=2)
    router = Llama4Router(config)
    torch.nn.init.normal_(router.weight, std=0.5)
    x = torch.randn(20, 32)
    scores, logits = router(x)  # [T, E] dense: sigmoid at the top-k, 0 elsewhere
    topk = route_llama4(logits, 2)
    dense = torch.zeros_like(scores).scatter_(1, topk.ids, topk.weights)
    assert torch.allclose(dense, scores, atol=1e-6)
    assert topk.weights.dtype == torch.float32


def test_llama4_weights_are_unnormalised_sigmoids():
    logits = torch.tensor([[0.0, 2.0, -1.0, 1.0]])
    topk = route_llama4(logits, 2)
    assert topk.ids.tolist() == [[1, 3]]
    assert torch.allclose(topk.weights, torch.sigmoid(torch.tensor([[2.0, 1.0]])))


def test_softmax_topk_renormalises():
    logits = torch.log(torch.tensor([[0.1, 0.4, 0.2, 0.3]]))
    t = route_softmax(logits, 2)
    assert t.ids.tolist() == [[1, 3]]
    assert torch.allclose(t.weights, torch.tensor([[0.4 / 0.7, 0.3 / 0.7]]))
    assert torch.allclose(route_softmax(logits, 2, renormalize=False).weights, torch.tensor([[0.4, 0.3]]))


def test_deepseek_v3_group_limit_and_bias():
    # 8 experts in 4 groups of 2; only the best 2 groups may be chosen.
    logits = torch.tensor([[3.0, 2.9, -5.0, 2.95, 0.0, 0.0, 1.0, 1.0]])
    bias = torch.zeros(8)
    t = route_deepseek_v3(logits, bias, top_k=2, n_group=4, topk_group=2, routed_scaling_factor=2.0)
    # group scores (sum of top-2 sigmoids): g0 highest, g3 next (s(1)+s(1) > s(2.95)+s(-5) for g1)
    assert sorted(t.ids[0].tolist()) == [0, 1]
    assert torch.allclose(t.weights.sum(), torch.tensor(2.0))
    # a bias moves the choice but not the weights' source (unbiased scores)
    bias[6] = 10.0
    t = route_deepseek_v3(logits, bias, top_k=2, n_group=4, topk_group=2, routed_scaling_factor=1.0)
    assert 6 in t.ids[0].tolist()
    s = torch.sigmoid(logits[0])
    chosen = t.ids[0]
    assert torch.allclose(t.weights[0], s[chosen] / s[chosen].sum())
