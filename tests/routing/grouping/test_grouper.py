"""The online micro-batch grouper: admission by domain, the attention cap, moves that pay, release."""

import numpy as np
import pytest

from locus.errors import LocusError
from locus.routing.plan.caps import Caps
from locus.routing.grouping.grouper import Grouper
from locus.routing.plan.grouping_spec import GroupingSpec, domain_node_weights
from locus.routing.grouping.node_cost import NodeCostModel
from locus.routing.plan.placement import PlacementPlan, PlanError
from locus.routing.plan.topology import Topology

TOPOLOGY = Topology(2, 2, 2)  # 2 nodes x 2 GPUs, 4 experts, 1 layer


def spec(domains=None, cap=1.10, kv=10, prior_tokens=0.0, decode=100.0):
    return GroupingSpec(
        domain_nodes=domains or {"code": [1.0, 0.0], "math": [0.0, 1.0], "chat": [0.5, 0.5]},
        caps=Caps(attention=cap), expected_decode_tokens=decode, kv_bytes_per_token=kv, bytes_per_send=1,
        top_k=1, expert_prior=np.full((1, 4), 0.25), prior_tokens=prior_tokens,
    )


def plan_with(grouping: GroupingSpec) -> PlacementPlan:
    # Node 0 (ranks 0, 1) holds experts 0 and 1; node 1 (ranks 2, 3) holds 2 and 3.
    slots = np.array([[[0, 0], [1, 1], [2, 2], [3, 3]]])
    return PlacementPlan("toy", 4, (0,), TOPOLOGY, slots, grouping=grouping.to_dict())


def test_domain_weights_lay_domains_end_to_end():
    weights = domain_node_weights(["a", "a", "a", "b", "", "c"], np.array([3, 3, 3, 2, 50, 1]), 3)
    # tagged tokens: a 9, b 2, c 1 of 12 -> a covers [0, 2.25), b [2.25, 2.75), c [2.75, 3); "" is no tag
    assert weights == {"a": [1.0, 1.0, 0.25], "b": [0.0, 0.0, 0.5], "c": [0.0, 0.0, 0.25]}


def test_admission_follows_domains_and_fills_ranks_least_loaded_first():
    g = Grouper(TOPOLOGY, spec())
    assert [g.admit(f"r{i}", d, 10) for i, d in enumerate(["code", "code", "math", "math", "code"])] == [0, 1, 2, 3, 0]
    assert g.admit("c5", "code", 10) == 1
    # node 0 now holds 20 + 20 of 60 tokens: a third code request would leave rank 0 at 30 > max(1.1 * 17.5,
    # 17.5 + 10): over the cap, so it goes to the least-loaded rank instead
    assert g.admit("c6", "code", 10) == 2 and g.stats.overflowed == 1
    assert g.admit("x", None, 10) == 3  # untagged: least-loaded rank anywhere
    assert g.admit("y", "unknown-domain", 1) == 0  # a domain the plan never saw: likewise (all at 20)
    with pytest.raises(LocusError, match="already admitted"):
        g.admit("x", None, 1)


def test_bursty_arrivals_respect_the_attention_cap():
    # A burst of 400 "code" requests (all wanting node 0), then mixed traffic; sizes vary 50x.
    g = Grouper(TOPOLOGY, spec(cap=1.10))
    rng = np.random.default_rng(0)
    domains = ["code"] * 400 + list(rng.choice(["code", "math", "chat"], 400))
    for i, d in enumerate(domains):
        g.admit(f"r{i}", d, int(rng.integers(10, 500)))
        if i >= 40:  # once ranks hold a few requests each, the cap (or one request of slack) holds
            assert g.loads.max() <= max(1.10 * g.loads.mean(), g.loads.mean() + 500)
    assert g.attention_imbalance() <= 1.10
    assert g.stats.overflowed > 0  # the burst did not all fit on node 0


