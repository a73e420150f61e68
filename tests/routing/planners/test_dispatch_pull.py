"""The planner's load model under the node-aware dispatch rule (dispatch_pull.py + expected_load.py):
with the pull measured on a set of tokens it reproduces, rank by rank, what the rule itself does with
those tokens; and plans made with it keep the hard constraints."""

import numpy as np
import pytest

from locus.routing.dispatch_rule import build_dispatch_table, route
from locus.routing.plan.caps import Caps
from locus.routing.plan.placement import PlacementPlan, node_replicas, validate
from locus.routing.plan.topology import Topology
from locus.routing.planners.dispatch_pull import RoutingSample, pull_from_counts, remote_counts, sample_routings
from locus.routing.planners.expected_load import rank_loads, remote_loads
from locus.routing.planners.planner import PlanOptions, make_plan
from locus.routing.planners.slot_search import contributions, copies_per_rank
from locus.routing.replay.simulator import replay
from locus.traces.reader import TraceReader

from tests.routing.planners.planner_fixtures import synth_trace


def _one_copy_per_node_plan(rng, N, G, S, E, L):
    """Slots [L, R, S] where no node holds an expert twice (so the split inside a node is trivial) and
    every expert is held somewhere, most on two or three nodes."""
    slots = np.empty((L, N * G, S), dtype=np.int64)
    for l in range(L):
        while True:
            held = [rng.permutation(E)[: G * S] for _ in range(N)]
            if len(np.unique(np.concatenate(held))) == E:
                break
        for n in range(N):
            slots[l, n * G : (n + 1) * G] = held[n].reshape(G, S)
    return slots


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_rank_loads_with_measured_pull_equal_the_node_aware_rule(seed):
    rng = np.random.default_rng(seed)
    N, G, S, E, K, L, T = 5, 2, 4, 16, 4, 2, 300
    topology = Topology(N, G, S)
    slots = _one_copy_per_node_plan(rng, N, G, S, E, L)
    plan = PlacementPlan("toy", E, tuple(range(L)), topology, slots, dispatch="node-aware")
    validate(plan)
    # Skewed top-K routings; every token runs once on every rank of its node (the model's even spread
    # of a node's tokens over its ranks), at positions 0..T-1.
    weights = rng.gamma(0.4, 1.0, E)
    ids = np.stack([np.stack([rng.choice(E, K, replace=False, p=weights / weights.sum()) for _ in range(L)])
                    for _ in range(T)]).astype(np.int16)  # [T, L, K]
    node = rng.integers(0, N, T)
    position = np.arange(T)
    table = build_dispatch_table(plan, "node-aware")
    actual = np.zeros((L, N * G))
    demand = np.zeros((L, N, E))
    for g in range(G):
        dest = route(table, ids, node * G + g, position)  # [T, L, K]
        for l in range(L):
            actual[l] += np.bincount(dest[:, l].ravel(), minlength=N * G)
    for l in range(L):
        np.add.at(demand[l], (np.repeat(node, K), ids[:, l].ravel().astype(np.int64)), G)

    sample = RoutingSample(ids, np.arange(T), position, np.zeros(T, dtype=bool))
    counts = remote_counts(plan, sample, node, node)  # [L, N, E, N]
    x = node_replicas(slots, N, E)
    pull = pull_from_counts(counts, x, prior_pairs=0.0)
    np.testing.assert_allclose(rank_loads(slots, demand, pull), actual, rtol=1e-9, atol=1e-9)
    # The even spread (the `position` rule) does not: the node-aware rule concentrates remote pairs.
    even = rank_loads(slots, demand)
    assert np.abs(even - actual).max() > 0.05 * actual.mean()
    # The cap search's incremental form (slot_search.contributions) agrees with rank_loads.
    for l in range(L):
        h = copies_per_rank(slots[l], E)
        contrib = contributions(np.ascontiguousarray(demand[l].T), np.ascontiguousarray(h.T), G,
                                np.ascontiguousarray(pull[l].transpose(1, 0, 2)))
        np.testing.assert_allclose(contrib.sum(0), actual[l], rtol=1e-9, atol=1e-9)


def test_pull_of_even_counts_is_the_even_spread():
    rng = np.random.default_rng(3)
    N, E = 4, 6
    x = rng.integers(0, 3, (1, N, E))
    x[0, 0] = 1  # every expert held
    share = x[0].T / x[0].sum(0)[:, None]  # [E, N] the even spread's share of every node
    counts = np.zeros((1, N, E, N))
    for n in range(N):
        for e in range(E):
            if x[0, n, e] == 0:
                counts[0, n, e] = 60.0 * share[e]
    pull = pull_from_counts(counts, x)
    demand = rng.gamma(1.0, 5.0, (1, N, E))
    np.testing.assert_allclose(remote_loads(demand, x, pull)[x > 0], remote_loads(demand, x)[x > 0], rtol=1e-9)


