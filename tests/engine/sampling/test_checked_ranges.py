"""The two halves of the sampling checks (issue 58, item 3): `check_ranges` marks the params, a change of
any field takes the mark away (the ranges checked are no longer the values held), and `check_vocab`
bounds only the token-valued fields."""

from __future__ import annotations

import pytest

from locus.engine.sampling.params import InvalidParameter, SamplingParams


def test_check_ranges_marks_and_a_change_unmarks():
    params = SamplingParams(top_k=5, stop="x")
    assert not params.ranges_checked
    params.check_ranges()
    assert params.ranges_checked and params.stop == ("x",)
    copy = SamplingParams(**{**params.__dict__, "max_tokens": 3})  # how the engine sets an open max_tokens
    assert copy.ranges_checked and copy.max_tokens == 3
    params.top_p = 0.0
    assert not params.ranges_checked
    with pytest.raises(InvalidParameter, match="top_p"):
        params.check_ranges()


def test_a_failed_check_leaves_the_params_unmarked():
    params = SamplingParams(temperature=3)
    with pytest.raises(InvalidParameter, match="temperature"):
        params.check_ranges()
    assert not params.ranges_checked


@pytest.mark.parametrize("fields, param, message", [
    ({"top_k": 11}, "top_k", "top_k must be -1 or 0 (off), or in [1, 10] (the vocabulary size), got 11"),
    ({"stop_token_ids": [3, 10]}, "stop_token_ids", "stop_token_ids must be in [0, 9], got 10"),
    ({"logit_bias": {2: 1.0, 10: -1.0}}, "logit_bias", "logit_bias token id 10 is outside the vocabulary (0..9)"),
])
def test_check_vocab_bounds_the_token_fields(fields, param, message):
    params = SamplingParams(**fields)
    params.check_ranges()
    with pytest.raises(InvalidParameter) as info:
        params.check_vocab(10)
    assert info.value.param == param and str(info.value) == message
    SamplingParams(**fields).check_vocab(11)  # one more token in the vocabulary: every id fits


def test_the_engine_checks_the_ranges_only_of_params_nobody_checked(monkeypatch):
    from locus.engine.core.engine_core import EngineCore

    calls = []
    monkeypatch.setattr(SamplingParams, "check_ranges", lambda self: calls.append(self))
    core = EngineCore.__new__(EngineCore)  # validate reads the model's vocabulary, the context and the pool
    core.model = type("M", (), {"config": type("C", (), {"vocab_size": 100})()})()
    core.max_model_len = 64
    core.blocks = type("B", (), {"num_blocks": 8, "block_size": 16})()
    fresh, checked = SamplingParams(max_tokens=4), SamplingParams(max_tokens=4, ranges_checked=True)
    core.validate([1, 2], fresh)
    core.validate([1, 2], checked)
    assert calls == [fresh]
