"""The overlapped schedule (launched_step.py) against the serial one: the same tokens, stops, lengths,
aborts, preemptions, logprobs, grammars, traces and expert-load counts; at most one step of work
discarded and never a token delivered after a request's end. And the sync-free step: from the start
of a decode step to its one readback, nothing reads a value back from the device (tests/engine/
sync_guard.py, the CPU stand-in for CUDA's sync debug mode)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from locus.engine.checkpoint.presets import build_preset
from locus.engine.core.engine_core import EngineConfig, EngineCore
from locus.engine.model.generate import generate_tokens
from locus.engine.frontend.llm import LLM
from locus.engine.sampling.sampler import SamplingParams
from locus.engine.sampling.grammar import StructuredOutput
from tests.engine.sync_guard import record_syncs
from tests.engine.runner.test_decode_graph import check_decode_steps, run_to_completion
from tests.engine.runner.test_decode_graph_static import engine_with_graphs, staggered
from tests.engine.core.test_engine import random_prompts


def overlap_config(overlap: bool, **kw) -> EngineConfig:
    return EngineConfig(**{"block_size": 8, "num_kv_blocks": 64, **kw}, async_scheduling=overlap)


def count_fed_launches(core: EngineCore) -> list[bool]:
    """Whether each launch had the previous step still in flight (fed from its sampled ids)."""
    fed: list[bool] = []
    real = core.launch
    core.launch = lambda feed=None: fed.append(feed is not None) or real(feed)
    return fed


def run_collecting(core: EngineCore, aborts: dict[int, str] | None = None) -> tuple[dict, dict, dict]:
    """Step to the end. Returns (final outputs, per request and choice the delta ids delivered,
    per request the step of its final output); `aborts` {step: request id} aborts between steps.
    Fails if anything is delivered for a request after its final output."""
    finals, deltas, ended = {}, {}, {}
    step = 0

    def take(out):
        assert out.request_id not in finals, f"{out.request_id}: output after its final one"
        for c in out.outputs:
            deltas.setdefault(out.request_id, {}).setdefault(c.index, []).extend(c.delta_token_ids)
        if out.finished:
            finals[out.request_id], ended[out.request_id] = out, step

    while core.has_unfinished():
        if aborts and step in aborts and aborts[step] in core.requests:
            take(core.abort(aborts[step]))
        for out in core.step():
            take(out)
        step += 1
    for out in core.drain():  # a step still in flight after the last request ended delivers nothing
        take(out)
    return finals, deltas, ended


def count_sampled_rows(core: EngineCore) -> list[int]:
    """Rows each finished step had sampled (delivered or dropped)."""
    sampled: list[int] = []
    real = core.finish
    core.finish = lambda launched: sampled.append(
        sum(len(b.sample.seqs) for b in launched.batches if b.sample)) or real(launched)
    return sampled


def test_greedy_tokens_are_identical_with_chunking_forks_and_preemption(tiny, tok):
    prompts = random_prompts(8, 1, 50, seed=31)
    params = [SamplingParams(temperature=0.0, max_tokens=6 + 2 * i, ignore_eos=True, n=1 + i % 3) for i in range(8)]
    outs, fed = {}, None
    for overlap in (False, True):
        llm = LLM.from_model(tiny, tok, overlap_config(overlap, num_kv_blocks=28, max_num_batched_tokens=40))
        launches = count_fed_launches(llm.engine)
        outs[overlap] = [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)]
        stats = llm.engine.stats()
        assert stats.num_preemptions > 0 and stats.num_chunked_prefills > 0
        assert stats.num_free_blocks == stats.num_blocks
        fed = launches if overlap else fed
        assert any(launches) == overlap
    assert outs[True] == outs[False]
    assert [o[0] for o in outs[True][:3]] == [generate_tokens(tiny, p, 6 + 2 * i) for i, p in enumerate(prompts[:3])]
    assert sum(fed) > len(fed) // 2  # most steps really ran behind the one before


def test_seeded_sampling_logprobs_and_penalties_are_identical(tiny, tok):
    """Seeded rows draw one uniform per step whatever the schedule; penalties make the pipeline finish
    the step before the next is scheduled (their counts need the newest token)."""
    prompts = random_prompts(6, 5, 30, seed=32)
    params = [SamplingParams(temperature=0.9, top_p=0.9, top_k=40, seed=100 + i, max_tokens=12, ignore_eos=True,
                             logprobs=2, n=1 + i % 2, presence_penalty=0.5 if i == 4 else 0.0) for i in range(6)]
    runs = {}
    for overlap in (False, True):
        llm = LLM.from_model(tiny, tok, overlap_config(overlap))
        runs[overlap] = llm.generate(prompts, params)
    for a, b in zip(runs[False], runs[True]):
        for x, y in zip(a.outputs, b.outputs):
            assert x.token_ids == y.token_ids and x.text == y.text
            assert [(p.token_id, p.logprob, p.top) for p in x.logprobs] == [(p.token_id, p.logprob, p.top) for p in y.logprobs]


def test_stop_strings_and_stop_tokens_end_exactly_and_discard_one_step_at_most(tiny, tok):
    """A stop found in step N's token ends the request with the serial engine's text; the step N + 1
    launched meanwhile is dropped for it: nothing more is delivered, and its blocks come back."""
    prompts = random_prompts(8, 4, 20, seed=33)
    free = LLM.from_model(tiny, tok, overlap_config(False)).generate(
        prompts, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    params = []
    for i, out in enumerate(free):
        ids = out.outputs[0].token_ids
        if i % 2:  # a stop token met mid-way
            params.append(SamplingParams(temperature=0, max_tokens=20, stop_token_ids=(ids[5 + i],)))
        else:  # a stop string: two characters of the free text
            clean = out.outputs[0].text
            params.append(SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=(clean[4:6],)))
    results = {}
    for overlap in (False, True):
        core = EngineCore(tiny, tok, overlap_config(overlap))
        sampled = count_sampled_rows(core)
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            core.add_request(f"r{i}", prompt, p)
        finals, deltas, _ = run_collecting(core)
        stats = core.stats()
        assert stats.num_free_blocks == stats.num_blocks
        for rid, out in finals.items():
            assert deltas[rid][0] == out.outputs[0].token_ids
        discarded = sum(sampled) - sum(len(o.outputs[0].token_ids) for o in finals.values())
        assert (1 <= discarded <= len(prompts)) if overlap else discarded == 0  # one step per stopped request at most
        results[overlap] = {rid: (o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason,
                                  o.outputs[0].stop_reason) for rid, o in finals.items()}
        assert all(r[2] == "stop" for r in results[overlap].values())
    assert results[True] == results[False]


def test_max_tokens_wastes_no_step(tiny, tok):
    """A sequence whose token in flight is its last is not scheduled again: every row the overlapped
    engine sampled became a delivered token."""
    core = EngineCore(tiny, tok, overlap_config(True))
    sampled = count_sampled_rows(core)
    for i, prompt in enumerate(random_prompts(5, 3, 25, seed=34)):
        core.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=3 + 4 * i, ignore_eos=True))
    finals, deltas, _ = run_collecting(core)
    assert [len(finals[f"r{i}"].outputs[0].token_ids) for i in range(5)] == [3 + 4 * i for i in range(5)]
    assert sum(sampled) == sum(3 + 4 * i for i in range(5))


def test_an_abort_while_a_step_is_in_flight_delivers_nothing_more(tiny, tok):
    core = EngineCore(tiny, tok, overlap_config(True, block_size=4))
    core.add_request("a", list(range(30)), SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    core.add_request("b", list(range(40, 50)), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    finals, deltas, ended = run_collecting(core, aborts={6: "a"})
    a = finals["a"].outputs[0]
    assert a.finish_reason == "abort" and deltas["a"][0] == a.token_ids and 3 <= len(a.token_ids) < 50
    assert a.token_ids == generate_tokens(tiny, list(range(30)), len(a.token_ids))
    assert finals["b"].outputs[0].token_ids == generate_tokens(tiny, list(range(40, 50)), 12)
    stats = core.stats()
    assert stats.num_free_blocks == stats.num_blocks and not core.requests and core.in_flight is None


def test_prompt_logprobs_and_a_grammar_work_overlapped(tiny, tok):
    """Prompt logprobs come back with their step's readback; a constrained request's steps are finished
    before the next is scheduled (its mask needs the newest token), its free neighbours still overlap."""
    so = StructuredOutput("regex", "(ab|cd){3,6}")
    params = [SamplingParams(temperature=0, max_tokens=10, prompt_logprobs=2, ignore_eos=True),
              SamplingParams(temperature=1.0, seed=3, max_tokens=16, structured=so),
              SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)]
    prompts = random_prompts(3, 10, 30, seed=35)
    runs = {}
    for overlap in (False, True):
        llm = LLM.from_model(tiny, tok, overlap_config(overlap, max_num_batched_tokens=16))
        fed = count_fed_launches(llm.engine)
        runs[overlap] = llm.generate(prompts, params)
        assert any(fed) == overlap
    serial, overlapped = runs[False], runs[True]
    assert [(p.token_id, p.logprob, p.rank, p.top) for p in overlapped[0].prompt_logprobs[1:]] == \
        [(p.token_id, p.logprob, p.rank, p.top) for p in serial[0].prompt_logprobs[1:]]
    assert len(overlapped[0].prompt_logprobs) == len(prompts[0])
    assert [o.outputs[0].token_ids for o in overlapped] == [o.outputs[0].token_ids for o in serial]
    text = overlapped[1].outputs[0].text
    assert overlapped[1].outputs[0].finish_reason == "stop" and len(text) >= 6 and set(text) <= set("abcd")


def test_recorded_traces_and_expert_load_equal_the_serial_engines(tiny, tok, tmp_path):
    """The routing rides the step's readback; rows of a step discarded for a stopped sequence are not
    published, so the trace and the /metrics counters are the serial engine's."""
    prompts = random_prompts(5, 3, 20, seed=36)
    free = LLM.from_model(tiny, tok, overlap_config(False)).generate(
        prompts, SamplingParams(temperature=0, max_tokens=14, ignore_eos=True))
    params = [SamplingParams(temperature=0, max_tokens=14, n=1 + i % 2, stop_token_ids=(o.outputs[0].token_ids[4 + i],))
              for i, o in enumerate(free)]
    traces, loads = {}, {}
    for overlap in (False, True):
        core = EngineCore(tiny, tok, overlap_config(overlap))
        core.start_recording(tmp_path / f"trace-{overlap}", "tiny")
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            core.add_request(f"r{i}", prompt, p)
        run_collecting(core)
        core.dump_recording()
        loads[overlap] = core.expert_load.totals()
        path = tmp_path / f"trace-{overlap}"
        traces[overlap] = ([json.loads(line) for line in (path / "requests.jsonl").read_text().splitlines()],
                           np.load(path / "expert_ids.npy"))
    assert traces[True][0] == traces[False][0] and len(traces[True][0]) == 5 + 2  # n = 2 choices are requests
    assert np.array_equal(traces[True][1], traces[False][1])
    assert np.array_equal(loads[True], loads[False])


