"""AsyncEngine drives any engine backend (locus/engine/core/backend.py) with one loop: a scripted backend
(no model) stands in for rank 0's driver of an expert-parallel server, whose adds are refused late,
whose aborted outputs come back from a later step, and which may survive a failed step; and
build_engine assembles the single-process engine that the server, LLM and the benches share."""

from __future__ import annotations

import asyncio
import threading

import pytest

from locus.engine.frontend.async_engine import AsyncEngine, EngineDeadError
from locus.engine.core.backend import LocalBackend
from locus.engine.frontend.build import build_engine
from locus.engine.core.engine_core import EngineStats, ValidatedRequest
from locus.engine.frontend.health import EngineHealth
from locus.engine.core.outputs import CompletionOutput, RequestOutput
from locus.engine.sampling.sampler import SamplingParams
from locus.engine.requests.sequence import RequestMetrics
from locus.errors import LocusError


def output(request_id: str, token: int, finish: str | None) -> RequestOutput:
    choice = CompletionOutput(index=0, text="", token_ids=[], delta_text="", delta_token_ids=[token],
                              finish_reason=finish)
    return RequestOutput(request_id, [1], [choice], finish is not None, RequestMetrics())


class FakeCore:
    """What AsyncEngine reads of a backend's core: validation only."""

    def validate(self, prompt_ids, params) -> ValidatedRequest:
        return ValidatedRequest(list(prompt_ids), params)


class ScriptedBackend:
    """Each request runs `tokens` steps, one token a step; a request whose prompt is [0] is refused
    after `add` took it (as a rank refuses it); an abort's output comes back from the next step; the
    step numbered `fail_at` raises once, and `recover` survives it when `recovers`."""

    def __init__(self, tokens: int = 3, fail_at: int | None = None, recovers: bool = True):
        self.core = FakeCore()
        self.tokens, self.fail_at, self.recovers = tokens, fail_at, recovers
        self.left: dict[str, int] = {}
        self.aborted: list[str] = []
        self.refused: list[tuple[str, str]] = []
        self.steps = 0
        self.recovered: list[BaseException] = []
        self.closed = threading.Event()

    def add(self, request_id, request, domain):
        if request.prompt_ids == [0]:
            self.refused.append((request_id, "refused by its rank"))
        else:
            self.left[request_id] = self.tokens

    def abort(self, request_id):
        if request_id in self.left:
            self.aborted.append(request_id)
        return None  # comes back from the next step

    def step(self):
        self.steps += 1
        if self.steps == self.fail_at:
            raise RuntimeError("a collective failed")
        outs = [output(r, 0, "abort") for r in self.aborted]
        for r in self.aborted:
            self.left.pop(r, None)
        self.aborted = []
        for r in list(self.left):
            self.left[r] -= 1
            outs.append(output(r, self.tokens - self.left[r], "length" if self.left[r] == 0 else None))
            if self.left[r] == 0:
                del self.left[r]
        return outs

    def stats(self):
        return EngineStats(**{name: 0 for name in EngineStats.__dataclass_fields__})

    def has_unfinished(self):
        return bool(self.left) or bool(self.aborted)

    def requests(self):
        return list(self.left)

    def wait_s(self):
        return 0.0 if self.has_unfinished() else 0.01  # a heartbeat while idle

    def take_refused(self):
        refused, self.refused = self.refused, []
        return refused

    def recoverable(self, exc):
        return True

    def recover(self, exc):
        self.recovered.append(exc)
        return self.recovers

    def explain(self, exc):
        return RuntimeError(f"explained: {exc}")

    def close(self):
        self.closed.set()
        return []

    def interrupt(self):
        pass

    expert_load = None


async def collect(engine: AsyncEngine, prompt: list[int], request_id: str) -> list[RequestOutput]:
    return [out async for out in engine.generate(prompt, SamplingParams(max_tokens=3), request_id)]


