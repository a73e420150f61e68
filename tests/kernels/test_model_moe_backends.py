"""The whole tiny model gives the same greedy tokens with the Triton MoE backend as with torch (fp32).

On CPU the Triton kernels run in the interpreter, so the prompt and continuation stay short.
"""

from __future__ import annotations

import pytest
import torch
from moe_problems import DEVICE

import locus.kernels.moe_triton as moe_triton
from locus.engine.model.forward_batch import ForwardBatch
from locus.engine.model.generate import generate_tokens
from locus.engine.checkpoint.loader import load

PROMPT = [1, 72, 101, 108, 108, 111, 44, 32, 101, 120, 112, 101, 114, 116, 115, 33]  # BOS + bytes


@pytest.mark.slow  # the whole tiny model through the Triton interpreter
def test_tiny_model_greedy_tokens_match_torch_backend(monkeypatch):
    calls = []
    real = moe_triton.fused_moe_triton
    monkeypatch.setattr(moe_triton, "fused_moe_triton", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    torch_model = load("tiny", dtype="float32", device=str(DEVICE), moe_backend="torch").model
    triton_model = load("tiny", dtype="float32", device=str(DEVICE), moe_backend="triton").model

    with torch.no_grad():
        batch = ForwardBatch.single(PROMPT, device=DEVICE)
        expected = torch_model.compute_logits(torch_model(batch).hidden)
        actual = triton_model.compute_logits(triton_model(batch).hidden)
    assert (actual - expected).abs().max().item() < 1e-4
    assert expected.std() > 0.1, "the reference must not be degenerate"

    want = generate_tokens(torch_model, PROMPT, 12)
    got = generate_tokens(triton_model, PROMPT, 12)
    assert got == want
    assert calls, "the triton backend never reached the Triton kernels"
