"""Locus's Qwen3-MoE against transformers' Qwen3MoeForCausalLM, on checkpoints saved by transformers
(save_pretrained: safetensors, the published key names, experts one by one)."""

from __future__ import annotations

import pytest
import torch

from locus.engine.checkpoint.tokenizer import ByteTokenizer
from locus.engine.checkpoint.weights import load_model
from locus.engine.core.engine_core import EngineConfig
from locus.engine.frontend.llm import LLM
from locus.engine.model.forward_batch import ForwardBatch, SequenceSpan
from locus.engine.model.generate import generate_tokens
from locus.engine.model.kv_cache import ContiguousKVCache
from locus.engine.sampling.sampler import SamplingParams
from tests.engine.model.hf_reference import hf_logits, prompt_ids, save_hf_model
from tests.engine.model.qwen3_reference import make_qwen3_model

pytest.importorskip("transformers")

LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32}

CASES = {
    # all layers MoE, top-2 of 8, raw softmax weights
    "moe-top2": {},
    "norm-topk": {"norm_topk_prob": True},
    # layers 1 and 2 dense (mlp_only_layers), 0 and 3 MoE, top-8 of 16 renormalised
    "mlp-only-top8-of-16": {"mlp_only_layers": [1, 2], "num_experts": 16, "num_experts_per_tok": 8,
                            "norm_topk_prob": True},
    # every 2nd layer MoE (1, 3), the others dense; tied embeddings; no GQA
    "sparse-step2-tied-mha": {"decoder_sparse_step": 2, "tie_word_embeddings": True, "num_key_value_heads": 4},
    "llama3-rope-bias": {"rope_parameters": LLAMA3_ROPE, "attention_bias": True},
    "linear-rope-top1": {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
                         "num_experts_per_tok": 1},
}


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    hf = make_qwen3_model(seed=sum(map(ord, request.param)) % 1000, **CASES[request.param])
    path = save_hf_model(hf, tmp_path_factory.mktemp(request.param))
    return hf, load_model(path), request.param


def locus_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model.compute_logits(model(ForwardBatch.single(ids)).hidden)


def test_the_config_says_which_layers_are_moe(pair):
    hf, ours, _ = pair
    hf_moe = tuple(i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "gate"))
    assert ours.config.moe_layers == hf_moe
    assert tuple(i for i, layer in enumerate(ours.model.layers) if layer.is_moe) == hf_moe


def test_logits_match_transformers(pair):
    hf, ours, _ = pair
    ids = prompt_ids(48)
    expected, got = hf_logits(hf, ids), locus_logits(ours, ids)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() < 1e-4
    assert expected.std() > 0.1, "the reference must not be degenerate"


def test_recorded_routing_is_the_routers_top_k(pair):
    """The experts Locus reports per MoE layer (what the trace recorder writes) are transformers'
    router's top-k, and its weights the router's (renormalised or not)."""
    hf, ours, _ = pair
    ids = prompt_ids(40, seed=6)
    captured = {}
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, a, out, i=i: captured.__setitem__(i, out))
             for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "gate")]
    with torch.no_grad():
        hf(torch.tensor([ids]))
        routing = ours(ForwardBatch.single(ids), record_routing=True).routing
    for hook in hooks:
        hook.remove()
    assert sorted(routing) == sorted(captured)
    for layer, (_, scores, indices) in captured.items():
        assert torch.equal(routing[layer].ids, indices)
        assert torch.allclose(routing[layer].weights, scores.float(), atol=1e-6)


@pytest.mark.slow  # transformers' generate on every configuration
def test_greedy_continuation_matches_generate(pair):
    hf, ours, _ = pair
    ids = prompt_ids(48, seed=2)
    with torch.no_grad():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert generate_tokens(ours, ids, 24) == out[0, len(ids):].tolist()


def test_incremental_decode_equals_full_forward(pair):
    _, ours, _ = pair
    ids = prompt_ids(48, seed=3)
    full = locus_logits(ours, ids)
    cache = ContiguousKVCache(ours.config, 1, 64, ours.dtype)
    steps = []
    with torch.no_grad():
        pos = 0  # prefill in uneven pieces, then decode one token at a time
        for piece in (10, 7, 23, 1, 1, 1, 1, 1, 1, 1, 1):
            steps.append(ours.compute_logits(ours(ForwardBatch.single(ids[pos:pos + piece], start=pos), cache).hidden))
            pos += piece
    assert pos == 48
    assert (torch.cat(steps) - full).abs().max().item() < 1e-4


def test_batched_sequences_equal_separate_runs(pair):
    _, ours, _ = pair
    a, b = prompt_ids(30, seed=4), prompt_ids(45, seed=5)
    cache = ContiguousKVCache(ours.config, 2, 64, ours.dtype)
    batch = ForwardBatch.from_spans([a, b], [SequenceSpan(0, 0, 30), SequenceSpan(1, 0, 45)])
    with torch.no_grad():
        both = ours.compute_logits(ours(batch, cache).hidden)
    assert (both[:30] - locus_logits(ours, a)).abs().max() < 1e-4
    assert (both[30:] - locus_logits(ours, b)).abs().max() < 1e-4


def test_engine_with_chunked_prefill_and_prefix_caching_equals_generate(tmp_path):
    """The continuous-batching engine (paged KV, a step budget that chunks the prompts, a shared
    prefix served from the cache) continues as transformers' generate does, on a model with dense
    layers among the MoE ones and top-8 of 16 experts."""
    hf = make_qwen3_model(seed=11, **CASES["mlp-only-top8-of-16"])
    ours = load_model(save_hf_model(hf, tmp_path / "ck"))
    prefix = prompt_ids(64, seed=7)
    first, second = prefix + [5, 6, 7], prefix + prompt_ids(40, seed=8)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm = LLM.from_model(ours, ByteTokenizer(ByteTokenizer.MIN_VOCAB),
                         EngineConfig(block_size=16, num_kv_blocks=64, max_num_batched_tokens=24))
    llm.generate([first], greedy)
    before = llm.engine.stats()
    out = llm.generate([second], greedy)[0].outputs[0].token_ids
    after = llm.engine.stats()
    assert after.prefix_cache_hits - before.prefix_cache_hits == 64 // 16
    assert after.num_chunked_prefills > before.num_chunked_prefills, "the 40 new tokens were meant to be chunked"
    with torch.no_grad():
        expected = hf.generate(torch.tensor([second]), max_new_tokens=12, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(second):].tolist()
    assert out == expected == generate_tokens(ours, second, 12)


@pytest.mark.parametrize("dtype", [torch.bfloat16])
def test_half_precision_matches_transformers_in_same_dtype(tmp_path, dtype):
    hf = make_qwen3_model(seed=7, mlp_only_layers=[1])
    path = save_hf_model(hf, tmp_path / "ck")
    ids = prompt_ids(48)
    expected = hf_logits(hf.to(dtype), ids)
    got = locus_logits(load_model(path, dtype=dtype), ids)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    # Same math in the same dtype, rounding differs in op order; a near-tie routing flip may move one position.
    close = (got - expected).abs() < 0.05 * expected.abs().max()
    assert close.float().mean() > 0.99
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() > 0.9
