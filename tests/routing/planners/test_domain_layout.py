"""The order of the domains on the grouping line: domains that use the same experts share nodes."""

import numpy as np
import pytest

from locus.routing.grouping.grouper import Grouper
from locus.routing.grouping.simulation import simulate_grouper
from locus.routing.plan.grouping_spec import domain_node_weights
from locus.routing.plan.placement import PlanError
from locus.routing.plan.topology import Topology
from locus.routing.planners.domain_layout import choose_domain_order, domain_orders, domain_profiles, uncovered_pairs
from locus.routing.planners.planner import make_plan
from locus.routing.replay.simulator import replay
from locus.traces.reader import TraceReader

from tests.routing.planners.planner_fixtures import paired_trace


def profiles_for(pairs_per_domain):
    """[D, 1, E] from one row of pairs per domain (one layer)."""
    return np.asarray(pairs_per_domain, dtype=np.float64)[:, None, :]


def test_domains_using_the_same_experts_share_a_node():
    domains, tokens = ["a", "b", "c", "d"], np.array([10, 10, 10, 10])
    # a and c use experts 0-1, b and d use 2-3; a node holds 2 experts
    profiles = profiles_for([[5, 5, 0, 0], [0, 0, 5, 5], [5, 5, 0, 0], [0, 0, 5, 5]])
    order = choose_domain_order(domains, tokens, profiles, nodes=2, slots_per_node=2)
    weights = domain_node_weights(domains, tokens, 2, order=order)
    assert weights["a"] == weights["c"] and weights["b"] == weights["d"] and weights["a"] != weights["b"]
    # the size order (a tie: by name) pairs a with b, and leaves half of every node's pairs uncovered
    size = domain_node_weights(domains, tokens, 2)
    assert size["a"] == size["b"] == [0.5, 0.0]
    fractions = lambda w: np.array([w[d] for d in domains]) / np.array([w[d] for d in domains]).sum(1, keepdims=True)
    assert uncovered_pairs(fractions(size), profiles, 2) == 20.0
    assert uncovered_pairs(fractions(weights), profiles, 2) == 0.0


def test_without_expert_structure_the_size_order_stays():
    domains, tokens = ["x", "y", "y", "z"], np.array([3, 4, 4, 2])
    flat = profiles_for([[3, 3, 3], [8, 8, 8], [2, 2, 2]])
    order = choose_domain_order(domains, tokens, flat, nodes=2, slots_per_node=2)
    assert order == ["y", "x", "z"]  # largest first, as domain_node_weights without an order
    assert domain_node_weights(domains, tokens, 2, order=order) == domain_node_weights(domains, tokens, 2)
    # a node that can hold every expert: every order costs nothing, so the size order stays too
    skewed = profiles_for([[9, 0, 0], [0, 9, 0], [0, 0, 9]])
    assert choose_domain_order(domains, tokens, skewed, nodes=2, slots_per_node=3) == ["y", "x", "z"]


def test_many_domains_are_ordered_by_swaps():
    rng = np.random.default_rng(0)
    names = [f"d{i:02d}" for i in range(10)]  # over the exhaustive limit
    domains, tokens = names, np.full(10, 5)
    group = np.arange(10) % 2  # even domains use experts 0-3, odd 4-7
    profiles = np.zeros((10, 2, 8))
    for i in range(10):
        profiles[i, :, 4 * group[i]:4 * group[i] + 4] = rng.integers(1, 5, (2, 4))
    order = choose_domain_order(domains, tokens, profiles, nodes=2, slots_per_node=4)
    weights = domain_node_weights(domains, tokens, 2, order=order)
    f = np.array([weights[d] for d in names])
    f = f / f.sum(1, keepdims=True)
    assert uncovered_pairs(f, profiles, 4) == 0.0


def test_an_order_must_name_every_domain_once():
    with pytest.raises(PlanError, match="every tagged domain once"):
        domain_node_weights(["a", "b"], np.array([1, 1]), 2, order=["a"])
    with pytest.raises(PlanError, match="every tagged domain once"):
        domain_node_weights(["a", "b"], np.array([1, 1]), 2, order=["a", "a"])


