"""Sampler: parameter validation, each processing stage against hand-computed values, seeded
reproducibility across batch compositions, the sampled distribution, and logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from locus.engine.sampling.sampler import (
    InvalidParameter,
    Sampler,
    SamplingParams,
    SequenceSamplingState,
    apply_penalties,
    compute_prompt_logprobs,
)
from locus.errors import LocusError

V = 50


def states_for(params_list, prompt=(1, 2, 3)):
    return [SequenceSamplingState.create(p, list(prompt), index=0) for p in params_list]


def random_logits(rows, vocab=V, seed=0):
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


# ---------------------------------------------------------------- validation

@pytest.mark.parametrize("field, value", [
    ("n", 0), ("n", 129), ("n", 1.5),
    ("temperature", -0.1), ("temperature", 2.01), ("temperature", float("nan")), ("temperature", "hot"),
    ("top_p", 0.0), ("top_p", 1.01),
    ("top_k", -2),
    ("min_p", -0.1), ("min_p", 1.1),
    ("presence_penalty", -2.1), ("presence_penalty", 2.1),
    ("frequency_penalty", -2.5), ("frequency_penalty", 3),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", 2.5),
    ("seed", 1.5), ("seed", True), ("seed", 2**64),
    ("max_tokens", 0), ("max_tokens", -3),
    ("min_tokens", -1), ("min_tokens", 17),  # default max_tokens is 16
    ("logprobs", -1), ("logprobs", 21),
    ("prompt_logprobs", 21),
    ("stop", ("a", "b", "c", "d", "e")), ("stop", ("ok", "")),
    ("stop_token_ids", (-1,)),
])
def test_each_out_of_range_field_is_rejected_by_name(field, value):
    params = SamplingParams(**{field: value})
    with pytest.raises(InvalidParameter) as info:
        params.validate()
    assert info.value.param == field
    assert field in str(info.value)
    assert isinstance(info.value, LocusError)


@pytest.mark.parametrize("fields", [
    {}, {"temperature": 0}, {"temperature": 2}, {"top_p": 1e-9}, {"top_k": -1}, {"top_k": 1}, {"min_p": 1},
    {"presence_penalty": -2, "frequency_penalty": 2}, {"repetition_penalty": 2}, {"seed": -7}, {"n": 128},
    {"max_tokens": None, "min_tokens": 1000}, {"min_tokens": 16}, {"logprobs": 0}, {"logprobs": 20},
    {"stop": ("a", "b", "c", "d")},
])
def test_values_at_the_edges_of_the_ranges_are_accepted(fields):
    SamplingParams(**fields).validate()


def test_range_message_is_a_usable_client_error():
    with pytest.raises(InvalidParameter, match=r"temperature must be in \[0, 2\], got 3"):
        SamplingParams(temperature=3).validate()
    with pytest.raises(InvalidParameter, match=r"top_p must be in \(0, 1\]"):
        SamplingParams(top_p=0).validate()


def test_stop_accepts_a_single_string_or_a_list():
    assert SamplingParams(stop="###").stop == ("###",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(stop=None).stop == ()
    assert SamplingParams.normalize_stop("x") == ("x",)
    assert SamplingParams(stop_token_ids=[5, 6]).stop_token_ids == (5, 6)


# ---------------------------------------------------------------- processing stages

def test_greedy_takes_the_argmax_and_uses_no_randomness():
    logits = random_logits(4)
    states = states_for([SamplingParams(temperature=0, seed=s) for s in range(4)])
    before = [s.generator.get_state().clone() for s in states]
    out = Sampler().sample(logits, states)
    assert out.token_ids == logits.argmax(-1).tolist()
    assert all(torch.equal(b, s.generator.get_state()) for b, s in zip(before, states))


def test_a_given_argmax_serves_greedy_rows_only_while_the_logits_are_unchanged():
    """The compiled decode graph hands the sampler its argmax. Greedy rows take it; when a penalty
    or a stop-token mask changes the logits, the sampler takes its own argmax instead."""
    logits = random_logits(3)
    marker = torch.tensor([7, 8, 9])  # not the argmax: shows which one was used
    plain = states_for([SamplingParams(temperature=0)] * 3)
    assert Sampler().sample(logits, plain, marker).token_ids == [7, 8, 9]
    penalised = states_for([SamplingParams(temperature=0), SamplingParams(temperature=0, presence_penalty=1.0),
                            SamplingParams(temperature=0)])
    for s in penalised:
        s.output_ids = [1]
    assert Sampler().sample(logits, penalised, marker).token_ids == apply_penalties(logits, penalised).argmax(-1).tolist()
    masked = states_for([SamplingParams(temperature=0, min_tokens=1)] * 3)
    assert Sampler(eos_token_ids=(0,)).sample(logits, masked, marker).token_ids != [7, 8, 9]
    with pytest.raises(ValueError, match=r"argmax \(2,\) does not match 3 sequences"):
        Sampler().sample(logits, plain, marker[:2])
    # A batch that only takes the argmax does not read (or convert) the logits at all; one row that
    # wants logprobs makes the sampler read them, in float32 whatever their dtype.
    unread = torch.full((3, V), float("nan"), dtype=torch.bfloat16)
    assert Sampler().sample(unread, plain, marker).token_ids == [7, 8, 9]
    with_logprobs = states_for([SamplingParams(temperature=0), SamplingParams(temperature=0, logprobs=2),
                                SamplingParams(temperature=0)])
    out = Sampler().sample(logits.bfloat16(), with_logprobs, marker)
    assert out.token_ids == [7, 8, 9] and out.logprobs[0] is None and len(out.logprobs[1].top) == 2


@pytest.mark.parametrize("temperature", [0.3, 1.0, 2.0])
def test_top_k_one_is_greedy_at_any_temperature(temperature):
    logits = random_logits(8, seed=1)
    states = states_for([SamplingParams(temperature=temperature, top_k=1, seed=i) for i in range(8)])
    assert Sampler().sample(logits, states).token_ids == logits.argmax(-1).tolist()


def test_top_k_one_breaks_ties_like_argmax():
    logits = torch.zeros(2, 5000)
    logits[:, 3::7] = 1.0  # hundreds of tied maxima; argmax takes the first
    states = states_for([SamplingParams(top_k=1, seed=i) for i in range(2)])
    assert Sampler().sample(logits, states).token_ids == [3, 3] == logits.argmax(-1).tolist()


def test_tiny_top_p_is_greedy():
    logits = random_logits(8, seed=2)
    states = states_for([SamplingParams(temperature=1.5, top_p=1e-6, seed=i) for i in range(8)])
    assert Sampler().sample(logits, states).token_ids == logits.argmax(-1).tolist()


def test_top_k_keeps_only_the_k_best():
    logits = random_logits(1, seed=3)
    best3 = set(logits[0].topk(3).indices.tolist())
    states = states_for([SamplingParams(temperature=2.0, top_k=3, seed=i) for i in range(300)])
    drawn = set(Sampler().sample(logits.expand(300, V), states).token_ids)
    assert drawn == best3


def test_min_p_filters_tokens_below_the_scaled_maximum():
    # probabilities 0.5, 0.3, 0.15, 0.05: min_p = 0.25 keeps those >= 0.125 (tokens 0, 1, 2)
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    states = states_for([SamplingParams(min_p=0.25, seed=i) for i in range(2000)])
    drawn = Sampler().sample(logits.expand(2000, 4), states).token_ids
    assert set(drawn) == {0, 1, 2}
    assert drawn.count(2) / 2000 == pytest.approx(0.15 / 0.95, abs=0.03)


def test_penalties_follow_their_formulas():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25)
    state = SequenceSamplingState.create(params, prompt_ids=[0, 1])
    state.output_ids = [2, 2, 4]
    got = apply_penalties(logits, [state])[0]
    # repetition over prompt+output {0, 1, 2, 4}: positive / 2, negative * 2;
    # then output counts 2:x2, 4:x1 -> minus 0.25 * count + 0.5 once
    want = [2.0 / 2, -1.0 * 2, 0.5 / 2 - 0.25 * 2 - 0.5, 3.0, -2.0 * 2 - 0.25 - 0.5, 1.0]
    assert got.tolist() == pytest.approx(want)


def test_penalties_touch_only_rows_that_ask_for_them():
    logits = random_logits(3)
    states = states_for([SamplingParams(), SamplingParams(frequency_penalty=1.0), SamplingParams()])
    for s in states:
        s.output_ids = [0, 0, 1]
    got = apply_penalties(logits, states)
    assert torch.equal(got[0], logits[0]) and torch.equal(got[2], logits[2])
    assert got[1, 0] == pytest.approx(float(logits[1, 0]) - 2.0)
    assert got[1, 5] == logits[1, 5]


def test_min_tokens_masks_eos_and_stop_tokens_until_reached():
    logits = torch.zeros(1, 6)
    logits[0, 5] = 10.0  # EOS
    logits[0, 4] = 9.0  # a stop token id
    sampler = Sampler(eos_token_ids=(5,))
    state = SequenceSamplingState.create(SamplingParams(temperature=0, min_tokens=2, stop_token_ids=(4,)), [1])
    assert sampler.sample(logits, [state]).token_ids == [0]
    state.output_ids = [0]
    assert sampler.sample(logits, [state]).token_ids == [0]
    state.output_ids = [0, 0]
    assert sampler.sample(logits, [state]).token_ids == [5]
    ignoring = SequenceSamplingState.create(SamplingParams(temperature=0, min_tokens=2, stop_token_ids=(4,), ignore_eos=True), [1])
    assert sampler.sample(logits, [ignoring]).token_ids == [5]  # EOS is not a stop with ignore_eos


def test_finish_reason():
    sampler = Sampler(eos_token_ids=(9,))
    state = SequenceSamplingState.create(SamplingParams(max_tokens=3, stop_token_ids=(7,)), [1])
    state.output_ids = [1]
    assert sampler.finish_reason(state) is None
    state.output_ids = [1, 9]
    assert sampler.finish_reason(state) == "stop"
    state.output_ids = [1, 7]
    assert sampler.finish_reason(state) == "stop"
    state.output_ids = [1, 2, 3]
    assert sampler.finish_reason(state) == "length"
    ignoring = SequenceSamplingState.create(SamplingParams(ignore_eos=True, max_tokens=None), [1])
    ignoring.output_ids = [9]
    assert sampler.finish_reason(ignoring) is None


# ---------------------------------------------------------------- randomness

def run_steps(logits_per_step, target_params, batch_with=None, steps=20, seed=0):
    """Sample a target sequence for `steps` steps, alone or in a batch of 16 with other rows placed
    at a different position each step; the other rows' logits are noise."""
    sampler = Sampler(eos_token_ids=(0,))
    target = SequenceSamplingState.create(target_params, [3, 4, 5], index=0)
    others = []
    if batch_with is not None:
        others = [SequenceSamplingState.create(p, [7, 8], index=i) for i, p in enumerate(batch_with)]
    noise = torch.Generator().manual_seed(seed + 99)
    for step in range(steps):
        rows = others[:]
        where = step % (len(others) + 1)
        rows.insert(where, target)
        logits = torch.randn(len(rows), V, generator=noise) * 3
        logits[where] = logits_per_step[step]
        out = sampler.sample(logits, rows)
        for s, t in zip(rows, out.token_ids):
            s.output_ids.append(t)
    return target.output_ids