def test_a_move_happens_only_when_it_pays_and_fits():
    plan = plan_with(spec(kv=10))
    g = Grouper.from_plan(plan)
    signature = np.array([[0.0, 0.0, 30.0, 10.0]])  # uses node 1's experts only
    # Expected bytes per token: node 0 sends every pair away (1 byte), node 1 none.
    np.testing.assert_allclose(g.cost.expected_bytes(signature), [1.0, 0.0])
    g.admit("a", "code", 120, prompt_tokens=20)  # rank 0, 100 decode tokens to come
    g.admit("b", "math", 120, prompt_tokens=20)
    # saved = 1 byte * 100 expected decode tokens > migration 20 tokens * 10 bytes? no: 100 < 200
    assert g.observe_prefill("a", signature) is None
    g2 = Grouper.from_plan(plan_with(spec(kv=2, cap=2.0)))  # migration 40 bytes < 100 saved: move
    g2.admit("a", "code", 120, prompt_tokens=20)
    g2.admit("b", "math", 120, prompt_tokens=20)
    new = g2.observe_prefill("a", signature)
    assert new == 3 and g2.node_of("a") == 1  # node 1's least-loaded rank
    assert g2.stats.moves == 1 and g2.stats.migrated_kv_bytes == 40
    np.testing.assert_allclose(g2.loads, [20, 0, 120, 100])  # the prompt stays charged where it ran
    assert g2.observe_prefill("a", signature) is None  # one decision per request
    g2.finish("a")
    np.testing.assert_allclose(g2.loads, [0, 0, 120, 0])
    with pytest.raises(LocusError, match="never admitted"):
        g2.rank_of("a")


def test_a_move_that_would_break_the_cap_is_refused():
    g = Grouper.from_plan(plan_with(spec(kv=1, cap=1.0)))
    for i, (d, n) in enumerate([("math", 400), ("math", 400), ("code", 420), ("code", 400)]):
        g.admit(f"r{i}", d, n, prompt_tokens=20)
    before = g.loads.copy()
    assert g.observe_prefill("r2", np.array([[0.0, 0.0, 5.0, 5.0]])) is None  # node 1 is full at cap 1.0
    np.testing.assert_array_equal(g.loads, before)


def test_shrinking_towards_the_prior_makes_short_prompts_cautious():
    cost = NodeCostModel.from_plan(plan_with(spec(prior_tokens=16.0)), spec(prior_tokens=16.0))
    one_token = cost.expected_bytes(np.array([[0.0, 0.0, 1.0, 0.0]]))
    many = cost.expected_bytes(np.array([[0.0, 0.0, 100.0, 0.0]]))
    assert one_token[0] - one_token[1] < 0.2 < many[0] - many[1]


def test_grouping_spec_round_trip_and_errors():
    s = spec()
    again = GroupingSpec.from_dict(s.to_dict(), nodes=2, num_layers=1, num_experts=4)
    assert again.domain_nodes == s.domain_nodes and again.kv_bytes_per_token == 10
    bad = s.to_dict() | {"domain_nodes": {"code": [1.0]}}
    with pytest.raises(PlanError, match=r"domain_nodes\['code'\] must list 2"):
        GroupingSpec.from_dict(bad, nodes=2, num_layers=1, num_experts=4)
    with pytest.raises(PlanError, match="expert_prior must be"):
        GroupingSpec.from_dict(s.to_dict(), nodes=2, num_layers=3, num_experts=4)
    no_grouping = PlacementPlan("toy", 4, (0,), TOPOLOGY, np.array([[[0, 1], [2, 3], [0, 1], [2, 3]]]))
    with pytest.raises(PlanError, match="has no grouping object"):
        Grouper.from_plan(no_grouping)


