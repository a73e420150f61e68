"""The live admission keeps the balance the plan was made for (docs/planner.md, "Live admission and
balance").

- On a synthetic Mixtral trace, the grouper's whole-replay attention imbalance (tokens per rank,
  max / mean) stays within 0.05 of EPLB's with balanced assignment, whatever the requests in flight:
  fewer than the ranks, 16 per rank, every request at once; and it still sends fewer inter-node bytes.
- On the synthetic Llama-4 Maverick trace of the bench (8x8, 3 slots), at 16 requests per rank and with
  every request in flight, its expert imbalance (mean and worst layer) is also at most EPLB's: the
  grouping the plan was made for survives the live caps there. (On the `mini` recording it does not:
  there the plan's own grouping is over EPLB's on the held-out half; docs/planner.md.)
- A plan made with `--expert-cap eplb` (each layer searched at half EPLB's slack over 1.0, layer_caps.py)
  keeps EPLB's expert balance at 16 per rank and with every request in flight on a small synthetic
  Mixtral case (800 requests, 2x4, 2 slots) where the default plan (fixed cap 1.10) is over it at both;
  margins there are small (mean 1.031 and 1.029 against EPLB's 1.033).
- The rule that made the difference: a domain's node is refused only when none of its ranks fits the
  caps, not when its fewest-admitted rank does not.
Slow (a minute each: 800 and 4,000 replayed requests; fewer make any online assignment's whole-run
imbalance a matter of a few late long requests)."""

from __future__ import annotations

import numpy as np
import pytest

from locus.cli import main
from locus.routing.grouping.grouper import ADMITTED_CAP_SHARE, STREAM_CAP, Grouper
from locus.routing.grouping.live import simulate_live
from locus.routing.plan.caps import Caps
from locus.routing.plan.grouping_spec import GroupingSpec
from locus.routing.plan.topology import Topology, parse_topology
from locus.routing.planners.planner import PlanOptions, make_plan
from locus.routing.replay.assignment import assign_balanced
from locus.routing.replay.simulator import parse_request_range, replay
from locus.traces.reader import TraceReader


def plan_and_reference(tmp_path_factory, preset: str, requests: int, seed: int, topology_text: str, slots: int):
    """Plan EPLB and locality on the first half of a synthetic trace; EPLB's balanced replay of the second."""
    trace = tmp_path_factory.mktemp(preset) / "t"
    main(["trace", "synth", "--preset", preset, "--requests", str(requests), "--seed", str(seed), "-o", str(trace),
          "--quiet"])
    reader = TraceReader(trace)
    R = len(reader.requests)
    plan_range, replay_range = parse_request_range("0:0.5", R), parse_request_range("0.5:1", R)
    topology = parse_topology(topology_text, reader.meta.num_experts, slots)
    options = PlanOptions(caps=Caps(), seed=0)
    eplb = make_plan("eplb", reader, topology, plan_range, options, trace=str(trace)).plan
    locality = make_plan("locality", reader, topology, plan_range, options, trace=str(trace)).plan
    tokens = [r.tokens for r in reader.requests[replay_range[0] : replay_range[1]]]
    balanced = assign_balanced(tokens, topology.ranks, request_start=replay_range[0])
    return reader, topology, replay_range, replay(reader, eplb, topology, balanced), locality


@pytest.fixture(scope="module")
def planned(tmp_path_factory):
    return plan_and_reference(tmp_path_factory, "mixtral-8x7b", 1600, 3, "2x4", 2)


@pytest.fixture(scope="module")
def maverick(tmp_path_factory):
    return plan_and_reference(tmp_path_factory, "llama4-maverick", 8000, 0, "8x8", 3)


@pytest.mark.slow
@pytest.mark.parametrize("arrivals,in_flight", [("closed", 4), ("closed", 16 * 8), ("batch", None)],
                         ids=["fewer-than-ranks", "16-per-rank", "every-request"])
def test_the_live_grouper_keeps_eplbs_attention_balance(planned, arrivals, in_flight):
    reader, topology, (start, stop), eplb, locality = planned
    live = simulate_live(locality, reader, start, stop, arrivals=arrivals, concurrency=in_flight or 16)
    report = replay(reader, locality, topology, live.assignment)
    assert report.attention_imbalance <= eplb.attention_imbalance + 0.05
    assert report.inter_node_bytes_per_token < eplb.inter_node_bytes_per_token


@pytest.mark.slow
@pytest.mark.parametrize("arrivals,in_flight", [("closed", 16 * 64), ("batch", None)],
                         ids=["16-per-rank", "every-request"])