def test_same_seed_same_tokens_alone_or_in_a_batch_of_16():
    logits = torch.randn(20, V, generator=torch.Generator().manual_seed(5)) * 2
    params = SamplingParams(temperature=0.9, top_p=0.95, top_k=40, presence_penalty=0.3, seed=1234, max_tokens=None)
    neighbours = [
        SamplingParams(temperature=t, top_p=p, top_k=k, min_p=m, seed=seed, repetition_penalty=r, frequency_penalty=f, min_tokens=mt)
        for t, p, k, m, seed, r, f, mt in [
            (1.0, 1.0, 0, 0.0, None, 1.0, 0.0, 0), (0.0, 1.0, 0, 0.0, None, 1.0, 0.0, 0), (0.5, 0.5, 5, 0.1, 7, 1.2, 0.5, 3),
            (1.5, 0.9, 0, 0.0, 1234, 1.0, 0.0, 0), (2.0, 1.0, 1, 0.0, None, 0.8, 0.0, 0), (0.7, 0.8, 20, 0.05, 3, 1.0, 1.0, 5),
        ] * 3][:15]
    alone = run_steps(logits, params)
    batched = run_steps(logits, params, batch_with=neighbours)
    assert alone == batched
    assert len(set(alone)) > 3  # it really sampled


