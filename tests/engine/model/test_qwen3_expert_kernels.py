"""Qwen3-MoE's experts on Locus's kernels: top-8 routing with the weights on the expert OUTPUT.

transformers' own Qwen3MoeExperts is the reference (its gate_up [E, 2I, H] and down [E, H, I] are
nn.Linear layouts; Locus holds [E, H, 2I] and [E, I, H]). The CPU C kernel must do the work itself
(its fallback to the torch reference is made to fail), and the whole model on it matches transformers.
The Triton path runs the same model (in the interpreter without a GPU, so only there as a slow test).
"""

from __future__ import annotations

import pytest
import torch

import locus.kernels.moe_triton as moe_triton
from locus.engine.checkpoint.weights import load_model
from locus.engine.model.forward_batch import ForwardBatch
from locus.engine.model.qwen3 import route_softmax
from locus.kernels import fused_moe, moe_cpu
from tests.engine.model.hf_reference import hf_logits, prompt_ids, save_hf_model
from tests.engine.model.qwen3_reference import QWEN3_CONFIG, make_qwen3_model

transformers = pytest.importorskip("transformers")
needs_c = pytest.mark.skipif(not moe_cpu.available(), reason="no C compiler: the cpu backend is unavailable")
TOP8 = dict(num_experts=16, num_experts_per_tok=8, norm_topk_prob=True, mlp_only_layers=[2])


@pytest.fixture
def kernel_only(monkeypatch):
    """Fail if the CPU kernel falls back to the torch reference, whatever the row count."""
    def refuse(*args, **kwargs):
        raise AssertionError("fused_moe_cpu fell back to the reference")

    monkeypatch.setattr(moe_cpu, "fused_moe_reference", refuse)
    monkeypatch.setattr(moe_cpu, "CPU_MAX_ROWS", {dtype: 10**9 for dtype in moe_cpu.CPU_MAX_ROWS})


@needs_c
@pytest.mark.parametrize("T, E", [(1, 16), (5, 16), (40, 16), (33, 32)])
@pytest.mark.parametrize("norm_topk_prob", [False, True], ids=["raw", "normed"])
def test_cpu_kernel_at_top8_equals_transformers_experts(kernel_only, T, E, norm_topk_prob):
    config = transformers.Qwen3MoeConfig(**{**QWEN3_CONFIG, "num_experts": E, "num_experts_per_tok": 8,
                                            "norm_topk_prob": norm_topk_prob})
    torch.manual_seed(T + E)
    experts = transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeExperts(config)
    with torch.no_grad():
        experts.gate_up_proj.normal_(0, 0.2)
        experts.down_proj.normal_(0, 0.2)
        x = torch.randn(T, config.hidden_size)
        topk = route_softmax(torch.randn(T, E) * 2, 8, norm_topk_prob)
        expected = experts(x, topk.ids, topk.weights)
        gate_up, down = (w.transpose(1, 2).contiguous() for w in (experts.gate_up_proj, experts.down_proj))
        got = fused_moe(x, gate_up, down, topk.ids,
                        topk.weights, weight_on_input=False, backend="cpu")
    assert expected.abs().max() > 0.1, "the reference must not be degenerate"
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@needs_c
def test_model_on_the_cpu_kernel_matches_transformers_at_top8_of_16(kernel_only, tmp_path):
    hf = make_qwen3_model(seed=5, **TOP8)
    ours = load_model(save_hf_model(hf, tmp_path / "ck"), moe_backend="cpu")
    ids = prompt_ids(48)
    with torch.no_grad():
        got = ours.compute_logits(ours(ForwardBatch.single(ids)).hidden)
    assert (got - hf_logits(hf, ids)).abs().max().item() < 1e-4


@pytest.mark.slow  # the model's MoE layers through the Triton interpreter when there is no GPU
def test_model_on_the_triton_kernels_matches_transformers_at_top8_of_16(monkeypatch, tmp_path):
    calls = []
    real = moe_triton.fused_moe_triton
    monkeypatch.setattr(moe_triton, "fused_moe_triton", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    hf = make_qwen3_model(seed=6, **TOP8)
    ours = load_model(save_hf_model(hf, tmp_path / "ck"), device=device, moe_backend="triton")
    ids = prompt_ids(12)
    with torch.no_grad():
        got = ours.compute_logits(ours(ForwardBatch.single(ids, device=device)).hidden).cpu()
    assert (got - hf_logits(hf, ids)).abs().max().item() < 1e-4
    assert calls, "the triton backend never reached the Triton kernels"
