"""prompt_logprobs: every prompt token's logprob given its prefix, against transformers' log-softmax
of the whole prompt, whichever way the engine computes the prompt (one step, chunks, after a
prefix-cache hit that must not skip the scoring, n > 1)."""

from __future__ import annotations

import pytest
import torch

from locus.engine.core.engine_core import EngineConfig
from locus.engine.frontend.llm import LLM
from locus.engine.sampling.sampler import SamplingParams
from locus.engine.checkpoint.tokenizer import ByteTokenizer
from locus.engine.checkpoint.weights import load_model
from tests.engine.model.hf_reference import hf_logits, make_hf_model, prompt_ids, save_hf_model

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    hf = make_hf_model(seed=11)
    return hf, load_model(save_hf_model(hf, tmp_path_factory.mktemp("prompt-logprobs")))


def check_against_transformers(hf, prompt: list[int], entries, k: int) -> None:
    with torch.no_grad():
        raw = torch.log_softmax(hf_logits(hf, prompt), dim=-1)  # row t predicts prompt[t + 1]
    assert len(entries) == len(prompt) and entries[0] is None
    for t in range(1, len(prompt)):
        e, row = entries[t], raw[t - 1]
        assert e.token_id == prompt[t]
        assert e.logprob == pytest.approx(float(row[prompt[t]]), abs=1e-4)
        assert e.rank == int((row > row[prompt[t]]).sum()) + 1
        assert [i for i, _ in e.top] == row.topk(k).indices.tolist()
        assert [v for _, v in e.top] == pytest.approx(row.topk(k).values.tolist(), abs=1e-4)


@pytest.mark.parametrize("budget", [2048, 16])  # one prefill step, or chunks of 16 tokens
def test_prompt_logprobs_equal_transformers_log_softmax(pair, budget):
    hf, ours = pair
    prompt = prompt_ids(48)
    llm = LLM.from_model(ours, ByteTokenizer(300), EngineConfig(block_size=8, num_kv_blocks=64, max_num_batched_tokens=budget))
    out = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3, n=2))[0]
    check_against_transformers(hf, prompt, out.prompt_logprobs, 3)
    # the same prompt again: its blocks are cached, but scoring needs every position computed
    again = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3))[0]
    check_against_transformers(hf, prompt, again.prompt_logprobs, 3)
    plain = llm.generate([prompt], SamplingParams(max_tokens=2, temperature=0))[0]
    assert plain.prompt_logprobs is None
    assert llm.engine.stats().prefix_cache_hits > 0  # requests without prompt_logprobs still use the cache


def test_prompt_logprobs_survive_preemption(pair):
    hf, ours = pair
    prompts = [prompt_ids(40, seed=s) for s in range(6)]
    # 12 blocks of 8 tokens for six 40-token prompts decoding 20 tokens each: constant preemption
    llm = LLM.from_model(ours, ByteTokenizer(300), EngineConfig(block_size=8, num_kv_blocks=12, max_num_batched_tokens=24))
    outs = llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, prompt_logprobs=1))
    assert llm.engine.stats().num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        check_against_transformers(hf, prompt, out.prompt_logprobs, 1)


@pytest.mark.parametrize("budget", [2048, 16])  # 49 tokens in chunks of 16: the last chunk is one token
def test_a_request_that_only_scores_its_prompt_samples_nothing(pair, budget, monkeypatch):
    """max_tokens 0 (the API's echo with max_tokens 0): the prompt is computed and scored, then the
    request ends with no token sampled, no logits row for sampling, and its blocks back in the pool."""
    hf, ours = pair
    prompt = prompt_ids(49)
    llm = LLM.from_model(ours, ByteTokenizer(300), EngineConfig(block_size=8, num_kv_blocks=64, max_num_batched_tokens=budget))

    def no_sampling(*args, **kwargs):
        raise AssertionError("a scoring request sampled")

    monkeypatch.setattr(llm.engine.sampler, "sample", no_sampling)
    out = llm.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=2, n=2))[0]
    assert [(c.token_ids, c.text, c.finish_reason) for c in out.outputs] == [([], "", "length")] * 2
    check_against_transformers(hf, prompt, out.prompt_logprobs, 2)
    stats = llm.engine.stats()
    assert stats.generation_tokens == 0 and stats.num_free_blocks == stats.num_blocks
    # a prompt as long as the context: nothing is generated, so it fits
    llm.engine.max_model_len = 49
    assert len(llm.generate([prompt], SamplingParams(max_tokens=0, prompt_logprobs=0))[0].prompt_logprobs) == 49


def test_prompt_logprobs_come_with_the_first_output_and_the_last(pair):
    """A stream echoes the prompt at once: its logprobs are in the request's first output (and again in
    the last, which holds everything), not in the ones between."""
    from locus.engine.core.engine_core import EngineCore

    _, ours = pair
    core = EngineCore(ours, ByteTokenizer(300), EngineConfig(block_size=8, num_kv_blocks=64))
    core.add_request("r", prompt_ids(20), SamplingParams(max_tokens=4, temperature=0, prompt_logprobs=1, ignore_eos=True))
    outputs = []
    while core.has_unfinished():
        outputs += core.step()
    assert [o.prompt_logprobs is not None for o in outputs] == [True, False, False, True]
    assert len(outputs[0].prompt_logprobs) == 20 and outputs[0].prompt_logprobs is outputs[-1].prompt_logprobs
