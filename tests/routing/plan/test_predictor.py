"""The prompt predictor (token-expert affinity table): learned from a trace's token ids, bounded, stored
with the plan, refused for another model, and what it predicts."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from locus.errors import LocusError
from locus.routing.grouping.live import live_grouper
from locus.routing.plan.predictor import TokenAffinity
from locus.routing.plan.grouping_spec import spec_of
from locus.routing.plan.placement import PlanError, load_plan
from locus.routing.plan.topology import parse_topology
from locus.routing.planners.planner import PlanOptions, make_plan
from locus.traces.reader import TraceReader
from tests.routing.planners.planner_fixtures import separable_trace, worded_trace


@pytest.fixture(scope="module")
def worded(tmp_path_factory):
    return TraceReader(worded_trace(tmp_path_factory.mktemp("worded") / "t"))


def test_the_table_is_bounded_by_tokens_and_experts(worded):
    table = TokenAffinity.learn(worded, 0, 120, max_tokens=5, top_experts=1)
    assert table.num_tokens == 5 and table.experts.shape == (5, 2, 1) and table.shares.shape == (5, 2, 1)
    full = TokenAffinity.learn(worded, 0, 120)
    assert full.num_tokens == 64 and full.experts.shape[-1] == 8  # every token of the vocabulary seen twice or more
    # the 5 kept are the most frequent ones
    freq = np.bincount(np.asarray(worded.token_ids[: int(worded.offsets[120])]), minlength=64)
    assert set(table.token_ids.tolist()) == set(np.argsort(-freq, kind="stable")[:5].tolist())
    assert table.domain_log_probs.shape == (5, 4)  # the classifier: one log-probability per kept token and domain
    # in the plan: the header plus 5 x (4 + 2 x 1 x (2 + 2) + 4 x 4) bytes of arrays, in base64
    assert len(json.dumps(table.to_dict())) < 700
    ten = TokenAffinity.learn(worded, 0, 120, max_tokens=10, top_experts=1)
    assert len(json.dumps(ten.to_dict())) - len(json.dumps(table.to_dict())) < 5 * 28 * 4 / 3 + 8


def test_a_prompt_signature_is_the_sum_of_its_tokens_shares(worded):
    table = TokenAffinity.learn(worded, 0, 120)
    v, w = int(table.token_ids[3]), int(table.token_ids[40])
    row = lambda t: table.signature([t])  # noqa: E731
    np.testing.assert_allclose(table.signature([v, v, w]), 2 * row(v) + row(w), rtol=1e-6)
    # a token's pairs at a layer sum to K = 2; its first expert follows its id (the fixture's rule)
    np.testing.assert_allclose(row(v).sum(-1), [2.0, 2.0], rtol=1e-5)
    assert row(v)[0].argmax() == 4 * (v // 16) + v % 4
    assert table.signature([]).sum() == 0 and table.signature([63, 63]).shape == (2, 16)
    unknown = TokenAffinity.learn(worded, 0, 120, max_tokens=1)
    assert unknown.signature([int(t) for t in range(64) if t != unknown.token_ids[0]]).sum() == 0


def test_the_classifier_names_a_prompts_domain(worded):
    table = TokenAffinity.learn(worded, 0, 120)
    assert table.domains == ("chat", "code", "general", "math")
    offsets = worded.offsets
    right = [table.classify(np.asarray(worded.token_ids[int(offsets[i]): int(offsets[i]) + 8])) == r.domain
             for i, r in enumerate(worded.requests[120:240], start=120)]
    assert all(right)  # each domain has its own 16 tokens in the fixture
    assert table.classify([]) is None
    # a prompt of two domains' tokens is not sure enough (posterior 1/2 each): no domain
    mixed = [0, 1, 2, 3, 16, 17, 18, 19]
    assert table.classify(mixed) is None and table.classify(mixed, confidence=0.0) in ("code", "math")
    untagged = TokenAffinity.learn(TraceReader(worded_trace(worded.path.parent / "u", tagged=False)), 0, 120)
    assert untagged.domains == () and untagged.classify([1, 2]) is None and untagged.num_tokens == 64


def test_the_plan_stores_the_table_and_reloads_it(worded, tmp_path):
    topology = parse_topology("4x1", 16, 5)
    plan = make_plan("locality", worded, topology, (0, 120), PlanOptions(predictor_tokens=32, predictor_experts=3)).plan
    path = tmp_path / "plan.json"
    plan.save(path)
    stored = spec_of(load_plan(path)).predictor
    assert stored.num_tokens == 32 and stored.vocab_size == 64 and stored.moe_layers == (0, 2)
    learned = TokenAffinity.learn(worded, 0, 120, 32, 3)
    np.testing.assert_array_equal(stored.token_ids, learned.token_ids)
    np.testing.assert_allclose(stored.shares, learned.shares, atol=1 / 65535)
    assert stored.domains == learned.domains
    np.testing.assert_array_equal(stored.domain_log_probs, learned.domain_log_probs)
    none = make_plan("locality", worded, topology, (0, 120), PlanOptions(predictor_tokens=0)).plan
    assert "predictor" not in none.grouping


def test_a_trace_without_token_ids_makes_no_table(tmp_path):
    reader = TraceReader(separable_trace(tmp_path / "s"))
    plan = make_plan("locality", reader, parse_topology("4x1", 16, 5), (0, 120)).plan
    assert "predictor" not in plan.grouping
    with pytest.raises(LocusError, match="no token ids"):
        TokenAffinity.learn(reader, 0, 120)


def test_a_table_for_another_model_is_refused_naming_what_differs(worded, tmp_path):
    plan = make_plan("locality", worded, parse_topology("4x1", 16, 5), (0, 120)).plan
    model = SimpleNamespace(vocab_size=64, moe_layers=[0, 2], num_local_experts=16)
    assert live_grouper(plan, model).predictor is not None  # the model it was learned for
    for change, message in ((dict(vocab_size=202048), "a vocabulary of 64 tokens, the model has 202048"),
                            (dict(moe_layers=[1, 3]), r"MoE layers \[0, 2\], the model has \[1, 3\]"),
                            (dict(num_local_experts=32), "16 experts, the model has 32")):
        other = SimpleNamespace(**{**vars(model), **change})
        with pytest.raises(LocusError, match=message):
            live_grouper(plan, other)


@pytest.mark.parametrize("field, value, message", [
    ("kind", "bag-of-words", "kind"),
    ("tokens", -1, "tokens must be an integer >= 0"),
    ("shares", "not base64!", "shares is not valid base64"),
    ("experts", "AAAA", r"experts holds 3 bytes"),
    ("moe_layers", [0, 1], "moe_layers"),
    ("num_experts", 8, "num_experts 8 differs"),
    ("domains", ["code", "code", "a", "b"], "distinct non-empty domain names"),
    ("domain_log_prior", [0.5, -1, -1, -1], "domain_log_prior must list 4 log-probabilities"),
    ("domain_log_probs", "AAAA", "domain_log_probs holds 3 bytes"),
])
def test_a_corrupt_table_is_refused_naming_the_field(worded, tmp_path, field, value, message):
    plan = make_plan("locality", worded, parse_topology("4x1", 16, 5), (0, 120)).plan
    plan.grouping["predictor"][field] = value
    path = tmp_path / "plan.json"
    plan.save(path)
    with pytest.raises(PlanError, match=message):
        spec_of(load_plan(path))


def test_locus_plan_says_what_predictor_it_stored(worded, tmp_path, capsys):
    from locus.cli import main

    out = tmp_path / "plan.json"
    assert main(["plan", str(worded.path), "--topology", "4x1", "--slots", "5", "--requests", "0:120",
                 "--predictor-tokens", "16", "-o", str(out)]) == 0
    assert "prompt predictor (untagged requests)  16 tokens x 8 experts, a classifier of 4 domains" in capsys.readouterr().out
    assert main(["plan", str(worded.path), "--topology", "4x1", "--predictor-tokens", "-1", "-o", str(out)]) == 2
    assert "--predictor-tokens must be >= 0" in capsys.readouterr().err