@pytest.mark.parametrize("budget", ["top", "marginal"])
@pytest.mark.parametrize("seed, topology, top_k", [(0, Topology(4, 2, 6), 3), (1, Topology(3, 2, 7), 4)])
def test_plans_under_the_dispatch_load_model_keep_the_constraints(tmp_path, budget, seed, topology, top_k):
    reader = TraceReader(synth_trace(tmp_path / "t", requests=120, seed=seed, experts=32, top_k=top_k,
                                     layers=(0, 1, 2)))
    cap = 1.10
    result = make_plan("locality", reader, topology, (0, 60),
                       PlanOptions(caps=Caps(expert=cap), seed=seed, replica_budget=budget,
                                   load_model="dispatch"))
    plan = result.plan
    validate(plan, num_experts=32, moe_layers=reader.meta.moe_layers)  # every expert in every layer
    assert plan.slots.shape == (3, topology.ranks, topology.slots_per_gpu)  # exact slot counts
    assert (np.bincount(plan.slots.reshape(3, -1)[0], minlength=32) >= 1).all()
    # The cap, under the node-aware rule as the plan's grouping routes it (in sample: the measurement
    # covers every planning token, so only the model's even spread of a node's tokens over its ranks
    # and the shrinkage of small counts separate it from a replay).
    assert result.summary.expert_imbalance_worst <= cap + 1e-9
    report = replay(reader, plan, topology, result.assignment)
    assert report.expert_imbalance_worst <= cap + 0.03


def test_sample_takes_every_mth_request_with_positions_and_phases(tmp_path):
    reader = TraceReader(synth_trace(tmp_path / "t", requests=40, seed=0, experts=16, top_k=2, layers=(0, 1)))
    total = int(reader.offsets[30] - reader.offsets[10])
    sample = sample_routings(reader, 10, 30, max_tokens=total // 3)
    chosen = np.unique(sample.request)
    assert chosen[0] == 0 and len(chosen) in (5, 6, 7) and (np.diff(chosen) == np.diff(chosen)[0]).all()
    for i in chosen:
        r = 10 + int(i)
        rows = sample.request == i
        np.testing.assert_array_equal(sample.expert_ids[rows], reader.request_rows(r))
        np.testing.assert_array_equal(sample.position[rows], np.arange(reader.requests[r].tokens))
        assert sample.decode[rows].sum() == reader.requests[r].tokens - reader.requests[r].prompt_tokens


def test_plans_differ_only_where_the_rules_do(tmp_path):
    """top-1 routing or two nodes: the rules coincide, so the load model measures nothing and the plan is
    the even model's."""
    reader = TraceReader(synth_trace(tmp_path / "t", requests=80, seed=2, experts=16, top_k=1, layers=(0, 1)))
    a = make_plan("locality", reader, Topology(4, 2, 3), (0, 40), PlanOptions(load_model="even")).plan
    b = make_plan("locality", reader, Topology(4, 2, 3), (0, 40), PlanOptions(load_model="dispatch")).plan
    np.testing.assert_array_equal(a.slots, b.slots)


def test_load_model_default_follows_the_replica_budget(tmp_path):
    from locus.errors import LocusError
    from locus.routing.planners.planner import load_model_for

    assert load_model_for(PlanOptions()) == "even"
    assert load_model_for(PlanOptions(replica_budget="marginal")) == "dispatch"
    assert load_model_for(PlanOptions(replica_budget="marginal", load_model="even")) == "even"
    reader = TraceReader(synth_trace(tmp_path / "t", requests=40, seed=0, experts=16, top_k=2, layers=(0, 1)))
    with pytest.raises(LocusError, match="load model"):
        make_plan("locality", reader, Topology(4, 1, 5), (0, 20), PlanOptions(load_model="exact"))


def test_cli_load_model_flag(tmp_path, capsys):
    from locus.cli import main

    trace = synth_trace(tmp_path / "t", requests=60, seed=1, experts=16, top_k=3, layers=(0, 1))
    out = tmp_path / "plan.json"
    assert main(["plan", str(trace), "--topology", "4x2", "--slots", "3", "--requests", "0:30",
                 "--replica-budget", "marginal", "--load-model", "dispatch", "-o", str(out)]) == 0
    assert "expert imbalance" in capsys.readouterr().out
    from locus.routing.plan.placement import load_plan

    validate(load_plan(out), num_experts=16, moe_layers=(0, 1))
