"""locus/engine/policies/plan_grouping.py: the engine's GroupingPolicy on the grouper, with fake scheduled items."""

from types import SimpleNamespace

import numpy as np

from locus.engine.policies.plan_grouping import PlanGrouping
from locus.engine.observers.routing_tap import StepRouting
from locus.routing.plan.caps import Caps
from locus.routing.plan.grouping_spec import GroupingSpec
from locus.routing.plan.placement import PlacementPlan
from locus.routing.plan.topology import Topology

TOPOLOGY = Topology(2, 2, 2)


def make_plan(kv=1, cap=2.0):
    spec = GroupingSpec(domain_nodes={"code": [1.0, 0.0], "math": [0.0, 1.0]}, caps=Caps(attention=cap),
                        expected_decode_tokens=100.0, kv_bytes_per_token=kv, bytes_per_send=1, top_k=1,
                        expert_prior=np.full((1, 4), 0.25), prior_tokens=0.0)
    slots = np.array([[[0, 0], [1, 1], [2, 2], [3, 3]]])  # node 0: experts 0, 1; node 1: experts 2, 3
    return PlacementPlan("toy", 4, (5,), TOPOLOGY, slots, grouping=spec.to_dict())


def item(rid, domain, prompt_len, num_tokens=None):
    request = SimpleNamespace(request_id=rid, domain=domain, finished=False)
    seq = SimpleNamespace(request=request, prompt_ids=list(range(prompt_len)))
    return SimpleNamespace(seq=seq, num_tokens=num_tokens or prompt_len)


def test_each_sequence_goes_to_its_nodes_micro_batch():
    policy = PlanGrouping.from_plan(make_plan(), moe_layers=(5,))
    items = [item("a", "code", 4), item("b", "math", 4), item("c", "code", 4), item("d", None, 4)]
    groups = policy.group(items, num_micro_batches=2)
    assert [[i.seq.request.request_id for i in g] for g in groups] == [["a", "c"], ["b", "d"]]
    assert policy.last_nodes == [[0], [1]]
    # One micro-batch: everything together, node order kept; an empty node's micro-batch is dropped.
    assert [len(g) for g in policy.group(items, 1)] == [4]
    assert [i.seq.request.request_id for i in policy.group([items[1]], 2)[0]] == ["b"]


def test_finished_requests_are_released():
    policy = PlanGrouping.from_plan(make_plan(), moe_layers=(5,))
    a = item("a", "code", 4)
    policy.group([a], 2)
    assert policy.grouper.loads.sum() == 104  # prompt + expected decode
    a.seq.request.finished = True
    policy.group([], 2)
    assert policy.grouper.loads.sum() == 0 and "a" not in policy.grouper.live


def test_prefill_routing_moves_a_request_after_a_chunked_prefill():
    policy = PlanGrouping.from_plan(make_plan(kv=1), moe_layers=(5,))
    a, b = item("a", "code", 6, num_tokens=3), item("b", "math", 2)
    policy.group([a, b], 2)
    assert policy.grouper.node_of("a") == 0

    def step(rows_a, start_a):
        ids = np.array([[[e]] for e in rows_a] + [[[2]], [[3]]], dtype=np.int16)  # [T, L=1, K=1]: a's rows, then b's
        spans = [SimpleNamespace(start=start_a), SimpleNamespace(start=0)]
        ranges = [(spans[0], 0, len(rows_a)), (spans[1], len(rows_a), len(rows_a) + 2)]
        policy.observe(StepRouting(ids, np.ones(ids.shape, np.float16), [a, b], ranges))

    step([2, 3, 2], 0)  # first half of a's prompt: no decision yet
    assert policy.grouper.node_of("a") == 0 and policy.grouper.stats.moves == 0
    step([3, 2, 2], 3)  # prompt complete: all 6 pairs on node 1's experts -> saves 100 B > 6 B of KV
    assert policy.grouper.node_of("a") == 1 and policy.grouper.stats.moves == 1
    assert [[i.seq.request.request_id for i in g] for g in policy.group([a, b], 2)] == [["a", "b"]]
    assert policy.last_nodes == [[1]]


def test_an_untagged_prompt_is_placed_by_the_plans_predictor(tmp_path):
    """The single-process grouper reads the plan's prompt predictor too, and refuses one of another model."""
    import pytest

    from locus.errors import LocusError
    from locus.routing.plan.topology import parse_topology
    from locus.routing.planners.planner import make_plan as plan_from
    from locus.traces.reader import TraceReader
    from tests.routing.planners.planner_fixtures import worded_trace

    reader = TraceReader(worded_trace(tmp_path / "t"))
    plan = plan_from("locality", reader, parse_topology("4x1", 16, 5), (0, 120)).plan
    config = SimpleNamespace(vocab_size=64, moe_layers=(0, 2), num_local_experts=16)
    tagged = PlanGrouping.from_plan(plan, (0, 2))
    blind = PlanGrouping.from_plan(plan, (0, 2), model_config=config)
    for i in range(120, 140):
        r = reader.requests[i]
        lo = int(reader.offsets[i])
        prompt = [int(t) for t in reader.token_ids[lo: lo + r.prompt_tokens]]
        one = item(r.id, None, 0)
        one.seq.prompt_ids = prompt
        blind.group([one], 4)
        tagged.group([item(r.id, r.domain, len(prompt))], 4)
        assert blind.rank_of(r.id) == tagged.rank_of(r.id)
    assert blind.grouper.stats.admitted_by_prediction == 20
    with pytest.raises(LocusError, match="a vocabulary of 64 tokens, the model has 100"):
        PlanGrouping.from_plan(plan, (0, 2), model_config=SimpleNamespace(**{**vars(config), "vocab_size": 100}))