def test_domain_profiles_sum_each_tagged_domains_pairs():
    pairs = np.arange(4 * 1 * 2).reshape(4, 1, 2)
    out = domain_profiles(["b", "", "a", "b"], pairs)
    assert out.tolist() == [[[4, 5]], [[6, 8]]]  # a; b (rows 0 and 3); untagged rows left out


def test_the_planner_puts_domains_that_share_experts_on_one_node(tmp_path):
    reader = TraceReader(paired_trace(tmp_path / "paired"))
    topology = Topology(2, 2, 2)  # 4 slots per node: one pair of domains' experts
    half = len(reader.requests) // 2
    result = make_plan("locality", reader, topology, (0, half))
    nodes = result.plan.grouping["domain_nodes"]
    assert nodes["a"] == nodes["c"] and nodes["b"] == nodes["d"] and nodes["a"] != nodes["b"]
    grouped = simulate_grouper(Grouper.from_plan(result.plan), reader, half, len(reader.requests))
    out = replay(reader, result.plan, topology, grouped)
    assert out.locality >= 0.99 and out.inter_node_bytes == 0
    assert out.expert_imbalance_worst <= 1.10 and out.attention_imbalance <= 1.10


def test_candidate_orders_start_with_the_size_order_and_differ_in_layout():
    domains, tokens = ["a", "b", "c", "d"], np.array([10, 10, 10, 10])
    profiles = profiles_for([[5, 5, 0, 0], [0, 0, 5, 5], [5, 5, 0, 0], [0, 0, 5, 5]])
    orders = domain_orders(domains, tokens, profiles, nodes=2, slots_per_node=2, count=3)
    assert orders[0] == ["a", "b", "c", "d"]  # the size order (a tie: by name)
    # then only layouts scoring below it: a with c (a with d scores as a with b does); the mirror image
    # of a layout is the same layout
    assert len(orders) == 2 and frozenset(orders[1][:2]) in (frozenset("ac"), frozenset("bd"))
    # three layouts that all score below the size order
    skew = profiles_for([[9, 1, 0, 0], [0, 0, 5, 5], [5, 5, 0, 0], [1, 0, 4, 5]])
    orders = domain_orders(domains, tokens, skew, nodes=2, slots_per_node=2, count=3)
    pairs = [frozenset([frozenset(o[:2]), frozenset(o[2:])]) for o in orders]
    assert orders[0] == ["a", "b", "c", "d"] and len(set(pairs)) == len(orders)


def test_the_planner_keeps_the_candidate_layout_that_places_best(tmp_path, monkeypatch):
    # the planner places every candidate layout on its own grouping and keeps the one with the lowest
    # expected bytes, so its first round never scores worse on the planning data than the size order's
    from locus.routing.planners import planner

    reader = TraceReader(paired_trace(tmp_path / "paired"))
    topology = Topology(2, 2, 2)
    half = len(reader.requests) // 2
    scores = []
    real = planner.expected_bytes_per_token

    def spy(plan, spec, *args, **kwargs):
        out = real(plan, spec, *args, **kwargs)
        scores.append((tuple(sorted((d, tuple(w)) for d, w in spec.domain_nodes.items())), out))
        return out

    monkeypatch.setattr(planner, "expected_bytes_per_token", spy)
    result = make_plan("locality", reader, topology, (0, half))
    candidates = scores[:2]  # the size order and a with c (the only layout scoring below it)
    assert len(candidates) == 2
    chosen = tuple(sorted((d, tuple(w)) for d, w in result.plan.grouping["domain_nodes"].items()))
    best = min(candidates, key=lambda c: c[1])
    assert chosen == best[0] and best[1] < candidates[0][1]  # the size order (first) places worse here


def test_untagged_or_one_domain_has_one_layout():
    profiles = profiles_for([[1, 2, 3]])
    assert domain_orders(["", ""], np.array([3, 4]), profiles[:0], 2, 2, 3) == [[]]
    assert domain_orders(["a", ""], np.array([3, 4]), profiles, 2, 2, 3) == [["a"]]