def test_one_loop_drives_a_backend_that_is_not_an_engine_core():
    backend = ScriptedBackend(tokens=3)
    engine = AsyncEngine(backend)
    engine.start()
    try:
        outs = asyncio.run(collect(engine, [5, 6], "a"))
        assert [t for o in outs for t in o.outputs[0].delta_token_ids] == [1, 2, 3] and outs[-1].finished
        with pytest.raises(LocusError, match="refused by its rank"):  # refused after add: the stream says why
            asyncio.run(collect(engine, [0], "b"))
        assert engine.healthy
    finally:
        engine.shutdown()
    assert backend.closed.is_set()  # the backend was told the loop stops (rank 0 stops every rank)


def test_an_abort_whose_output_comes_from_a_later_step_reaches_the_stream():
    backend = ScriptedBackend(tokens=1000)
    engine = AsyncEngine(backend)
    engine.start()

    async def scenario():
        stream = engine.add([5], SamplingParams(max_tokens=1000), "a")
        first = await stream.__anext__()
        assert not first.finished
        engine.abort("a")
        last = first
        async for out in stream:
            last = out
        return last

    try:
        last = asyncio.run(scenario())
        assert last.finished and last.outputs[0].finish_reason == "abort"
    finally:
        engine.shutdown()


def test_a_failed_step_the_backend_survives_keeps_the_engine_serving():
    backend = ScriptedBackend(tokens=3, fail_at=2, recovers=True)
    engine = AsyncEngine(backend)
    engine.start()
    try:
        outs = asyncio.run(collect(engine, [5], "a"))
        assert outs[-1].finished and engine.healthy
        assert [str(e) for e in backend.recovered] == ["a collective failed"]
    finally:
        engine.shutdown()


def test_a_failed_step_the_backend_cannot_survive_ends_the_engine_with_its_explanation():
    died = threading.Event()
    seen: list[BaseException] = []
    backend = ScriptedBackend(tokens=3, fail_at=2, recovers=False)
    engine = AsyncEngine(backend, on_dead=lambda exc: (seen.append(exc), died.set()))
    engine.start()
    try:
        with pytest.raises(EngineDeadError):
            asyncio.run(collect(engine, [5], "a"))
        assert died.wait(5) and str(seen[0]) == "explained: a collective failed"
        assert not engine.healthy
    finally:
        engine.shutdown()


def test_build_engine_makes_the_single_process_engine_the_server_and_llm_use():
    built = build_engine("tiny", dtype="float32", device="cpu", moe_backend="torch", burst_wait_s=0.002)
    assert isinstance(built.backend, LocalBackend) and built.core is built.backend.core
    assert built.loaded.random_weights and built.burst_wait_s == 0.002
    engine = built.serve()
    assert engine.burst_wait_s == 0.002
    engine.start()
    try:
        params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

        async def run():
            return [o async for o in engine.generate([1, 2, 3], params, "x")]

        outs = asyncio.run(run())
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 4
    finally:
        engine.shutdown()


def test_the_engine_interface_reads_the_one_process_engine():
    """What the server reads (frontend/health.py): the engine's fixed facts, its health before and after it
    stops, the counters of a finished request, no recording, the expert load, and no expert parallelism."""
    built = build_engine("tiny", dtype="float32", device="cpu", moe_backend="torch")
    core = built.core
    engine = built.serve()
    info = engine.info
    assert (info.tokenizer, info.max_model_len, info.vocab_size) == (core.tokenizer, core.max_model_len,
                                                                     core.model.config.vocab_size)
    assert (info.num_blocks, info.block_size, info.grammars) == (core.blocks.num_blocks, core.blocks.block_size,
                                                                 core.grammars)
    assert engine.health() == EngineHealth(running=False, error=None)  # not started
    engine.start()
    try:
        assert engine.health() == EngineHealth(running=True, error=None, ep=None)

        async def run():
            request = engine.validate([1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))
            return [o async for o in engine.admit(request, "r")]

        asyncio.run(run())
        assert engine.stats().prompt_tokens == 3 and engine.stats().generation_tokens == 2
        assert engine.recording().state == "idle" and engine.recording().failures == 0
        load = engine.expert_load()
        assert sorted(load) == list(core.model.config.moe_layers) and sum(map(sum, load.values())) > 0
        assert engine.ep_ranks() == [] and engine.ep_stats() is None and engine.admission_log() is None
    finally:
        engine.shutdown()
    assert not engine.health().running
