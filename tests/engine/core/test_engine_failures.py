"""The engine's failure policy: an error pinned on one request fails that request alone; any other
error in a step kills the async engine loudly (logged, every caller told, the exit hook called)."""

from __future__ import annotations

import asyncio
import logging
import threading

import pytest

from locus.engine.frontend.async_engine import AsyncEngine, EngineDeadError
from locus.engine.core.engine_core import EngineConfig, EngineCore, RequestFailedError
from locus.engine.model.generate import generate_tokens
from locus.engine.frontend.llm import LLM
from locus.engine.sampling.sampler import Sampler, SamplingParams

CURSED_SEED = 666  # a request parameter the (patched) sampler cannot handle


class CursedSampler(Sampler):
    def launch(self, logits, states, argmax=None):  # what the engine's step calls
        if any(s.params.seed == CURSED_SEED for s in states):
            raise OverflowError("cannot handle this request's parameters")
        return super().launch(logits, states, argmax)


def run(core: EngineCore) -> dict:
    finals = {}
    while core.has_unfinished():
        for out in core.step():
            if out.finished:
                finals[out.request_id] = out
    return finals


def test_a_row_the_sampler_cannot_handle_fails_only_its_request(tiny, tok):
    core = EngineCore(tiny, tok, EngineConfig(block_size=8, num_kv_blocks=64))
    core.sampler = CursedSampler(core.sampler.eos_token_ids)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    core.add_request("good-1", [1, 2, 3], greedy)
    core.add_request("cursed", [4, 5, 6], SamplingParams(n=2, temperature=1.0, seed=CURSED_SEED, max_tokens=6))
    core.add_request("good-2", [7, 8, 9, 10], greedy)
    finals = run(core)
    bad = finals["cursed"]
    assert bad.finished and isinstance(bad.error, RequestFailedError) and "OverflowError" in str(bad.error)
    assert [c.finish_reason for c in bad.outputs] == ["error", "error"]
    for rid, prompt in (("good-1", [1, 2, 3]), ("good-2", [7, 8, 9, 10])):
        assert finals[rid].error is None and finals[rid].outputs[0].token_ids == generate_tokens(tiny, prompt, 6)
    assert core.stats().num_free_blocks == 64 and not core.requests


def test_a_failure_while_appending_a_token_fails_only_that_request(tiny, tok):
    core = EngineCore(tiny, tok, EngineConfig(block_size=8, num_kv_blocks=64))
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, n=2)
    core.add_request("a", [1, 2, 3], params)
    core.add_request("b", [3, 2, 1], params)
    core.step()  # prefill + fork

    def broken(token):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "broken detokenizer")

    core.requests["a"].seqs[1].detokenizer.add = broken
    finals = run(core)
    assert isinstance(finals["a"].error, RequestFailedError)
    assert {c.finish_reason for c in finals["a"].outputs} == {"error"}
    assert finals["b"].error is None and [len(c.token_ids) for c in finals["b"].outputs] == [5, 5]
    assert core.stats().num_free_blocks == 64


def test_an_error_no_row_explains_propagates(tiny, tok):
    core = EngineCore(tiny, tok, EngineConfig(block_size=8, num_kv_blocks=64))
    core.sampler = CursedSampler(core.sampler.eos_token_ids)
    core.add_request("only", [1, 2], SamplingParams(temperature=1.0, seed=CURSED_SEED, max_tokens=3))
    with pytest.raises(OverflowError):
        core.step()


def test_offline_generate_raises_a_failed_request_and_leaves_the_engine_clean(tiny, tok):
    llm = LLM.from_model(tiny, tok, EngineConfig(block_size=8, num_kv_blocks=64))
    llm.engine.sampler = CursedSampler(llm.engine.sampler.eos_token_ids)
    ok = SamplingParams(temperature=0, max_tokens=4)
    with pytest.raises(RequestFailedError):
        llm.generate([[1, 2], [3, 4]], [ok, SamplingParams(temperature=1.0, seed=CURSED_SEED, max_tokens=4)])
    assert not llm.engine.requests and llm.engine.stats().num_free_blocks == 64
    assert llm.generate([[1, 2]], ok)[0].outputs[0].token_ids == generate_tokens(tiny, [1, 2], 4)


def test_a_fatal_step_error_is_logged_told_to_every_caller_and_calls_the_exit_hook(tiny, tok, caplog):
    core = EngineCore(tiny, tok, EngineConfig(block_size=8, num_kv_blocks=64))
    died = threading.Event()
    seen: list[BaseException] = []
    engine = AsyncEngine(core, on_dead=lambda exc: (seen.append(exc), died.set()))
    real_step = core.step
    calls = {"n": 0}

    def failing_step():
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("forward pass exploded")
        return real_step()

    core.step = failing_step

    async def scenario():
        engine.start()
        params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
        with pytest.raises(EngineDeadError, match="forward pass exploded"):
            async for _ in engine.generate([1, 2, 3], params):
                pass
        with pytest.raises(EngineDeadError):
            engine.add([4, 5], params)

    with caplog.at_level(logging.CRITICAL, logger="locus.engine"):
        asyncio.run(scenario())
    assert died.wait(5) and isinstance(seen[0], RuntimeError)
    assert not engine.healthy
    record = next(r for r in caplog.records if r.levelno == logging.CRITICAL)
    assert record.exc_info is not None and "forward pass exploded" in str(record.exc_info[1])
