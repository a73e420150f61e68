"""Llama-4 router math against transformers' Llama4Router and a hand-computed case."""

from __future__ import annotations

import pytest
import torch

from locus.routing.gate import route_llama4


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
