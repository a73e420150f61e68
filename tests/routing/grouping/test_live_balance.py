"""The live admission keeps the balance the plan was made for (docs/planner.md, "Live admission and
balance"): on a synthetic trace, the grouper's whole-replay attention imbalance (tokens per rank,
max / mean) stays within 0.05 of EPLB's with balanced assignment, whatever the requests in flight:
fewer than the ranks, 16 per rank, every request at once; and it still sends fewer inter-node bytes.
Slow (a minute: 800 replayed requests, fewer make any online assignment's whole-run imbalance a matter
of a few late long requests)."""

from __future__ import annotations

import pytest

from locus.cli import main
from locus.routing.grouping.live import simulate_live
from locus.routing.plan.caps import Caps
from locus.routing.plan.topology import parse_topology
from locus.routing.planners.planner import PlanOptions, make_plan
from locus.routing.replay.assignment import assign_balanced
from locus.routing.replay.simulator import parse_request_range, replay
from locus.traces.reader import TraceReader


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    trace = tmp_path_factory.mktemp("balance") / "t"
    main(["trace", "synth", "--preset", "mixtral-8x7b", "--requests", "1600", "--seed", "3", "-o", str(trace),
          "--quiet"])
    reader = TraceReader(trace)
    R = len(reader.requests)
    plan_range, replay_range = parse_request_range("0:0.5", R), parse_request_range("0.5:1", R)
    topology = parse_topology("2x4", reader.meta.num_experts, 2)
    options = PlanOptions(caps=Caps(), seed=0)
    eplb = make_plan("eplb", reader, topology, plan_range, options, trace=str(trace)).plan
    locality = make_plan("locality", reader, topology, plan_range, options, trace=str(trace)).plan
    tokens = [r.tokens for r in reader.requests[replay_range[0] : replay_range[1]]]
    balanced = assign_balanced(tokens, topology.ranks, request_start=replay_range[0])
    return reader, topology, replay_range, replay(reader, eplb, topology, balanced), locality


@pytest.mark.slow
@pytest.mark.parametrize("arrivals,in_flight", [("closed", 4), ("closed", 16 * 8), ("batch", None)],
                         ids=["fewer-than-ranks", "16-per-rank", "every-request"])
def test_the_live_grouper_keeps_eplbs_attention_balance(planned, arrivals, in_flight):
    reader, topology, (start, stop), eplb, locality = planned
    live = simulate_live(locality, reader, start, stop, arrivals=arrivals, concurrency=in_flight or 16)
    report = replay(reader, locality, topology, live.assignment)
    assert report.attention_imbalance <= eplb.attention_imbalance + 0.05
    assert report.inter_node_bytes_per_token < eplb.inter_node_bytes_per_token
