"""locus/routing/planners/group_alignment.py and `locus plan --align-groups`: every replica of an expert
group on one node, so a group-limited token reaches at most topk_group nodes; bad options refused."""

import json

import numpy as np
import pytest

from locus.cli import main
from locus.routing.expert_groups import ExpertGroups, group_figures
from locus.routing.plan.placement import load_plan
from locus.routing.plan.topology import Topology
from locus.routing.planners.group_alignment import assign_groups
from locus.routing.planners.planner import PlanOptions, make_plan
from locus.traces.format import TraceMeta
from locus.traces.reader import TraceReader
from locus.traces.writer import TraceWriter

from tests.routing.planners.planner_fixtures import synth_trace

E, GROUPS, TOPK_GROUP, TOP_K = 32, 8, 2, 4


def group_limited_trace(path, requests=160, seed=0):
    """32 experts in 8 groups of 4; every token's 4 experts lie within 2 groups (its domain's favourite and
    one other), as DeepSeek-V3's router picks them."""
    rng = np.random.default_rng(seed)
    domains = ("code", "math", "chat", "general")
    meta = TraceMeta("grouped", E, TOP_K, (1, 2, 3), hidden_size=32, dtype_bytes=2)
    with TraceWriter(path, meta) as writer:
        for i in range(requests):
            d = i % 4
            n = int(rng.integers(8, 24))
            ids = np.empty((n, 3, TOP_K), dtype=np.int16)
            for t in range(n):
                for l in range(3):
                    other = (2 * d + 1 + int(rng.integers(0, GROUPS - 1))) % GROUPS
                    pool = np.concatenate([np.arange(4) + 8 * d, np.arange(4) + 4 * other])  # groups 2d, other
                    ids[t, l] = rng.choice(pool, TOP_K, replace=False)
            writer.add_request(f"g{i:04d}", domains[d], n // 2, ids)
    return path


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    return group_limited_trace(tmp_path_factory.mktemp("groups") / "t")


def node_sets(plan):
    """Per layer, the set of nodes each expert's replicas lie on."""
    G, S = plan.topology.gpus_per_node, plan.topology.slots_per_gpu
    out = []
    for layer in np.asarray(plan.slots):
        nodes = {}
        for slot, e in enumerate(layer.ravel()):
            nodes.setdefault(int(e) // 4, set()).add(slot // S // G)
        out.append(nodes)
    return out


@pytest.mark.parametrize("topology", [Topology(2, 2, 10), Topology(4, 2, 5), Topology(4, 1, 9), Topology(8, 1, 5)])
def test_the_aligned_planner_never_splits_a_group(trace, topology):
    groups = ExpertGroups(E, GROUPS, TOPK_GROUP)
    reader = TraceReader(trace)
    options = PlanOptions(align_groups=groups, expert_cap_auto=True)
    plan = make_plan("locality", reader, topology, (0, 80), options).plan
    assert group_figures(plan.slots, groups, topology, TOP_K).split_groups == 0
    for layer in node_sets(plan):
        assert len(layer) == GROUPS and all(len(nodes) == 1 for nodes in layer.values())
    unaligned = make_plan("locality", reader, topology, (0, 80), PlanOptions(expert_cap_auto=True)).plan
    if topology.nodes > 2:  # the check can fail: the unaligned plan spreads groups over nodes
        assert group_figures(unaligned.slots, groups, topology, TOP_K).split_groups > 0


def test_nodes_per_token_never_exceed_topk_group_under_alignment(trace, tmp_path):
    aligned, spread = tmp_path / "aligned.json", tmp_path / "rr.json"
    flags = ["--topology", "8x1", "--slots", "5", "--requests", "0:0.5", "--expert-groups", "8", "--topk-group", "2"]
    assert main(["plan", str(trace), *flags, "--align-groups", "--expert-cap", "auto", "-o", str(aligned)]) == 0
    reports = {}
    for name, plan in (("aligned", str(aligned)), ("round_robin", "round_robin")):
        out = tmp_path / f"{name}.replay.json"
        extra = ["--topology", "8x1", "--slots", "5"] if plan == "round_robin" else []
        assert main(["replay", str(trace), "--plan", plan, *extra, "--requests", "0.5:1", "--expert-groups", "8",
                     "--topk-group", "2", "--json", str(out)]) == 0
        reports[name] = json.loads(out.read_text())
    counts = reports["aligned"]["remote_nodes"]
    assert max(i for i, c in enumerate(counts) if c) <= TOPK_GROUP  # remote nodes of a (token, layer)
    # every node holding any replica of any of a token's experts, own node included: at most topk_group
    plan = load_plan(aligned)
    holders = [[set() for _ in range(E)] for _ in plan.moe_layers]
    for l, layer in enumerate(np.asarray(plan.slots)):
        for rank, slots in enumerate(layer):
            for e in slots:
                holders[l][int(e)].add(rank)  # 8x1: a rank is a node
    ids = np.asarray(TraceReader(trace).expert_ids)
    reached = [len(set().union(*(holders[l][int(e)] for e in row))) for token in ids for l, row in enumerate(token)]
    assert max(reached) == TOPK_GROUP
    assert reports["aligned"]["expert_groups"]["split_groups"] == 0
    assert reports["aligned"]["expert_groups"]["rows_over_limit"] == 0  # the trace is group-limited
    assert reports["aligned"]["expert_groups"]["node_bound"] == TOPK_GROUP
    spread = reports["round_robin"]
    assert max(i for i, c in enumerate(spread["remote_nodes"]) if c) > TOPK_GROUP  # what alignment prevents
    assert spread["expert_groups"]["split_groups"] == 3 * GROUPS and spread["expert_groups"]["node_bound"] == TOP_K
    # the mean of the histogram is the node-deduplicated bytes' own count
    for r in reports.values():
        sends = sum(i * c for i, c in enumerate(r["remote_nodes"]))
        row = r["inter_node_bytes"] / max(sends, 1)
        assert row == 2 * 32 * 2 and sum(r["remote_nodes"]) == r["tokens"] * 3


def test_groups_go_where_their_demand_is_when_balance_allows():
    # node 0's requests use groups 2 and 3, node 1's groups 0 and 1; all four groups equally loaded
    demand = np.array([[0.0, 1.0, 5.0, 4.0], [5.0, 4.0, 1.0, 0.0]])
    assert assign_groups(demand, room=2, limit=10.0).tolist() == [1, 1, 0, 0]
    # node 0 wants the two heavy groups: together they would carry 8 of 12, over a limit of 6.5
    heavy = np.array([[4.0, 4.0, 0.0, 0.0], [0.0, 0.0, 2.0, 2.0]])
    node = assign_groups(heavy, room=2, limit=6.5)
    assert node[0] != node[1]
    assert assign_groups(heavy, room=2, limit=8.0).tolist() == [0, 0, 1, 1]


@pytest.mark.parametrize("args, message", [
    (["--align-groups"], "--align-groups needs the expert groups: the trace records none and its model 'toy' is not one"),
    (["--align-groups", "--expert-groups", "5"], "--expert-groups 5 does not divide the model's 32 experts"),
    (["--align-groups", "--expert-groups", "8", "--topk-group", "9"], "--topk-group must be in 1..8"),
    (["--align-groups", "--expert-groups", "2", "--topology", "4x1", "--slots", "9"],
     "2 groups of 16 experts do not fit 4 nodes of 9 slots (a node holds 0 whole groups)"),
    (["--align-groups", "--expert-groups", "4", "--topology", "8x1", "--slots", "4"],
     "4 groups of 8 experts do not fit 8 nodes of 4 slots"),
    (["--align-groups", "--expert-groups", "4", "--topology", "8x1", "--slots", "8"],
     "4 expert groups cannot cover 8 nodes"),
    (["--align-groups", "--expert-groups", "8", "--planner", "eplb"], "--align-groups applies to --planner locality"),
])
def test_bad_alignment_options_are_one_line_and_no_file(tmp_path, capsys, args, message):
    trace = synth_trace(tmp_path / "t", requests=40)  # model "toy", 32 experts
    out = tmp_path / "plan.json"
    topology = [] if "--topology" in args else ["--topology", "2x2", "--slots", "9"]
    assert main(["plan", str(trace), *topology, "-o", str(out), *args]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
    assert not out.exists()


def test_the_plan_records_its_groups_and_replay_prints_the_figures(trace, tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", str(trace), "--topology", "4x1", "--slots", "9", "--expert-groups", "8", "--topk-group",
                 "2", "--align-groups", "--expert-cap", "auto", "-o", str(out)]) == 0
    assert "0 of 24 (layer, group) split across nodes" in capsys.readouterr().out
    assert load_plan(out).provenance["expert_groups"] == {"groups": 8, "topk_group": 2, "aligned": True}
    assert main(["replay", str(trace), "--plan", str(out), "--expert-groups", "8", "--topk-group", "2"]) == 0
    text = capsys.readouterr().out
    assert "expert groups split across nodes" in text and "remote nodes per token and layer" in text


def test_a_trace_that_is_not_group_limited_is_said_to_break_the_bound(tmp_path, capsys):
    trace = synth_trace(tmp_path / "t", requests=40)  # 32 experts, top-2, no groups in its routing
    out = tmp_path / "plan.json"
    assert main(["plan", str(trace), "--topology", "4x1", "--slots", "9", "--expert-groups", "8", "--topk-group", "1",
                 "--align-groups", "--expert-cap", "auto", "-o", str(out)]) == 0
    assert "not a bound on this trace" in capsys.readouterr().out
    report = tmp_path / "r.json"
    assert main(["replay", str(trace), "--plan", str(out), "--expert-groups", "8", "--topk-group", "1",
                 "--json", str(report)]) == 0
    groups = json.loads(report.read_text())["expert_groups"]
    assert groups["rows_over_limit"] > 0 and "not a bound here" in capsys.readouterr().out