def test_different_seeds_differ_and_a_seed_reproduces():
    logits = torch.randn(20, V, generator=torch.Generator().manual_seed(5))
    a = run_steps(logits, SamplingParams(seed=1, max_tokens=None))
    b = run_steps(logits, SamplingParams(seed=2, max_tokens=None))
    assert a != b
    assert a == run_steps(logits, SamplingParams(seed=1, max_tokens=None))


def test_n_sequences_of_one_seed_differ_and_reproduce():
    params = SamplingParams(n=4, seed=42, max_tokens=None)
    logits = torch.randn(10, V, generator=torch.Generator().manual_seed(6))

    def run():
        states = [SequenceSamplingState.create(params, [1, 2], index=i) for i in range(params.n)]
        sampler = Sampler()
        for step in range(10):
            out = sampler.sample(logits[step].expand(params.n, V), states)
            for s, t in zip(states, out.token_ids):
                s.output_ids.append(t)
        return [s.output_ids for s in states]

    first = run()
    assert first == run()
    assert len({tuple(ids) for ids in first}) == params.n


@pytest.mark.parametrize("fields, want", [
    ({}, [0.5, 0.3, 0.2]),
    ({"temperature": 2.0}, [x / sum(math.sqrt(p) for p in (0.5, 0.3, 0.2)) for x in map(math.sqrt, (0.5, 0.3, 0.2))]),
    ({"top_p": 0.7}, [0.5 / 0.8, 0.3 / 0.8, 0.0]),
])
def test_sampling_frequencies_match_the_distribution(fields, want):
    rows = 20000
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]])).expand(rows, 3)
    states = [SequenceSamplingState.create(SamplingParams(seed=7, **fields), [1], index=i) for i in range(rows)]
    drawn = torch.tensor(Sampler().sample(logits, states).token_ids)
    freq = torch.bincount(drawn, minlength=3).double() / rows
    assert freq.tolist() == pytest.approx(want, abs=0.015)


