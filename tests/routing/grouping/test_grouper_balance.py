"""The live admission keeps the plan's balance (issue 54, item 3): planned on one half of a trace and
replayed on the other, the grouper a server runs keeps attention imbalance within EPLB with balanced
assignment's + 0.05 and expert imbalance at most EPLB's, with 16 requests in flight per rank and with
every request in flight, while it still saves inter-node bytes; and a rank back from being down takes
its share, not every request, though it was given no tokens while down."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from locus.cli import main
from locus.routing.grouping.live import live_grouper
from tests.routing.grouping.test_grouper_live import toy_plan
from tests.routing.planners.planner_fixtures import synth_trace

TOPOLOGY, RANKS, SLOTS = "2x4", 8, "6"
ATTENTION_MARGIN = 0.05  # the bound over EPLB-balanced's attention imbalance


@pytest.fixture(scope="module")
def planned(tmp_path_factory) -> tuple[Path, Path, Path]:
    """A skewed synthetic trace and the locality and EPLB plans of its first half."""
    base = tmp_path_factory.mktemp("balance")
    trace = synth_trace(base / "t", requests=320)
    plans = []
    for planner in ("locality", "eplb"):
        plan = base / f"{planner}.json"
        assert main(["plan", str(trace), "--topology", TOPOLOGY, "--slots", SLOTS, "--planner", planner,
                     "--requests", "0:0.5", "-o", str(plan)]) == 0
        plans.append(plan)
    return trace, plans[0], plans[1]


def replayed(trace: Path, plan: Path, out: Path, *assign: str) -> dict:
    """`locus replay`'s JSON report of the trace's second half."""
    assert main(["replay", str(trace), "--plan", str(plan), "--requests", "0.5:1.0", *assign, "--json", str(out)]) == 0
    return json.loads(out.read_text())


@pytest.mark.parametrize("arrivals", [("closed", "--concurrency", str(16 * RANKS)), ("batch",)],
                         ids=["16-per-rank", "all-in-flight"])
def test_the_live_grouper_keeps_eplbs_balance(planned, tmp_path, arrivals):
    trace, locality, eplb = planned
    base = replayed(trace, eplb, tmp_path / "eplb.json")
    grouped = replayed(trace, locality, tmp_path / "grouper.json", "--assign", "grouper", "--arrivals", *arrivals)
    assert grouped["assignment"] == "grouper" and base["assignment"] == "balanced"
    assert grouped["attention_imbalance"] <= base["attention_imbalance"] + ATTENTION_MARGIN
    assert grouped["expert_imbalance_mean"] <= base["expert_imbalance_mean"]
    assert grouped["inter_node_bytes"] < 0.5 * base["inter_node_bytes"]  # and keeps the plan's byte saving


def test_a_rank_back_from_down_takes_its_share_not_every_request():
    g = live_grouper(toy_plan())
    for i in range(40):  # rank 1 is down: the others take code's requests in turn
        g.admit(f"a{i}", "code", 10, unavailable=(1,))
        g.finish(f"a{i}")
    back = []
    for i in range(8):  # one at a time, so that only the tokens ever admitted tell the ranks apart
        back.append(g.admit(f"b{i}", "code", 10))
        g.finish(f"b{i}")
    assert back.count(1) <= 4  # its share, not all eight
