"""A request taken out of one engine after its prefill and put into another with its KV cache and
sampler state (locus/engine/core/migration.py, what an expert-parallel move does on each side) goes on
exactly as if it had stayed: the same greedy tokens, the same seeded samples, the same logprobs, the
same stop, and the source's blocks all come back."""

from __future__ import annotations

import pickle

import pytest
import torch

from locus.engine.core.engine_core import EngineConfig, EngineCore
from locus.engine.core.migration import kv_bytes_per_token, take_in, take_out
from locus.engine.sampling.sampler import SamplingParams
from locus.engine.sampling.grammar import StructuredOutput


def step(core: EngineCore, outputs: dict) -> None:
    for out in core.step():
        c = out.outputs[0]
        got = outputs.setdefault(out.request_id, {"ids": [], "text": "", "logprobs": []})
        got["ids"] += c.delta_token_ids
        got["text"] += c.delta_text
        got["logprobs"] += [(lp.token_id, lp.logprob) for lp in c.delta_logprobs or []]
        if out.finished:
            got["finish"] = c.finish_reason


def same_output(got: dict, want: dict) -> bool:
    """Token for token, and logprobs within float32 noise: the target batches the moved request with
    other work, and a float32 sum over another batch shape may differ in its last bits, which a fixed
    rounding of the logprob can turn into a last-digit difference."""
    ids = [t for t, _ in got["logprobs"]] == [t for t, _ in want["logprobs"]]
    close = [lp for _, lp in got["logprobs"]] == pytest.approx([lp for _, lp in want["logprobs"]], abs=1e-4)
    rest = {k: v for k, v in got.items() if k != "logprobs"} == {k: v for k, v in want.items() if k != "logprobs"}
    return ids and close and rest


def run_to_end(core: EngineCore, outputs: dict) -> None:
    while core.has_unfinished():
        step(core, outputs)


def config(blocks: int = 64) -> EngineConfig:
    return EngineConfig(block_size=4, num_kv_blocks=blocks, max_num_batched_tokens=64)


CASES = {
    "greedy": SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3),
    "seeded": SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True),
    "stop": SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop=["e"]),
}


@pytest.mark.parametrize("steps_before", [1, 3])
def test_a_moved_request_generates_what_it_would_have_without_the_move(tiny, tok, steps_before):
    prompts = {name: list(range(30 + i, 47 + 3 * i)) for i, name in enumerate(CASES)}
    want: dict = {}
    alone = EngineCore(tiny, tok, config())
    for name, params in CASES.items():
        alone.add_request(name, prompts[name], params)
    run_to_end(alone, want)

    source, target = EngineCore(tiny, tok, config()), EngineCore(tiny, tok, config())
    target.add_request("other", list(range(5, 25)), CASES["greedy"])  # the target is busy with its own
    got: dict = {}
    for name, params in CASES.items():
        source.add_request(name, prompts[name], params)
    for _ in range(steps_before):  # the prefill, then decode steps, on the source
        step(source, got)
    free_before = source.blocks.num_free_blocks
    for name in CASES:
        migrant = take_out(source, name)
        assert migrant.kv_tokens == len(prompts[name]) + steps_before - 1  # every computed position
        assert migrant.kv.numel() * migrant.kv.element_size() == migrant.kv_tokens * kv_bytes_per_token(source)
        wire = pickle.loads(pickle.dumps(migrant.state()))  # what travels besides the rows
        wire.kv = migrant.kv.clone()
        assert take_in(target, wire)
    assert not source.has_unfinished() and source.blocks.num_free_blocks == source.blocks.num_blocks > free_before
    run_to_end(target, got)
    for name in CASES:
        assert same_output(got[name], want[name]), (name, got[name], want[name])
    assert target.blocks.num_free_blocks == target.blocks.num_blocks


def test_a_move_into_a_full_pool_recomputes_instead(tiny, tok):
    params = CASES["greedy"]
    prompt = list(range(40, 60))
    want: dict = {}
    alone = EngineCore(tiny, tok, config())
    alone.add_request("r", prompt, params)
    run_to_end(alone, want)
    source, target = EngineCore(tiny, tok, config()), EngineCore(tiny, tok, config(blocks=9))
    target.add_request("other", list(range(1, 30)), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    target.step()  # 'other' holds 8 of the 9 blocks
    got: dict = {}
    source.add_request("r", prompt, params)
    step(source, got)
    assert not take_in(target, take_out(source, "r"))  # no room for its 5 blocks: it waits and is recomputed
    run_to_end(target, got)
    assert same_output(got["r"], want["r"]), (got["r"], want["r"])


def test_requests_with_a_grammar_or_n_choices_do_not_move(tiny, tok):
    core = EngineCore(tiny, tok, config())
    core.add_request("n2", [1, 2, 3], SamplingParams(n=2, max_tokens=4))
    core.add_request("json", [1, 2, 3], SamplingParams(max_tokens=4, structured=StructuredOutput("json_object")))
    core.step()
    for request_id, why in (("n2", "n = 2"), ("json", "grammar")):
        with pytest.raises(ValueError, match=why):
            take_out(core, request_id)
    assert take_out(core, "gone") is None
    assert torch.is_tensor(core.cache.keys[0])