# ---------------------------------------------------------------- logit_bias

def test_logit_bias_is_added_before_greedy_and_random_sampling():
    """OpenAI's logit_bias: added to the logits before sampling, greedy included; -100 all but bans
    a token, +100 all but forces it; rows without a bias are untouched; logprobs stay the raw model's."""
    logits = random_logits(4, seed=11)
    best = logits.argmax(-1).tolist()
    params = [SamplingParams(temperature=0, logit_bias={best[0]: -100}),
              SamplingParams(temperature=0, logit_bias={7: 100}, logprobs=1),
              SamplingParams(temperature=0),
              SamplingParams(temperature=1.0, seed=3, logit_bias={11: 100})]
    out = Sampler().sample(logits, states_for(params))
    banned = logits[0].clone()
    banned[best[0]] -= 100
    assert out.token_ids == [int(banned.argmax()), 7, best[2], 11]
    assert out.logprobs[1].logprob == pytest.approx(float(torch.log_softmax(logits[1], -1)[7]))
    # a small bias moves the greedy choice exactly where the sum of the logits says
    gap = float(logits[2].sort(descending=True).values[0] - logits[2].sort(descending=True).values[1])
    second = int(logits[2].sort(descending=True).indices[1])
    assert Sampler().sample(logits[2:3], states_for([SamplingParams(temperature=0, logit_bias={second: gap + 1e-3})])).token_ids == [second]
    assert Sampler().sample(logits[2:3], states_for([SamplingParams(temperature=0, logit_bias={second: gap - 1e-3})])).token_ids == [best[2]]


def test_a_biased_greedy_row_does_not_take_the_graphs_argmax():
    """The compiled decode graph hands over its argmax of the unbiased logits: a biased row must not take it."""
    logits = random_logits(2, seed=12)
    marker = logits.argmax(-1)
    biased = states_for([SamplingParams(temperature=0, logit_bias={5: 100}), SamplingParams(temperature=0)])
    assert Sampler().sample(logits, biased, marker).token_ids == [5, int(marker[1])]
    assert Sampler().sample(logits.bfloat16(), biased, marker).token_ids == [5, int(marker[1])]


