"""The live admission the replay runs (locus/routing/grouping/live.py): the server's grouper driven by
the server's sequence of admissions and releases, a closed-loop client, untagged requests placed by
the prompt predictor, moves after prefill under the stream cap."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from locus.cli import main
from locus.errors import LocusError
from locus.routing.grouping.grouper import Grouper
from locus.routing.grouping.live import LiveRequests, live_grouper, run_live, simulate_live
from locus.routing.plan.caps import Caps
from locus.routing.plan.grouping_spec import GroupingSpec
from locus.routing.plan.placement import PlacementPlan
from locus.routing.plan.topology import Topology, parse_topology
from locus.routing.planners.planner import make_plan
from locus.routing.replay.assignment import assign_balanced
from locus.routing.replay.simulator import replay
from locus.traces.admissions import AdmissionLog
from locus.traces.format import RequestRecord
from locus.traces.reader import TraceReader
from tests.routing.planners.planner_fixtures import worded_trace

TOPOLOGY = Topology(2, 2, 2)  # 2 nodes x 2 GPUs


def toy_plan(cap: float = 1.10) -> PlacementPlan:
    spec = GroupingSpec(domain_nodes={"code": [1.0, 0.0], "math": [0.0, 1.0]}, caps=Caps(attention=cap),
                        expected_decode_tokens=8.0, kv_bytes_per_token=10, bytes_per_send=1, top_k=1,
                        expert_prior=np.full((1, 4), 0.25), prior_tokens=0.0)
    slots = np.array([[[0, 0], [1, 1], [2, 2], [3, 3]]])  # node 0 holds experts 0, 1; node 1 holds 2, 3
    return PlacementPlan("toy", 4, (0,), TOPOLOGY, slots, grouping=spec.to_dict())


def test_an_untagged_request_goes_to_the_cheapest_node_that_takes_it():
    g = live_grouper(toy_plan())
    assert g.balance_streams and not g.moves
    assert g.admit("a", None, 10, node_bytes=np.array([5.0, 1.0])) in (2, 3)
    assert g.stats.admitted_by_prediction == 1
    # a tag the plan knows wins over a prediction (a tag is the client's hint)
    assert g.admit("b", "code", 10, node_bytes=np.array([5.0, 1.0])) in (0, 1)
    # node 1 is the cheapest, but the stream cap (2 of 3 streams there already... ceil(3/4) = 1) closes it
    g.admit("c", None, 10, node_bytes=np.array([5.0, 1.0]))
    assert g.streams.tolist().count(1) == 3 and g.stats.overflowed == 0
    with pytest.raises(LocusError, match="one cost per node"):
        g.admit("d", None, 10, node_bytes=np.array([1.0, 2.0, 3.0]))


def drive_like_the_server(plan, requests: list[tuple[str, str, int]], seed: int = 0):
    """What rank 0's driver does: admit each arrival with the live grouper, release finished ones, in a
    random interleaving, logging both; returns (the ranks it chose, the records the trace would carry)."""
    rng = np.random.default_rng(seed)
    g, log = live_grouper(plan), AdmissionLog()
    ranks, live, todo = {}, [], list(requests)
    while todo or live:
        if todo and (not live or rng.random() < 0.6):
            rid, domain, charge = todo.pop(0)
            ranks[rid] = g.admit(rid, domain, charge, prompt_tokens=4)
            log.admit(rid, charge)
            live.append(rid)
        else:
            rid = live.pop(int(rng.integers(len(live))))
            g.finish(rid)
            log.release(rid)
    records = []
    for rid, domain, charge in requests:
        a = log.records[rid]
        records.append(RequestRecord(rid, domain, 4, charge - 1, ranks[rid], a.admitted, a.released, a.charge))
    return ranks, records


def test_recorded_arrivals_reproduce_what_the_server_assigned():
    rng = np.random.default_rng(1)
    requests = [(f"r{i}", ["code", "math", ""][int(rng.integers(3))], int(rng.integers(8, 40))) for i in range(60)]
    ranks, records = drive_like_the_server(toy_plan(), requests)
    live = LiveRequests.from_records(records)
    assert live.admitted is not None and live.charges.tolist() == [c for _, _, c in requests]
    got = run_live(live_grouper(toy_plan()), live, "recorded")
    assert got.ranks.tolist() == [ranks[rid] for rid, _, _ in requests]
    # the same requests in another order of arrival land elsewhere: the order is what is replayed
    closed = run_live(live_grouper(toy_plan()), live, "closed", concurrency=4)
    assert closed.ranks.tolist() != got.ranks.tolist()


def test_recorded_choices_of_one_request_share_its_admission():
    records = [RequestRecord("a#0", "code", 4, 9, 0, 0, 3, 30), RequestRecord("a#1", "code", 4, 7, 0, 0, 3, 30),
               RequestRecord("b", "math", 4, 9, 2, 1, 2, 14)]
    g = live_grouper(toy_plan())
    got = run_live(g, LiveRequests.from_records(records), "recorded")
    assert got.ranks[0] == got.ranks[1] and got.ranks[0] // 2 == 0 and got.ranks[2] // 2 == 1
    assert not g.live  # every admission released


def test_a_closed_loop_of_one_request_lets_every_tag_choose_its_node():
    records = [RequestRecord(f"r{i}", "code" if i % 3 else "math", 4, 12) for i in range(30)]
    got = run_live(live_grouper(toy_plan()), LiveRequests.from_records(records), "closed", concurrency=1)
    assert [r // 2 for r in got.ranks] == [0 if i % 3 else 1 for i in range(30)]
    # everything in flight at once: the stream cap deals the requests over the ranks in turn
    batch = run_live(live_grouper(toy_plan()), LiveRequests.from_records(records), "batch")
    assert np.bincount(batch.ranks, minlength=4).tolist() == [8, 8, 7, 7]
    with pytest.raises(LocusError, match="at least 1"):
        run_live(live_grouper(toy_plan()), LiveRequests.from_records(records), "closed", concurrency=0)


@pytest.mark.parametrize("delay, order", [
    # r1 on rank 1 makes its one token in step 0, seen by rank 0 after step 1; r0 on rank 0 its three in
    # steps 0-2; r2 arrives `delay` steps after r1's release and makes its token in that step
    (0, ["+r0", "+r1", "-r1", "+r2", "-r0", "-r2"]),  # r2: step 2, seen after step 3 (rank 1)
    (2, ["+r0", "+r1", "-r1", "-r0", "+r2", "-r2"]),  # r2 arrives at step 4, after r0's release (step 3)
])
def test_the_closed_loop_follows_the_lockstep_step_model(delay, order):
    records = [RequestRecord("r0", "code", 4, 4 + 2), RequestRecord("r1", "code", 4, 4), RequestRecord("r2", "math", 4, 4)]
    g = live_grouper(toy_plan())
    seen = []
    admit, finish = g.admit, g.finish
    g.admit = lambda rid, *a, **k: seen.append("+" + rid) or admit(rid, *a, **k)
    g.finish = lambda rid: seen.append("-" + rid) or finish(rid)
    got = run_live(g, LiveRequests.from_records(records), "closed", concurrency=2, client_delay=delay)
    assert got.ranks[:2].tolist() == [0, 1] and seen == order
    with pytest.raises(LocusError, match="steps >= 0"):
        run_live(live_grouper(toy_plan()), LiveRequests.from_records(records), "closed", client_delay=-1)


def test_a_move_after_prefill_respects_the_stream_cap_and_counts_its_kv():
    plan = toy_plan(cap=4.0)
    records = [RequestRecord(f"r{i}", "code", 5, 30) for i in range(4)]
    # every prefill says node 1 is 3 bytes a token cheaper: 3 * 8 decode tokens saved > 5 * 10 KV bytes? no
    cheap = np.tile([4.0, 1.0], (4, 1))
    stay = run_live(live_grouper(plan, moves=True), LiveRequests.from_records(records), "batch", prefill_bytes=cheap)
    assert stay.migrations == 0
    # 20 bytes a token cheaper: 160 saved > 50 of KV: the requests move, as far as the stream cap lets them
    pays = np.tile([21.0, 1.0], (4, 1))
    g = live_grouper(plan, moves=True)
    moved = run_live(g, LiveRequests.from_records(records), "batch", prefill_bytes=pays)
    assert moved.migrations == 2 and moved.migrated_kv_bytes == 2 * 5 * 10
    assert sorted(np.bincount(moved.decode_ranks, minlength=4).tolist()) == [1, 1, 1, 1]
    assert [r // 2 for r in moved.ranks] == [0, 0, 0, 0]  # admitted by their tag


@pytest.fixture(scope="module")
def worded(tmp_path_factory):
    path = worded_trace(tmp_path_factory.mktemp("worded") / "t", requests=480)
    reader = TraceReader(path)
    plan = make_plan("locality", reader, parse_topology("4x1", 16, 5), (0, 240)).plan
    return path, reader, plan


def test_an_untagged_prompt_goes_where_its_classified_domain_goes(worded):
    _, reader, plan = worded
    g = live_grouper(plan)
    tagged = live_grouper(plan)
    for i in range(240, 280):
        r = reader.requests[i]
        lo = int(reader.offsets[i])
        prompt = np.asarray(reader.token_ids[lo: lo + r.prompt_tokens])
        assert g.admit(r.id, None, r.tokens, r.prompt_tokens, prompt_ids=prompt) == tagged.admit(r.id, r.domain, r.tokens,
                                                                                                 r.prompt_tokens)
    assert g.stats.admitted_by_prediction == 40 and tagged.stats.admitted_by_domain == 40


def test_untagged_requests_placed_by_their_prompt_save_what_tags_save(worded):
    _, reader, plan = worded
    balanced = assign_balanced([r.tokens for r in reader.requests[240:]], 4, request_start=240)
    base = replay(reader, plan, plan.topology, balanced).inter_node_bytes_per_token
    for concurrency in (1, 4):
        tagged = simulate_live(plan, reader, 240, 480, "closed", concurrency)
        blind = simulate_live(plan, reader, 240, 480, "closed", concurrency, untagged=True)
        none = simulate_live(plan, reader, 240, 480, "closed", concurrency, untagged=True, predictor="none")
        assert blind.predictor == "table" and blind.untagged == 240 and none.predictor == "none"
        got = {name: replay(reader, plan, plan.topology, s.assignment).inter_node_bytes_per_token
               for name, s in (("tagged", tagged), ("untagged", blind), ("least loaded", none))}
        assert got["untagged"] <= got["tagged"] + 0.02 * base, (concurrency, got, base)
        assert got["untagged"] < got["least loaded"], (concurrency, got)


def test_the_replay_cli_runs_the_live_admission(worded, tmp_path, capsys):
    path, _, plan = worded
    plan_path = tmp_path / "plan.json"
    plan.save(plan_path)
    out = tmp_path / "r.json"
    args = ["replay", str(path), "--plan", str(plan_path), "--assign", "grouper", "--requests", "0.5:1"]
    assert main([*args, "--untagged", "--concurrency", "4", "--json", str(out)]) == 0
    err = capsys.readouterr().err
    assert "closed loop, 4 in flight; 240 untagged, placed by the plan's prompt predictor" in err
    assert json.loads(out.read_text())["assignment"] == "grouper"
    assert main([*args, "--arrivals", "recorded"]) == 2
    assert "carry no recorded admissions" in capsys.readouterr().err
    assert main(["replay", str(path), "--plan", str(plan_path), "--untagged"]) == 2
    assert "--untagged applies to --assign grouper" in capsys.readouterr().err


def test_a_wrong_tag_costs_bytes_and_nothing_else(worded):
    _, reader, plan = worded
    requests = reader.requests[240:]
    swapped = {"code": "math", "math": "code", "chat": "general", "general": "chat"}
    wrong = [replace(r, domain=swapped[r.domain]) for r in requests]
    right = run_live(live_grouper(plan), LiveRequests.from_records(requests), "closed", 4, request_start=240)
    lied = run_live(live_grouper(plan), LiveRequests.from_records(wrong), "closed", 4, request_start=240)
    right_report, lied_report = (replay(reader, plan, plan.topology, a) for a in (right, lied))
    assert lied_report.inter_node_bytes_per_token > right_report.inter_node_bytes_per_token
    # the same balance: the caps do not care what the tag said
    assert lied_report.attention_imbalance <= 1.10 and right_report.attention_imbalance <= 1.10
    assert np.ptp(np.bincount(lied.ranks, minlength=4)) <= 8
