"""AsyncEngine's hand-over to the event loop: a reader that falls behind gets its backlog as one
merged output, and nothing is lost or reordered on the way; an idle engine gathers a burst of
arrivals into its first step."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from locus.engine.frontend import async_engine
from locus.engine.frontend.async_engine import AsyncEngine
from locus.engine.frontend.request_stream import OutputSink
from locus.engine.core.engine_core import EngineConfig, EngineCore
from locus.engine.model.generate import generate_tokens
from locus.engine.core.outputs import CompletionOutput, RequestOutput, merge_outputs
from locus.engine.sampling.sampler import SamplingParams, TokenLogprob
from locus.engine.requests.sequence import RequestMetrics


def step_output(tokens_so_far: list[int], new: list[int], finish: str | None = None) -> RequestOutput:
    text = "".join(chr(97 + t % 26) for t in tokens_so_far + new)
    lps = [TokenLogprob(t, -float(t), []) for t in new]
    choice = CompletionOutput(index=0, text=text, token_ids=tokens_so_far + new, delta_text=text[len(tokens_so_far):],
                              delta_token_ids=list(new), delta_logprobs=lps, logprobs=None, finish_reason=finish,
                              stop_reason=None)
    return RequestOutput("r", [1, 2], [choice], finish is not None, RequestMetrics(arrival_time=0.0))


def test_merged_outputs_carry_both_deltas_and_the_later_state():
    a, b = step_output([], [3, 4]), step_output([3, 4], [5], finish="length")
    m = merge_outputs(a, b).outputs[0]
    assert m.delta_token_ids == [3, 4, 5] and m.token_ids == [3, 4, 5]
    assert m.delta_text == a.outputs[0].delta_text + b.outputs[0].delta_text == m.text
    assert [lp.token_id for lp in m.delta_logprobs] == [3, 4, 5]
    assert m.finish_reason == "length" and merge_outputs(a, b).finished


def test_sink_merges_a_backlog_and_keeps_an_error_after_it_for_the_next_read():
    async def scenario():
        sink = OutputSink()
        first, second = step_output([], [7]), step_output([7], [8])
        sink.put(first)
        assert await sink.get() is first  # one waiting output comes back as it is
        sink.put(first)
        sink.put(second)
        err = RuntimeError("engine died")
        sink.put(err)
        merged = await sink.get()
        assert merged.outputs[0].delta_token_ids == [7, 8]
        assert await sink.get() is err
        waiter = asyncio.ensure_future(sink.get())  # an empty sink waits for the next put
        await asyncio.sleep(0)
        assert not waiter.done()
        sink.put(second)
        assert await waiter is second

    asyncio.run(scenario())


def test_a_slow_reader_gets_fewer_outputs_and_every_token_and_logprob_in_order(tiny, tok):
    core = EngineCore(tiny, tok, EngineConfig(block_size=4, num_kv_blocks=64))
    stepped, step = [], core.step

    def counted():
        outputs = step()
        stepped.append(len(outputs))
        return outputs

    core.step = counted
    engine = AsyncEngine(core)
    engine.start()
    prompt = tok.encode("lagging reader")
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)

    async def read_slowly():
        outputs = []
        async for out in engine.generate(prompt, params):
            outputs.append(out)
            # the engine steps on meanwhile: two more of its steps (or the end) before the next read, however
            # long a step takes on a loaded machine (a fixed 50 ms sleep read every step alone when slower)
            seen, deadline = len(stepped), time.monotonic() + 60
            while len(stepped) < seen + 2 and core.has_unfinished() and time.monotonic() < deadline:
                await asyncio.sleep(0.005)
        return outputs

    try:
        outputs = asyncio.run(read_slowly())
    finally:
        engine.shutdown()
    choices = [o.outputs[0] for o in outputs]
    final = choices[-1]
    assert outputs[-1].finished and final.finish_reason == "length"
    assert len(outputs) < 24  # some reads took several steps' tokens at once
    assert [t for c in choices for t in c.delta_token_ids] == final.token_ids == generate_tokens(tiny, prompt, 24)
    assert "".join(c.delta_text for c in choices) == final.text
    assert [lp.token_id for c in choices for lp in c.delta_logprobs] == final.token_ids
    assert [lp.token_id for lp in final.logprobs] == final.token_ids


def test_a_final_only_reader_gets_just_the_finished_output_with_one_wake_up(tiny, tok):
    """The engine thread hands a whole-response request only its finished output: one wake-up of
    the event loop (which shares the cores with the forward) instead of one per step."""
    core = EngineCore(tiny, tok, EngineConfig(block_size=4, num_kv_blocks=64))
    engine = AsyncEngine(core)
    engine.start()
    prompt = tok.encode("whole response")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    async def read(final_only: bool):
        loop = asyncio.get_running_loop()
        calls, real = [], loop.call_soon_threadsafe

        def counted(callback, *args, **kwargs):
            calls.append(callback)
            return real(callback, *args, **kwargs)

        loop.call_soon_threadsafe = counted
        outs = [out async for out in engine.generate(prompt, params, final_only=final_only)]
        return outs, calls

    try:
        (streamed, stream_calls), (whole, whole_calls) = asyncio.run(read(False)), asyncio.run(read(True))
    finally:
        engine.shutdown()
    assert len(streamed) > 1 and len(stream_calls) >= 12  # a streamed reader is handed every step's output
    assert len(whole) == 1 and whole[0].finished and len(whole_calls) == 1
    assert whole[0].outputs[0].token_ids == streamed[-1].outputs[0].token_ids == generate_tokens(tiny, prompt, 12)
    assert whole[0].outputs[0].text == streamed[-1].outputs[0].text


def burst_run(tiny, tok, burst_wait_s: float, gaps: list[float]) -> tuple[float, list[tuple[float, int]]]:
    """A fresh engine gets one request, then one more after each gap; every request is read to the
    end. Returns when the first was added and (time, number of outputs) of every step (monotonic; the
    time the step started: how long the engine waited, without the forward's time, which a loaded
    machine stretches)."""
    core = EngineCore(tiny, tok, EngineConfig(block_size=4, num_kv_blocks=64))
    steps, step = [], core.step

    def counted():
        started = time.monotonic()
        outputs = step()
        steps.append((started, len(outputs)))
        return outputs

    core.step = counted
    engine = AsyncEngine(core, burst_wait_s=burst_wait_s)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)

    async def main():
        start = time.monotonic()
        streams = [engine.add(tok.encode("burst 0"), params)]
        for i, gap in enumerate(gaps, 1):
            await asyncio.sleep(gap)
            streams.append(engine.add(tok.encode(f"burst {i}"), params))
        for stream in streams:
            async with stream:
                async for _ in stream:
                    pass
        return start

    engine.start()
    try:
        return asyncio.run(main()), steps
    finally:
        engine.shutdown()


def test_an_idle_engine_prefills_a_burst_in_one_step_and_a_trickle_by_the_cap(tiny, tok, monkeypatch):
    # a burst: gaps shorter than the quiet period, so all three are in the first step
    _, steps = burst_run(tiny, tok, 0.15, [0.03, 0.03])
    assert steps[0][1] == 3, steps
    # a lone request waits one quiet period, not more
    start, steps = burst_run(tiny, tok, 0.15, [])
    assert steps[0][1] == 1 and 0.1 < steps[0][0] - start < 0.15 * async_engine.BURST_WAIT_CAP
    # without the wait the first arrival is stepped at once, alone
    _, steps = burst_run(tiny, tok, 0.0, [0.03, 0.03])
    assert steps[0][1] == 1, steps
    # a trickle that never goes quiet starts at the cap with what has come
    monkeypatch.setattr(async_engine, "BURST_WAIT_CAP", 4)
    start, steps = burst_run(tiny, tok, 0.1, [0.04] * 15)  # 0.6 s of arrivals, never 0.1 s apart
    waited = steps[0][0] - start
    assert 0.4 <= waited < 0.6 and 5 <= steps[0][1] < 16, (waited, steps[:3])


class BusyDriver:
    """An expert-parallel driver (an engine backend, locus/engine/core/backend.py) whose iteration does not
    return: rank 0 inside an elastic regroup that waits for a hung rank. It returns once the server
    tells it to give up (`interrupt` sets `stopping`)."""

    def __init__(self, core):
        self.core, self.errors, self.added = core, [], []
        self.stopping, self.entered = threading.Event(), threading.Event()

    def add(self, request_id, request, domain):
        self.added.append(request_id)

    def abort(self, request_id):
        pass

    def requests(self):
        return list(self.added)

    def step(self):
        self.entered.set()
        self.stopping.wait(30)
        return []

    def stats(self):
        return self.core.stats()

    def has_unfinished(self):
        return bool(self.added)

    def wait_s(self):
        return 0.01

    def take_refused(self):
        return []

    def interrupt(self):
        self.stopping.set()

    def close(self):
        return []

    def recoverable(self, exc):
        return False

    def recover(self, exc):
        return False

    def explain(self, exc):
        return exc


def test_fail_all_reaches_every_stream_while_the_engine_thread_is_busy(tiny, tok):
    """Issue 41, finding 4: SIGTERM during an elastic regroup cut the streams at --graceful-timeout with
    no error frame: the fail-all command waited for an engine thread that was inside the regroup. Now
    the error reaches each stream at once, and the regroup under way is told to give up."""
    from locus.engine.frontend.async_engine import ShuttingDownError

    core = EngineCore(tiny, tok, EngineConfig(block_size=4, num_kv_blocks=64))
    driver = BusyDriver(core)

    async def scenario():
        engine = AsyncEngine(driver)
        engine.start()
        stream = engine.add([1, 2, 3], SamplingParams(max_tokens=4))
        assert await asyncio.to_thread(driver.entered.wait, 10)
        await asyncio.sleep(0.1)  # the engine thread is inside the iteration now
        engine.fail_all(ShuttingDownError("the server shut down before this request finished"))
        with pytest.raises(ShuttingDownError):
            await asyncio.wait_for(stream.__anext__(), 2)
        assert driver.stopping.is_set()
        await asyncio.to_thread(engine.shutdown, 5)

    asyncio.run(scenario())