def test_fed_decode_graph_steps_give_the_eager_logits(tiny, tok, monkeypatch):
    """Overlapped decode-graph steps, their tokens fed on the device from the step before: every step's
    logits against the eager runner fed the same way, buckets 4 down to 1, and the serial eager
    engine's tokens."""
    core = engine_with_graphs(tiny, tok, (1, 2, 4), num_kv_blocks=48, max_num_seqs=4, async_scheduling=True)
    checked = check_decode_steps(core, monkeypatch)
    fed = count_fed_launches(core)
    prompts, params = random_prompts(4, 20, 40, seed=38), staggered(4, 3, 3)
    fast = run_to_completion(core, prompts, params)
    assert {core.graphs.bucket(n) for n in checked} == {1, 2, 4} and sum(fed) >= len(checked) - 1
    serial = EngineCore(tiny, tok, EngineConfig(block_size=16, num_kv_blocks=48, max_num_seqs=4))
    assert [o.outputs[0].token_ids for o in fast] == [o.outputs[0].token_ids for o in run_to_completion(serial, prompts, params)]


def guard_decode_launches(core: EngineCore) -> list:
    """Record host syncs during every launch that ran the decode graphs (schedule, stage, forward,
    sample, queue the readback). Returns the list of what was found, per guarded launch."""
    found_per_launch: list = []
    real = core.launch
    graphs = core.graphs

    def guarded(feed=None):
        before = graphs.steps
        with record_syncs() as found:
            launched = real(feed)
        if graphs.steps > before:
            found_per_launch.append(list(found))
        return launched

    core.launch = guarded
    return found_per_launch