@pytest.mark.parametrize("order", ["trace", "ranks"])
def test_replay_counts_prompt_rows_at_admission_and_decode_rows_after_the_move(tmp_path, order):
    # A moved request replays exactly like two requests, its prompt on one rank and its decode on another
    # (one replica per expert, so the position tie-break cannot differ between the two).
    from locus.routing.replay.assignment import Assignment
    from locus.routing.replay.simulator import replay
    from locus.traces.format import TraceMeta
    from locus.traces.reader import TraceReader
    from locus.traces.writer import TraceWriter

    rng = np.random.default_rng(0)
    meta = TraceMeta("toy", 4, 2, (0,), hidden_size=8)
    rows = [np.argsort(rng.random((n, 1, 4)), axis=2)[:, :, :2] for n in (7, 5, 9)]
    prompts = (3, 2, 4)
    with TraceWriter(tmp_path / "a", meta) as w:
        for i, (r, p) in enumerate(zip(rows, prompts)):
            w.add_request(f"r{i}", "code", p, r)
    with TraceWriter(tmp_path / "b", meta) as w:
        for i, (r, p) in enumerate(zip(rows, prompts)):
            w.add_request(f"r{i}p", "code", p, r[:p])
            w.add_request(f"r{i}d", "code", 0, r[p:])
    plan = PlacementPlan("toy", 4, (0,), TOPOLOGY, np.array([[[0, 0], [1, 1], [2, 2], [3, 3]]]))
    split = Assignment("moved", 0, np.array([0, 1, 2]), np.array([3, 1, 0]), migrations=2, migrated_kv_bytes=50)
    flat = Assignment("flat", 0, np.array([0, 3, 1, 1, 2, 0]))
    a = replay(TraceReader(tmp_path / "a"), plan, TOPOLOGY, split, batch_tokens=4, step_order=order)
    b = replay(TraceReader(tmp_path / "b"), plan, TOPOLOGY, flat, batch_tokens=4, step_order=order)
    for key in ("inter_node_bytes", "intra_node_bytes", "locality", "expert_imbalance_mean", "attention_imbalance"):
        assert getattr(a, key) == getattr(b, key)
    if order == "ranks":  # per-rank queues hold the same rows in the same order
        assert a.step_expert_imbalance_mean == b.step_expert_imbalance_mean and a.steps == b.steps
    assert a.migrations == 2 and a.migrated_kv_bytes == 50 and b.migrated_kv_bytes == 0


def test_the_stream_cap_keeps_every_rank_within_one_sequence_of_the_others():
    """Ranks that step in lockstep (expert parallelism) wait for the busiest: with balance_streams no
    admission leaves a rank above ceil(live sequences / ranks), while the domain still picks the node
    wherever that holds."""
    g = Grouper(TOPOLOGY, spec(cap=10.0), balance_streams=True)  # a loose token cap: only the stream cap binds
    ranks = [g.admit(f"c{i}", "code", 10 + i) for i in range(6)]  # code belongs on node 0 (ranks 0, 1)
    assert ranks[:2] == [0, 1]  # node 0 while it has room
    assert sorted(g.streams.tolist()) == [1, 1, 2, 2] and g.streams.max() - g.streams.min() <= 1
    assert g.admit("n2", "code", 5, streams=2) in (2, 3)  # n = 2: two sequences, to a rank with room for both
    assert g.streams.max() - g.streams.min() <= 2
    g.finish("c0")
    assert g.streams.sum() == 7
    unbalanced = Grouper(TOPOLOGY, spec(cap=10.0))
    assert [unbalanced.admit(f"c{i}", "code", 10) for i in range(6)] == [0, 1, 0, 1, 0, 1]  # all on node 0


def test_unavailable_ranks_take_nothing_and_the_caps_count_the_others():
    """A router's backends that are down: the grouper places around them, its caps over the open ranks."""
    g = Grouper(TOPOLOGY, spec(), balance_streams=True)
    assert [g.admit(f"c{i}", "code", 10, unavailable=(1,)) for i in range(3)] == [0, 2, 3]
    assert g.last_choice.how == "tagged" and g.last_choice.domain == "code" and g.last_choice.overflowed
    # with rank 1 back, the stream ceiling is over all four ranks again: rank 1 is the only one under it
    assert g.admit("c3", "code", 10) == 1 and not g.last_choice.overflowed
    with pytest.raises(LocusError, match="none of the 4 ranks"):
        g.admit("x", None, 1, unavailable=range(4))
    with pytest.raises(LocusError, match="not one of the 4 ranks"):
        g.admit("x", None, 1, unavailable=(7,))
    assert "x" not in g.live
    g.admit("u", None, 1, unavailable=(0, 1, 2))
    assert g.rank_of("u") == 3 and g.last_choice.how == "least-loaded" and g.last_choice.domain is None


def test_no_unavailable_rank_changes_nothing():
    """Every rank open: the same choices as a grouper never told of unavailable ranks."""
    rng = np.random.default_rng(1)
    a, b = Grouper(TOPOLOGY, spec(), balance_streams=True), Grouper(TOPOLOGY, spec(), balance_streams=True)
    for i in range(200):
        d = rng.choice(["code", "math", "chat", "other"])
        w = int(rng.integers(5, 200))
        assert a.admit(f"r{i}", d, w) == b.admit(f"r{i}", d, w, unavailable=())
        if i > 10 and rng.random() < 0.5:
            victim = f"r{int(rng.integers(0, i))}"
            a.finish(victim)
            b.finish(victim)