@pytest.mark.parametrize("bias, needle", [
    ({50: 1.0}, "outside the vocabulary"), ({-1: 1.0}, "outside the vocabulary"), ({True: 1.0}, "outside the vocabulary"),
    ({3: 100.5}, r"\[-100, 100\]"), ({3: float("nan")}, r"\[-100, 100\]"), ({3: True}, r"\[-100, 100\]"),
    ({3: "1"}, r"\[-100, 100\]"),
])
def test_logit_bias_out_of_range_is_refused(bias, needle):
    with pytest.raises(InvalidParameter, match=needle) as info:
        SamplingParams(logit_bias=bias).validate(vocab_size=V)
    assert info.value.param == "logit_bias"
    SamplingParams(logit_bias={0: -100, V - 1: 100.0}).validate(vocab_size=V)


def test_max_tokens_zero_only_for_a_request_that_scores_its_prompt():
    SamplingParams(max_tokens=0, prompt_logprobs=0).validate()
    with pytest.raises(InvalidParameter, match="max_tokens must be >= 1"):
        SamplingParams(max_tokens=0).validate()


@pytest.mark.parametrize("fields", [{"top_p": 5e-324}, {"repetition_penalty": 5e-324}, {"repetition_penalty": 1e-30}])
def test_values_that_underflow_float32_still_sample(fields):
    """Found by schemathesis: top_p and repetition_penalty of 5e-324 are 0 in float32; the first kept no
    token and the second made the logits inf, and either draw failed (which took the engine down)."""
    SamplingParams(**fields).validate()
    logits = random_logits(3, seed=13)
    states = states_for([SamplingParams(temperature=1.0, seed=i, **fields) for i in range(3)])
    tokens = Sampler().sample(logits, states).token_ids
    assert all(0 <= t < V for t in tokens)
    if "top_p" in fields:
        assert tokens == logits.argmax(-1).tolist()


# ---------------------------------------------------------------- logprobs

def test_logprobs_are_the_raw_model_distribution():
    logits = random_logits(3, seed=4)
    params = [SamplingParams(logprobs=5, temperature=0.5, presence_penalty=1.0, seed=0),
              SamplingParams(logprobs=0, temperature=0), SamplingParams()]
    states = states_for(params)
    states[0].output_ids = [int(logits[0].argmax())]  # the penalty must not leak into logprobs
    out = Sampler().sample(logits, states)
    raw = torch.log_softmax(logits, dim=-1)
    first, second, third = out.logprobs
    assert third is None
    assert first.token_id == out.token_ids[0]
    assert first.logprob == pytest.approx(float(raw[0, first.token_id]))
    assert [t for t, _ in first.top] == raw[0].topk(5).indices.tolist()
    assert [lp for _, lp in first.top] == pytest.approx(raw[0].topk(5).values.tolist())
    assert [lp for _, lp in first.top] == sorted((lp for _, lp in first.top), reverse=True)
    assert second.top == [] and second.logprob == pytest.approx(float(raw[1].max()))


def test_prompt_logprobs_score_each_prompt_token_from_its_prefix():
    logits = random_logits(4, seed=8)
    prompt = [3, 9, 1, 4]
    got = compute_prompt_logprobs(logits, prompt, k=2)
    raw = torch.log_softmax(logits, dim=-1)
    assert got[0] is None and len(got) == 4
    for t in range(1, 4):
        assert got[t].token_id == prompt[t]
        assert got[t].logprob == pytest.approx(float(raw[t - 1, prompt[t]]))
        assert [i for i, _ in got[t].top] == raw[t - 1].topk(2).indices.tolist()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_logits_sample_what_cpu_logits_sample():
    logits = random_logits(16, seed=9)
    params = [SamplingParams(temperature=0.8, top_p=0.9, top_k=20, min_p=0.02, presence_penalty=0.5, seed=i) for i in range(16)]
    cpu_states, gpu_states = states_for(params), states_for(params)
    for s in cpu_states + gpu_states:
        s.output_ids = [1, 2, 2]
    sampler = Sampler(eos_token_ids=(0,))
    cpu = sampler.sample(logits, cpu_states)
    gpu = sampler.sample(logits.cuda(), gpu_states)
    assert cpu.token_ids == gpu.token_ids