def test_the_live_grouper_keeps_eplbs_expert_balance_on_maverick(maverick, arrivals, in_flight):
    reader, topology, (start, stop), eplb, locality = maverick
    live = simulate_live(locality, reader, start, stop, arrivals=arrivals, concurrency=in_flight or 16)
    report = replay(reader, locality, topology, live.assignment)
    assert report.expert_imbalance_mean <= eplb.expert_imbalance_mean
    assert report.expert_imbalance_worst <= eplb.expert_imbalance_worst
    assert report.attention_imbalance <= eplb.attention_imbalance + 0.05
    assert report.inter_node_bytes_per_token < eplb.inter_node_bytes_per_token


@pytest.fixture(scope="module")
def small_mixtral(tmp_path_factory):
    return plan_and_reference(tmp_path_factory, "mixtral-8x7b", 800, 3, "2x4", 2)


@pytest.mark.slow
@pytest.mark.parametrize("arrivals,in_flight", [("closed", 16 * 8), ("batch", None)],
                         ids=["16-per-rank", "every-request"])
def test_a_plan_capped_below_eplbs_figure_keeps_eplbs_expert_balance_live(small_mixtral, arrivals, in_flight):
    reader, topology, (start, stop), eplb, default_plan = small_mixtral
    report = replay(reader, default_plan, topology, simulate_live(default_plan, reader, start, stop, arrivals=arrivals,
                                                                  concurrency=in_flight or 16).assignment)
    assert report.expert_imbalance_mean > eplb.expert_imbalance_mean  # the case: the default plan is over EPLB's
    locality = make_plan("locality", reader, topology, (0, start),
                         PlanOptions(caps=Caps(), seed=0, expert_cap_eplb_share=0.5), trace=str(reader.path)).plan
    live = simulate_live(locality, reader, start, stop, arrivals=arrivals, concurrency=in_flight or 16)
    report = replay(reader, locality, topology, live.assignment)
    assert report.expert_imbalance_mean <= eplb.expert_imbalance_mean
    assert report.expert_imbalance_worst <= eplb.expert_imbalance_worst
    assert report.attention_imbalance <= eplb.attention_imbalance + 0.05
    assert report.inter_node_bytes_per_token < eplb.inter_node_bytes_per_token


def test_a_domains_node_is_refused_only_when_none_of_its_ranks_fits():
    """Admissions and releases at random on 2 nodes x 4 GPUs under the lockstep caps: whenever a tagged
    request overflows, every rank of its domain's node was over one of the three caps (stream ceiling,
    tokens in flight, tokens admitted once every rank is busy), recomputed here from the grouper's
    books before the admission."""
    topology = Topology(2, 4, 1)
    spec = GroupingSpec(domain_nodes={"code": [1.0, 0.0], "math": [0.0, 1.0]}, caps=Caps(attention=1.10),
                        expected_decode_tokens=10.0, kv_bytes_per_token=1, bytes_per_send=1, top_k=1,
                        expert_prior=np.full((1, 8), 1 / 8), prior_tokens=0.0)
    g = Grouper(topology, spec, balance_streams=True)
    rng = np.random.default_rng(0)
    live, overflows = [], 0
    for i in range(2000):
        domain, w = ("code" if rng.random() < 0.7 else "math"), float(rng.integers(10, 400))
        loads, admitted, streams = g.loads.copy(), g.admitted.copy(), g.streams.copy()
        busy = len(g.live) >= topology.ranks
        rank = g.admit(f"r{i}", domain, w)
        live.append(f"r{i}")
        if g.last_choice.overflowed:
            overflows += 1
            total = streams.sum() + 1
            ceiling = max(-(-total // topology.ranks), int(STREAM_CAP * total / topology.ranks))
            mean = (loads.sum() + w) / topology.ranks
            admitted_mean = (admitted.sum() + w) / topology.ranks
            node = 0 if domain == "code" else 1
            share = 1.0 + ADMITTED_CAP_SHARE * 0.10
            for r in range(node * 4, node * 4 + 4):
                assert (streams[r] + 1 > ceiling or loads[r] + w > max(1.10 * mean, mean + w)
                        or (busy and admitted[r] + w > max(share * admitted_mean, admitted_mean + w))), (i, r, rank)
        while len(live) > 24 or (live and rng.random() < 0.4):
            g.finish(live.pop(int(rng.integers(0, len(live)))))
    assert overflows > 0  # the 70 % of code requests do not all fit on node 0