GUARDED = {
    "greedy": SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
    "seeded": SamplingParams(temperature=0.8, top_p=0.9, top_k=20, min_p=0.01, seed=5, max_tokens=4, ignore_eos=True),
    "logprobs+min_tokens": SamplingParams(temperature=0, max_tokens=4, logprobs=3, min_tokens=3, stop_token_ids=(7,)),
    "penalties": SamplingParams(temperature=0.8, seed=6, max_tokens=4, repetition_penalty=1.2, frequency_penalty=0.5,
                                presence_penalty=0.2, ignore_eos=True),
    "grammar": SamplingParams(temperature=1.0, seed=9, max_tokens=4, structured=StructuredOutput("regex", "[a-z]{6}")),
    "logit_bias": SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logit_bias={65: 5.0, 66: -100.0}),
}


@pytest.mark.parametrize("overlap,kinds", [
    (False, list(GUARDED)),
    (True, ["greedy", "seeded", "logprobs+min_tokens", "logit_bias"]),  # (penalties, grammars: each step finishes first)
], ids=["serial", "overlapped"])
def test_a_decode_step_never_waits_for_the_device(tok, overlap, kinds):
    """Greedy rows, seeded rows with top-p/top-k/min-p, penalties, logprobs, a stop-token mask
    (min_tokens), a grammar and logit_bias in the same decode steps: from schedule to the queued
    readback nothing reads a value back or sizes a tensor by its data (the Triton experts and the paged kernel, as the
    CUDA graph runs them, under the interpreter). Overlapped, the inputs are fed from the device."""
    pytest.importorskip("xgrammar")
    model = build_preset("tiny", seed=0, moe_backend="triton")
    core = engine_with_graphs(model, tok, (len(kinds),), paged=True, num_kv_blocks=24, max_num_seqs=len(kinds),
                              async_scheduling=overlap)
    found = guard_decode_launches(core)
    fed = count_fed_launches(core)
    for i, (prompt, kind) in enumerate(zip(random_prompts(len(kinds), 5, 12, seed=37), kinds)):
        core.add_request(kind, prompt, GUARDED[kind])
    finals, _, _ = run_collecting(core)
    assert all(o.error is None for o in finals.values()) and set(finals) == set(kinds)
    assert len(found) >= 3 and found == [[]] * len(found)
    assert any(fed) == overlap


