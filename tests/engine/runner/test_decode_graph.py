"""The compiled decode path (decode_graph.py): the same logits and tokens as the eager engine, padding
that never leaks, and one graph per bucket however long the contexts grow.

Compiling costs seconds per bucket on CPU, so these tests use the tiny preset and few buckets."""

from __future__ import annotations

import pytest
import torch

from locus.engine.runner.decode_graph import default_buckets, parse_buckets
from locus.engine.core.engine_core import EngineConfig, EngineCore
from locus.engine.frontend.llm import LLM
from locus.engine.sampling.sampler import SamplingParams
from tests.engine.core.test_engine import random_prompts

BUCKETS = (1, 4)


def test_default_buckets_double_up_to_max_num_seqs():
    assert default_buckets(1) == [1]
    assert default_buckets(6) == [1, 2, 4, 6]
    assert default_buckets(256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]


def test_bucket_lists_are_parsed_and_bad_ones_named():
    assert parse_buckets("8, 1,2,2") == [1, 2, 8]
    for bad in ("", "0,2", "a,b", "-1"):
        with pytest.raises(ValueError, match="compile-buckets"):
            parse_buckets(bad)


@pytest.fixture(scope="module")
def compiled(tiny, tok):
    """An engine whose decode steps run compiled (buckets 1 and 4), max 4 sequences a step."""
    return EngineCore(tiny, tok, EngineConfig(block_size=16, num_kv_blocks=64, max_num_seqs=4,
                                              compile_decode=True, compile_buckets=BUCKETS))


def run_to_completion(core: EngineCore, prompts: list[list[int]], params: list[SamplingParams]) -> list:
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        core.add_request(f"req-{len(core.requests)}-{i}", prompt, p)
    final = {}
    while core.has_unfinished():
        for out in core.step():
            assert out.error is None
            if out.finished:
                final[out.request_id] = out
    return [final[k] for k in sorted(final, key=lambda k: int(k.rsplit("-", 1)[1]))]


def check_decode_steps(core: EngineCore, monkeypatch, atol: float = 1e-5, same_experts: bool = True) -> list[int]:
    """From now on every decode-graph step of `core` is checked against the eager runner on the same
    KV state (writing a position's keys twice writes the same values): logits within `atol`, the
    graph's argmax equal to its logits' argmax, the same experts (unless not `same_experts`).
    Returns the batch size of each step checked (filled as the engine runs)."""
    runner = core.runner
    eager_runner = type(runner)(runner.model, runner.cache)
    graph_run, checked = runner.run, []

    def run_both(items, record_routing=False, **kwargs):  # (kwargs: the feed of an overlapped step)
        if not runner.can_run_compiled(items):
            return graph_run(items, record_routing, **kwargs)
        eager = eager_runner.run(items, record_routing=True, **kwargs)
        fast = graph_run(items, record_routing=True, **kwargs)
        assert fast.logits.shape == eager.logits.shape == (len(items), core.model.config.vocab_size)
        assert (fast.logits.float() - eager.logits).abs().max() <= atol
        assert torch.equal(fast.argmax, fast.logits.argmax(-1))  # the graph's greedy token
        for layer, topk in eager.routing.items() if same_experts else ():
            assert torch.equal(fast.routing[layer].ids, topk.ids)
            assert torch.allclose(fast.routing[layer].weights, topk.weights, atol=1e-6)
        checked.append(len(items))
        return fast

    monkeypatch.setattr(runner, "run", run_both)
    return checked


@pytest.mark.slow  # compiles decode graphs (torch.compile of every bucket)
def test_each_decode_step_has_the_eager_logits_and_routing(compiled, monkeypatch):
    """Every compiled step against the eager runner: 3 sequences padded to 4, contexts crossing block
    boundaries and the tiny model's 64-token attention chunks. Logits agree to 1e-5, experts exactly."""
    checked = check_decode_steps(compiled, monkeypatch)
    prompts = random_prompts(3, 40, 60, seed=5)
    run_to_completion(compiled, prompts, [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)] * 3)
    assert len(checked) >= 39 and 3 in checked  # every decode step (the prefill samples the first token)


