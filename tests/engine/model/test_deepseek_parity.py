"""Locus's DeepSeek-V3 / V2 against transformers' DeepseekV3ForCausalLM / DeepseekV2ForCausalLM, on
checkpoints saved by transformers (save_pretrained: safetensors, the published key names, experts one
by one)."""

from __future__ import annotations

import pytest
import torch

from locus.engine.checkpoint.tokenizer import ByteTokenizer
from locus.engine.checkpoint.weights import load_model
from locus.engine.core.engine_core import EngineConfig
from locus.engine.frontend.llm import LLM
from locus.engine.model.forward_batch import ForwardBatch, SequenceSpan
from locus.engine.model.generate import generate_tokens
from locus.engine.model.kv_cache import ContiguousKVCache, PagedKVCache
from locus.engine.sampling.sampler import SamplingParams
from tests.engine.model.deepseek_reference import make_deepseek_model
from tests.engine.model.hf_reference import hf_logits, prompt_ids, save_hf_model

pytest.importorskip("transformers")

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707}

CASES = {
    # q_lora_rank, one dense layer, sigmoid top-2 within 1 of 2 groups, renormalised, scaled by 2.5
    "v3-q-lora-grouped": ("v3", {}),
    # no q_lora_rank (one q_proj), rotated halves, 2 of 4 groups, two dense layers, no renormalisation
    "v3-no-q-lora-halves": ("v3", {"q_lora_rank": None, "rope_interleave": False, "n_group": 4, "topk_group": 2,
                                   "first_k_dense_replace": 2, "norm_topk_prob": False}),
    # YaRN with its rotation length and softmax-scale correction; 3 of 16 experts, 2 shared
    "v3-yarn-top3-of-16": ("v3", {"rope_parameters": YARN, "n_routed_experts": 16, "num_experts_per_tok": 3,
                                  "n_group": 4, "topk_group": 2, "n_shared_experts": 2,
                                  "max_position_embeddings": 256}),
    # V2-Lite's shape: no q_lora_rank, greedy softmax top-2, one dense layer, two shared experts
    "v2-lite-greedy": ("v2", {}),
    # V2's group-limited greedy with q_lora_rank and a routed scaling factor, YaRN
    "v2-group-limited": ("v2", {"q_lora_rank": 24, "topk_method": "group_limited_greedy", "n_group": 4,
                                "topk_group": 2, "routed_scaling_factor": 1.5, "rope_parameters": YARN}),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    version, overrides = CASES[request.param]
    hf = make_deepseek_model(version, seed=sum(map(ord, request.param)) % 1000, **overrides)
    path = save_hf_model(hf, tmp_path_factory.mktemp(request.param))
    return hf, load_model(path), request.param


def locus_logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model.compute_logits(model(ForwardBatch.single(ids)).hidden)


def test_the_config_says_which_layers_are_moe(pair):
    hf, ours, _ = pair
    hf_moe = tuple(i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "gate"))
    assert ours.config.moe_layers == hf_moe and 0 < len(hf_moe) < len(hf.model.layers)
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
    router's top-k after group limiting, and the weights the router's."""
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
    for layer, (_, weights, indices) in captured.items():
        # transformers' top-k is unsorted: compare per token as (expert -> weight) maps
        order = indices.argsort(dim=-1)
        ours_order = routing[layer].ids.argsort(dim=-1)
        assert torch.equal(routing[layer].ids.gather(1, ours_order), indices.gather(1, order))
        assert torch.allclose(routing[layer].weights.gather(1, ours_order), weights.float().gather(1, order), atol=1e-6)


def test_the_cache_holds_the_latent_and_the_rope_key(pair):
    _, ours, _ = pair
    c = ours.config
    cache = PagedKVCache(c, num_blocks=4, block_size=16, dtype=torch.float32)
    assert tuple(cache.keys[0].shape[1:]) == (1, c.kv_lora_rank)
    assert tuple(cache.values[0].shape[1:]) == (1, c.qk_rope_head_dim)
    per_token = PagedKVCache.bytes_per_block(c, 16, torch.bfloat16) // 16
    assert per_token == c.num_hidden_layers * (c.kv_lora_rank + c.qk_rope_head_dim) * 2


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


@pytest.mark.parametrize("case", ["v3-no-q-lora-halves", "v2-group-limited"])
def test_engine_with_chunked_prefill_and_prefix_caching_equals_generate(tmp_path, case):
    """The continuous-batching engine (paged latent cache, a step budget that chunks the prompts, a
    shared prefix served from the cache) continues as transformers' generate does."""
    version, overrides = CASES[case]
    hf = make_deepseek_model(version, seed=11, **overrides)
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


@pytest.mark.parametrize("case", ["v3-q-lora-grouped", "v2-lite-greedy"])
def test_bfloat16_matches_transformers_in_same_dtype(tmp_path, case):
    version, overrides = CASES[case]
    hf = make_deepseek_model(version, seed=7, **overrides)
    path = save_hf_model(hf, tmp_path / "ck")
    ids = prompt_ids(48)
    expected = hf_logits(hf.to(torch.bfloat16), ids)
    got = locus_logits(load_model(path, dtype=torch.bfloat16), ids)
    assert got.dtype == torch.float32 and torch.isfinite(got).all()
    # Same math in the same dtype, rounding differs in op order; a near-tie routing flip may move one position.
    close = (got - expected).abs() < 0.05 * expected.abs().max()
    assert close.float().mean() > 0.99
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() > 0.9
