"""The continuous-batching engine: exactness against single-sequence runs, prefix caching, seeds,
aborts, n > 1 and the async front end."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from locus.engine.frontend.async_engine import AsyncEngine
from locus.engine.core.engine_core import EngineConfig, EngineCore
from locus.engine.model.generate import generate_tokens
from locus.engine.frontend.llm import LLM
from locus.engine.sampling.sampler import InvalidParameter, SamplingParams


def random_prompts(count: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (count,), generator=g).tolist()
    return [torch.randint(0, 256, (n,), generator=g).tolist() for n in lengths]


GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def test_32_concurrent_prompts_equal_running_each_alone_under_preemption_and_chunking(tiny, tok):
    prompts = random_prompts(32, 1, 300, seed=0)
    prompts[0] = prompts[0][:1]  # a 1-token prompt
    prompts[1] = (prompts[1] * 300)[:300]
    # 60 blocks x 16 = 960 tokens of KV for ~4.8k prompt tokens; 256-token step budget
    llm = LLM.from_model(tiny, tok, EngineConfig(block_size=16, num_kv_blocks=60, max_num_batched_tokens=256))
    outs = llm.generate(prompts, GREEDY)
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0, "the pool was meant to be too small"
    assert stats.num_chunked_prefills > 0, "a prompt longer than the step budget was meant to be chunked"
    for prompt, out in zip(prompts, outs):
        assert out.finished and out.outputs[0].finish_reason == "length"
        assert out.outputs[0].token_ids == generate_tokens(tiny, prompt, 16)
    assert stats.num_free_blocks == stats.num_blocks


def test_prefix_caching_reuses_blocks_and_keeps_outputs(tiny, tok):
    prefix = random_prompts(1, 256, 256, seed=1)[0]
    first, second = prefix + [1, 2, 3], prefix + [9, 8, 7, 6]
    cached = LLM.from_model(tiny, tok, EngineConfig(block_size=16, num_kv_blocks=200))
    cached.generate([first], GREEDY)
    before = cached.engine.stats()
    out = cached.generate([second], GREEDY)[0]
    after = cached.engine.stats()
    assert after.prefix_cache_hits - before.prefix_cache_hits == 256 // 16
    uncached = LLM.from_model(tiny, tok, EngineConfig(block_size=16, num_kv_blocks=200, enable_prefix_caching=False))
    ref = uncached.generate([second], GREEDY)[0]
    assert uncached.engine.stats().prefix_cache_hits == 0
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids == generate_tokens(tiny, second, 16)


def test_same_seed_same_sample_alone_or_in_a_batch_of_16(tiny, tok):
    prompts = random_prompts(16, 5, 60, seed=2)
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=24, ignore_eos=True)
    alone = LLM.from_model(tiny, tok).generate([prompts[3]], params)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.2, seed=i, max_tokens=10 + i, ignore_eos=True) for i in range(16)]
    others[3] = params
    batched = LLM.from_model(tiny, tok).generate(prompts, others)[3].outputs[0].token_ids
    assert alone == batched
    different = LLM.from_model(tiny, tok).generate([prompts[3]], SamplingParams(**{**params.__dict__, "seed": 99}))
    assert different[0].outputs[0].token_ids != alone


def test_abort_mid_decode_frees_every_block(tiny, tok):
    core = EngineCore(tiny, tok, EngineConfig(block_size=4, num_kv_blocks=64))
    core.add_request("a", list(range(30)), SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    core.add_request("b", list(range(40, 50)), SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    for _ in range(5):
        core.step()
    assert core.stats().num_free_blocks < 64
    out = core.abort("a")
    assert out.finished and out.outputs[0].finish_reason == "abort" and len(out.outputs[0].token_ids) >= 3
    held_by_b = len(core.requests["b"].seqs[0].block_table)
    assert core.stats().num_free_blocks == 64 - held_by_b
    core.abort("b")
    assert core.stats().num_free_blocks == 64 and not core.has_unfinished()


def test_200_random_adds_and_aborts_leave_the_pool_full(tiny, tok):
    rng = random.Random(0)
    core = EngineCore(tiny, tok, EngineConfig(block_size=4, num_kv_blocks=48, max_num_batched_tokens=64))
    live: list[str] = []
    for i in range(200):
        op = rng.random()
        if op < 0.45 or not live:
            n = rng.choice([1, 2])
            prompt = [rng.randrange(256) for _ in range(rng.randint(1, 40))]
            core.add_request(f"r{i}", prompt, SamplingParams(n=n, temperature=rng.choice([0, 1.0]), seed=i,
                                                             max_tokens=rng.randint(1, 12)))
            live.append(f"r{i}")
        elif op < 0.7:
            core.abort(live.pop(rng.randrange(len(live))))
        else:
            for out in core.step():
                if out.finished and out.request_id in live:
                    live.remove(out.request_id)
        blocks = core.blocks
        assert sum(1 for c in blocks.ref_count if c == 0) == blocks.num_free_blocks
    for request_id in live:
        core.abort(request_id)
    assert core.stats().num_free_blocks == core.stats().num_blocks
    assert all(c == 0 for c in core.blocks.ref_count)


def test_n_choices_share_the_prompt_blocks(tiny, tok):
    core = EngineCore(tiny, tok, EngineConfig(block_size=8, num_kv_blocks=64))
    prompt = list(range(1, 21))  # 2 full blocks + a partial one
    core.add_request("n3", prompt, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True))
    core.step()  # prefill, fork, first tokens
    seqs = core.requests["n3"].seqs
    assert len(seqs) == 3
    full = seqs[0].block_table[:2]
    assert all(s.block_table[:2] == full for s in seqs)
    assert all(core.blocks.ref_count[b] == 3 for b in full)
    # forking allocates nothing: the partial tail block is shared too until it is written
    assert len({s.block_table[2] for s in seqs}) == 1 and core.stats().num_free_blocks == 64 - 3
    core.step()  # the first decode writes the tail: two sequences copy it, the last keeps it
    assert all(s.block_table[:2] == full for s in seqs)
    assert len({s.block_table[2] for s in seqs}) == 3
    assert core.stats().num_free_blocks == 64 - 2 - 3
    outs = {}
    while core.has_unfinished():
        for out in core.step():
            outs[out.request_id] = out
    texts = [c.token_ids for c in outs["n3"].outputs]
    assert len(texts) == 3 and len({tuple(t) for t in texts}) > 1
    again = LLM.from_model(tiny, tok).generate([prompt], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True))
    assert [c.token_ids for c in again[0].outputs] == texts


def test_stop_strings_and_eos_finish_requests(tiny, tok):
    llm = LLM.from_model(tiny, tok)
    # a random model: find a prompt whose greedy continuation has some clean text to stop on
    for prompt in ["hello", "The expert said", "abc", "Once upon a time", "xyz", "0123"]:
        free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))[0].outputs[0]
        clean = free.text.replace("\ufffd", "")
        if len(clean) >= 6:
            break
    stop = clean[3:5]
    assert stop, f"no clean text in {free.text!r}"
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, stop=(stop,)))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == free.text[: free.text.index(stop)]
    assert stop not in out.text
    eos_id = free.token_ids[2]
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16, stop_token_ids=(eos_id,)))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == eos_id and out.token_ids[-1] == eos_id


def test_requests_that_cannot_run_are_rejected_clearly(tiny, tok):
    core = EngineCore(tiny, tok, EngineConfig(block_size=16, num_kv_blocks=8, max_model_len=100))
    with pytest.raises(InvalidParameter, match="context limit is 100") as e:
        core.add_request("long", list(range(150)), SamplingParams(max_tokens=1))
    assert e.value.param == "prompt"
    with pytest.raises(InvalidParameter, match="max_tokens"):
        core.add_request("sum", list(range(60)), SamplingParams(max_tokens=50))
    with pytest.raises(InvalidParameter, match="outside the vocabulary"):
        core.add_request("vocab", [5, 100000], SamplingParams())
    with pytest.raises(InvalidParameter, match="empty"):
        core.add_request("empty", [], SamplingParams())
    assert not core.has_unfinished()


def test_async_engine_streams_and_cancellation_frees_blocks(tiny, tok):
    core = EngineCore(tiny, tok, EngineConfig(block_size=4, num_kv_blocks=128))
    engine = AsyncEngine(core)
    engine.start()

    async def scenario():
        params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
        deltas, last = [], None
        async for out in engine.generate(tok.encode("stream me"), params):
            deltas.extend(out.outputs[0].delta_token_ids)
            last = out
        assert last.finished and deltas == last.outputs[0].token_ids == generate_tokens(tiny, tok.encode("stream me"), 20)

        async def consume_a_little():
            seen = 0
            async for out in engine.generate(tok.encode("cancel me"), SamplingParams(temperature=0, max_tokens=500, ignore_eos=True)):
                seen += len(out.outputs[0].delta_token_ids)
                if seen >= 3:
                    return  # leaving the loop closes the generator: the request is aborted

        await asyncio.gather(*(consume_a_little() for _ in range(8)))
        for _ in range(200):
            if engine.stats().num_free_blocks == 128 and engine.stats().num_running == 0:
                break
            await asyncio.sleep(0.02)

    try:
        asyncio.run(scenario())
        stats = engine.stats()
        assert stats.num_free_blocks == stats.num_blocks and stats.num_running == 0 and stats.num_waiting == 0
    finally:
        engine.shutdown()


def test_outputs_carry_deltas_and_only_the_last_one_the_whole_choice(tiny, tok):
    """Per-step outputs must not copy the whole generation (quadratic over a long output)."""
    core = EngineCore(tiny, tok, EngineConfig(block_size=8, num_kv_blocks=64))
    core.add_request("d", [1, 2, 3], SamplingParams(n=2, temperature=0, max_tokens=30, ignore_eos=True, logprobs=1))
    outputs = []
    while core.has_unfinished():
        outputs += core.step()
    *running, last = outputs
    assert len(running) == 29 and last.finished
    for out in running:
        assert all(c.token_ids == [] and c.text == "" and c.logprobs == [] for c in out.outputs)
    for i, choice in enumerate(last.outputs):
        deltas = [t for out in outputs if len(out.outputs) > i for t in out.outputs[i].delta_token_ids]
        assert deltas == choice.token_ids and len(choice.token_ids) == 30 == len(choice.logprobs)
        assert "".join(out.outputs[i].delta_text for out in outputs if len(out.outputs) > i) == choice.text


def run_streaming(core: EngineCore) -> tuple[list[str], list[int], object]:
    """Step a one-request engine to the end: each step's delta text, all delta ids, the last output."""
    deltas, ids, last = [], [], None
    for _ in range(200):
        for out in core.step():
            c = out.outputs[0]
            deltas.append(c.delta_text)
            ids += c.delta_token_ids
            last = out
        if last is not None and last.finished:
            return deltas, ids, last
    raise AssertionError("the request did not finish in 200 steps")