def test_the_guard_sees_a_read_back_during_a_launch(tiny, tok, monkeypatch):
    """The guard is not blind there: a sampler that waits for its own tokens (a readback read at once,
    as `Sampler.sample` does) is found."""
    from locus.engine.sampling import sampler as sampling
    from locus.engine.host_transfer import Readback

    core = engine_with_graphs(tiny, tok, (2,), num_kv_blocks=24, max_num_seqs=2)
    found = guard_decode_launches(core)
    real = sampling.Sampler.launch

    def waiting(self, logits, states, argmax=None):
        out = real(self, logits, states, argmax)
        readback = Readback(out.token_ids.device)
        readback.add(out.token_ids)
        readback.issue()
        readback.wait()
        return out

    monkeypatch.setattr(sampling.Sampler, "launch", waiting)
    core.add_request("r", [1, 2, 3], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    run_collecting(core)
    assert found and all(any(what == "Tensor.numpy" for what, _ in f) for f in found)


def test_the_overlap_is_off_by_default_and_the_flag_sets_it(tiny, tok):
    """EngineConfig.async_scheduling None: off (docs/engine.md has the measurements on CPU and on an
    H200); `locus serve --async-scheduling / --no-async-scheduling` sets it either way."""
    from locus.cli import build_parser
    from locus.server.cli import engine_config_of

    assert not EngineCore(tiny, tok, overlap_config(None)).overlapping  # tiny is on CPU
    assert EngineCore(tiny, tok, overlap_config(True)).overlapping
    for flags, expected in (([], None), (["--async-scheduling"], True), (["--no-async-scheduling"], False)):
        assert engine_config_of(build_parser().parse_args(["serve", *flags])).async_scheduling is expected