@pytest.mark.slow  # compiles decode graphs (torch.compile of every bucket)
def test_greedy_outputs_equal_the_eager_engine_with_padding_forks_and_preemption(tiny, tok):
    """Mixed lengths, n = 2 (forked sequences share blocks), and a pool small enough to preempt: every
    token equals the eager engine's, and the pool is whole at the end."""
    prompts = random_prompts(6, 3, 90, seed=6)
    params = [SamplingParams(temperature=0.0, max_tokens=24 + 4 * i, ignore_eos=True, n=1 + i % 2) for i in range(6)]
    small_pool = dict(block_size=16, num_kv_blocks=14, max_num_seqs=4)
    fast = LLM.from_model(tiny, tok, EngineConfig(**small_pool, compile_decode=True, compile_buckets=BUCKETS))
    slow = LLM.from_model(tiny, tok, EngineConfig(**small_pool))
    fast_out, slow_out = fast.generate(prompts, params), slow.generate(prompts, params)
    assert fast.engine.stats().num_preemptions > 0, "the pool was meant to force preemption"
    assert fast.engine.graphs.steps > 50  # most steps ran compiled
    for a, b in zip(fast_out, slow_out):
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    stats = fast.engine.stats()
    assert stats.num_free_blocks == stats.num_blocks


@pytest.mark.slow  # compiles decode graphs (the module's compiled engine)
def test_growing_contexts_reuse_the_bucket_graphs(compiled):
    """The block-table width is dynamic: decoding far past the warm-up's table width compiles nothing
    new; and the compiled path really ran (its graphs exist for both buckets)."""
    core = compiled
    assert core.graphs.buckets == [1, 4] and set(core.graphs.compile_seconds) == {1, 4}
    graphs_before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    out = run_to_completion(core, [[7] * 5, [9] * 30],
                            [SamplingParams(temperature=0.0, max_tokens=150, ignore_eos=True)] * 2)
    assert [len(o.outputs[0].token_ids) for o in out] == [150, 150]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs_before


def check_biased_rows_and_scoring_requests(core: EngineCore) -> None:
    """logit_bias holds in graph decode steps (the graph's argmax is of the unbiased logits: a biased
    row must not take it), and a request that only scores its prompt never runs there, even when its
    whole prompt is one token (a one-token prefill looks like a decode step)."""
    prompts = random_prompts(2, 10, 20, seed=8)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    plain = run_to_completion(core, prompts, [params] * 2)
    first = plain[0].outputs[0].token_ids
    banned = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logit_bias={t: -100 for t in first})
    forced = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logit_bias={65: 100})
    steps = core.graphs.steps
    biased = run_to_completion(core, prompts + prompts[1:], [banned, params, forced])
    assert core.graphs.steps > steps  # the decode steps ran through the graphs
    assert not set(biased[0].outputs[0].token_ids) & set(first)
    assert biased[1].outputs[0].token_ids == plain[1].outputs[0].token_ids  # an unbiased row beside them
    assert biased[2].outputs[0].token_ids == [65] * 6
    steps = core.graphs.steps
    scored = run_to_completion(core, [[42]], [SamplingParams(max_tokens=0, prompt_logprobs=0)])
    assert core.graphs.steps == steps and scored[0].outputs[0].token_ids == [] and scored[0].prompt_logprobs == [None]


@pytest.mark.slow  # compiles decode graphs (the module's compiled engine)
def test_biased_rows_and_scoring_requests_in_compiled_steps(compiled):
    check_biased_rows_and_scoring_requests(compiled)


def test_rope_as_real_pairs_equals_the_complex_rotation():
    """The compiled graph rotates with (cos, sin) pairs, eager code with complex numbers: same numbers."""
    from locus.engine.model.rope import apply_rope

    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 3, 16, generator=g)
    angles = torch.arange(7).float()[:, None] * torch.rand(8, generator=g)[None, :]
    complex_rot = torch.polar(torch.ones_like(angles), angles)
    real_rot = torch.stack([torch.cos(angles), torch.sin(angles)], dim=-1)
    assert torch.allclose(apply_rope(x, complex_rot), apply_rope(x, real_rot), atol=1e-6)
