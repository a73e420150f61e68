"""bench/admission_bound.py on a served trace written from a synthetic one: the served and reference rows
are the replay's figures, every re-pick keeps each request on its node, and what the choice knows moves
requests."""

import json
import sys

import numpy as np
import pytest

from locus.routing.grouping.live import simulate_live
from locus.routing.plan.caps import Caps
from locus.routing.plan.placement import load_plan
from locus.routing.plan.topology import parse_topology
from locus.routing.planners.planner import PlanOptions, make_plan
from locus.routing.replay.assignment import assign_balanced, assign_recorded
from locus.routing.replay.simulator import replay
from locus.traces.format import RequestRecord
from locus.traces.reader import TraceReader
from locus.traces.writer import TraceWriter
from tests.bench.bench_scripts import BENCH, run_bench
from tests.routing.planners.planner_fixtures import synth_trace

sys.path.insert(0, str(BENCH))

import admission_bound  # noqa: E402


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """A synthetic trace planned on its first half; its second half written back as a server records it:
    each request's rank from the live admission and its admission order."""
    tmp = tmp_path_factory.mktemp("served")
    reader = TraceReader(synth_trace(tmp / "t", requests=200, seed=5, experts=16, top_k=2, layers=(1, 3)))
    topology = parse_topology("2x2", 16, 5)
    plans = {}
    for name in ("eplb", "locality"):
        plans[name] = make_plan(name, reader, topology, (0, 100), PlanOptions(caps=Caps(), seed=0)).plan
        plans[name].save(tmp / f"{name}.json")
    live = simulate_live(plans["locality"], reader, 100, 200, arrivals="closed", concurrency=16)
    offsets = np.asarray(reader.offsets)
    with TraceWriter(tmp / "served", reader.meta) as w:
        for i, r in enumerate(reader.requests[100:200]):
            rows = np.asarray(reader.expert_ids[offsets[100 + i] : offsets[101 + i]])
            w.add_requests([RequestRecord(r.id, r.domain, r.prompt_tokens, r.tokens, rank=int(live.assignment.ranks[i]),
                                          admitted=i, released=i + 16)], rows)
    return tmp


def test_rows_are_the_replays_and_repicks_keep_the_node(served):
    out = served / "bound.json"
    text = run_bench("admission_bound.py", "--trace", str(served / "served"), "--plan", str(served / "locality.json"),
                     "--reference", str(served / "eplb.json"), "--guard", "none", "--guard", "1.0", "--out", str(out))
    rows = {(r["choice"], r["guard"]): r for r in json.loads(out.read_text())["rows"]}
    reader = TraceReader(served / "served")
    topology = parse_topology("2x2", 16, 5)
    recorded = assign_recorded(reader.requests, 4)
    tokens = [r.tokens for r in reader.requests]
    for key, plan, assignment in ((("as served", "-"), "locality", recorded),
                                  (("eplb, balanced (reference)", "-"), "eplb", assign_balanced(tokens, 4))):
        report = replay(reader, load_plan(served / f"{plan}.json"), topology, assignment)
        assert rows[key]["expert_imbalance_mean"] == pytest.approx(report.expert_imbalance_mean, abs=1e-12)
        assert rows[key]["attention_imbalance"] == pytest.approx(report.attention_imbalance, abs=1e-12)
    assert len(rows) == 2 + 2 * 3  # no predictor in a synthetic trace's plan (no token ids): three choices a guard
    assert "| whole routing | 1.0 |" in text

    # the choice itself: every request stays on its node, with or without a guard
    nodes = recorded.ranks // 2
    whole = np.random.default_rng(0).random((len(tokens), 4, 2, 4))
    order = np.arange(len(tokens))
    weights = np.asarray(tokens, dtype=np.float64)
    for guard in (None, 1.0):
        ranks = admission_bound.repick(nodes, order, weights, whole, whole, guard, 2)
        assert (ranks // 2 == nodes).all()
    free = admission_bound.repick(nodes, order, weights, whole, whole, None, 2)
    level = admission_bound.repick(nodes, order, weights, whole, None, 1.0, 2)
    assert not (free == level).all()  # what the choice knows changes where requests go