def test_a_request_resumed_from_streamed_output_continues_the_same_stream(tiny, tok):
    """What elastic EP does with a lost rank's request: another engine takes the streamed tokens as
    output already sent; the client's concatenated deltas, final ids, text and logprobs are unchanged,
    even when the cut falls inside a multi-byte character or a held-back stop string prefix."""
    from locus.engine.requests.sequence import Resumed

    prompt = random_prompts(1, 12, 12, seed=5)[0]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1, stop=["\x7f\x7f"])
    whole = EngineCore(tiny, tok, EngineConfig(block_size=16, num_kv_blocks=64))
    whole.add_request("r", prompt, params)
    deltas, ids, final = run_streaming(whole)
    want = final.outputs[0]
    assert len(ids) == 24 and "".join(deltas) == want.text
    per_token = deltas  # one token a step: the text each token's step delivered
    assert len(per_token) == 24
    for cut in (1, 5, 11, 17, 23):
        core = EngineCore(tiny, tok, EngineConfig(block_size=16, num_kv_blocks=64))
        core.add_request("r", prompt, params, resumed=Resumed(ids[:cut], want.logprobs[:cut]))
        more, more_ids, last = run_streaming(core)
        got = last.outputs[0]
        assert "".join(per_token[:cut]) + "".join(more) == want.text, cut
        assert ids[:cut] + more_ids == ids and got.token_ids == want.token_ids and got.text == want.text
        assert [p.token_id for p in got.logprobs] == [p.token_id for p in want.logprobs]
    with pytest.raises(InvalidParameter, match="n = 1"):
        whole.add_request("n2", prompt, SamplingParams(n=2, max_tokens=4), resumed=Resumed([1]))
