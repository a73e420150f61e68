"""Per-layer expert caps: a cap that cannot be met fails after the layers EPLB misses are searched, not after
every layer; `--expert-cap auto` plans each layer at the larger of the floor and EPLB's figure instead."""

import json

import numpy as np
import pytest

import locus.routing.planners.layer_pool as layer_pool
from locus.cli import main
from locus.errors import LocusError
from locus.routing.plan.caps import Caps
from locus.routing.plan.placement import load_plan
from locus.routing.plan.topology import Topology
from locus.routing.planners.expected_load import rank_loads
from locus.routing.planners.layer_caps import LayerCaps, layer_caps, parse_expert_cap, parse_expert_cap_mode
from locus.routing.planners.planner import PlanOptions, make_plan
from locus.routing.grouping.signatures import collect_signatures, group_demand
from locus.traces.metrics import max_over_mean
from locus.traces.reader import TraceReader

from tests.routing.planners.planner_fixtures import synth_trace


@pytest.fixture(scope="module")
def skewed(tmp_path_factory):
    return TraceReader(synth_trace(tmp_path_factory.mktemp("caps") / "t", requests=200, seed=3,
                                   layers=tuple(range(12))))


@pytest.fixture
def searched(monkeypatch):
    """The MoE indices the locality search places, in order."""
    calls = []
    place = layer_pool.place_layer

    def counting(demand, *args, **kwargs):
        calls.append(demand)
        return place(demand, *args, **kwargs)

    monkeypatch.setattr(layer_pool, "place_layer", counting)
    return calls


def test_an_unmeetable_cap_stops_at_the_first_layer_both_miss(skewed, searched):
    # No spare slot: EPLB cannot split a hot expert, and neither can the search, on any layer.
    with pytest.raises(LocusError) as err:
        make_plan("locality", skewed, Topology(2, 2, 8), (0, 100), PlanOptions(caps=Caps(expert=1.0)))
    text = str(err.value)
    assert "MoE layer 0: the expert-load cap 1.000 cannot be met with 8 slots per GPU" in text
    assert "EPLB misses it on 11 more layers too: 1 (" in text and "and 3 more" in text
    assert "--expert-cap auto" in text
    assert len(searched) == 1  # layer 0's search decided it; the other 11 layers were never searched


def test_the_layers_eplb_misses_are_searched_first():
    limits = LayerCaps(np.full(5, 1.1), np.zeros((5, 4, 2), dtype=np.int64), np.array([1.05, 1.2, 1.1, 1.3, 1.0]),
                       False, (1, 3, 5, 7, 9), 2)
    assert limits.search_order().tolist() == [1, 3, 0, 2, 4]
    assert limits.settle(2, 1.2) is False  # EPLB meets the cap: its placement, no error
    with pytest.raises(LocusError, match=r"MoE layer 7: the expert-load cap 1.100 cannot be met with 2 slots per "
                       r"GPU \(locality search reaches 1.150, EPLB 1.300\); EPLB misses it on 1 more layers too: "
                       r"3 \(1.200\); EPLB's worst layer reaches 1.300"):
        limits.settle(3, 1.15)
    with pytest.raises(LocusError, match=r"locality search reaches 1.10004, EPLB 1.300"):  # not "1.100"
        limits.settle(3, 1.10004)


def test_auto_keeps_the_lower_of_the_search_s_and_eplb_s_figure():
    limits = LayerCaps(np.full(3, 1.1), np.zeros((3, 4, 2), dtype=np.int64), np.array([1.2, 1.2, 1.05]), True,
                       (0, 1, 2), 2)
    assert limits.settle(0, 1.15) is True and limits.settle(1, 1.3) is False
    assert limits.caps.tolist() == [1.15, 1.2, 1.1]


def test_auto_plans_each_layer_at_the_larger_of_the_floor_and_eplb(skewed, tmp_path):
    topology = Topology(2, 2, 8)  # where the fixed cap 1.0 fails (above)
    result = make_plan("locality", skewed, topology, (0, 100),
                       PlanOptions(caps=Caps(expert=1.0), expert_cap_auto=True))
    chosen = result.plan.provenance["expert_cap_auto"]
    assert chosen["floor"] == 1.0 and len(chosen["layers"]) == 12
    assert result.summary.expert_caps == chosen
    # every layer under its own cap, on the planning grouping; and each cap is EPLB's figure there
    sig = collect_signatures(skewed, 0, 100)
    a = result.assignment
    decode = a.ranks if a.decode_ranks is None else a.decode_ranks
    demand = group_demand(sig, a.ranks // 2, decode // 2, 2)
    imbalance = max_over_mean(rank_loads(result.plan.slots, demand))
    caps = np.array(chosen["layers"])
    assert (imbalance <= caps + 1e-5).all()
    eplb_reach = layer_caps(demand, skewed.meta.moe_layers, topology, 1.0, auto=True).eplb_imbalance
    assert (caps >= 1.0).all() and (caps <= eplb_reach + 1e-5).all()
    assert (caps > 1.0).all()  # no spare slot: no layer is perfectly balanced
    assert "expert cap (auto, per layer)" in result.summary.format_table()


def test_auto_changes_nothing_where_every_layer_meets_the_floor(skewed):
    topology = Topology(2, 2, 10)
    fixed = make_plan("locality", skewed, topology, (0, 100), PlanOptions(caps=Caps(expert=1.3)))
    auto = make_plan("locality", skewed, topology, (0, 100), PlanOptions(caps=Caps(expert=1.3), expert_cap_auto=True))
    assert np.array_equal(fixed.plan.slots, auto.plan.slots)
    assert auto.plan.provenance["expert_cap_auto"]["layers"] == [1.3] * 12
    assert "floor 1.300 on every layer" in auto.summary.format_table()


@pytest.mark.parametrize("text, parsed", [
    ("1.2", (1.2, False)), ("auto", (1.10, True)), ("auto:1.05", (1.05, True)),
])
def test_expert_cap_flag(text, parsed):
    assert parse_expert_cap(text) == parsed


@pytest.mark.parametrize("text", ["automatic", "auto:x", "1.2:1.3", "", "tight"])
def test_a_bad_expert_cap_is_one_clear_error(text):
    with pytest.raises(LocusError, match="--expert-cap must be a number or auto"):
        parse_expert_cap(text)


def test_locus_plan_expert_cap_auto(skewed, tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", str(skewed.path), "--topology", "2x2", "--slots", "8", "--requests", "0:100",
                 "--expert-cap", "auto:1.0", "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "expert cap (auto, per layer)" in printed and "floor 1.000, above it on 12 of 12 layers" in printed
    plan = load_plan(out)
    assert len(plan.provenance["expert_cap_auto"]["layers"]) == 12
    assert json.loads(out.read_text())["provenance"]["caps"]["expert"] == 1.0  # the floor
    assert main(["plan", str(skewed.path), "--topology", "2x2", "--slots", "8", "--expert-cap", "auto:0.9",
                 "-o", str(tmp_path / "x.json")]) == 2
    assert "cap must be a number >= 1.0" in capsys.readouterr().err


@pytest.fixture(scope="module")
def deepseek_like(tmp_path_factory):
    """DeepSeek-V3's shape (58 MoE layers x 256 experts, top-8) on a few short requests."""
    return TraceReader(synth_trace(tmp_path_factory.mktemp("ds") / "t", requests=60, seed=1, experts=256, top_k=8,
                                   layers=tuple(range(58))))


def test_an_unmeetable_cap_at_256_gpus_is_reported_after_one_layer_search(deepseek_like, searched):
    # 32 x 8 GPUs with one spare slot each and a cap neither EPLB nor the search reaches on any layer. The
    # code before searched all 58 layers (seconds each at this size: minutes) before saying so. In this
    # process (workers=1), where `searched` sees every search (test_layer_pool.py has the pool's case).
    with pytest.raises(LocusError) as err:
        make_plan("locality", deepseek_like, Topology(32, 8, 2), (0, 60),
                  PlanOptions(caps=Caps(expert=1.02), workers=1))
    text = str(err.value)
    assert "MoE layer 0: the expert-load cap 1.020 cannot be met with 2 slots per GPU" in text
    assert "EPLB misses it on 57 more layers too" in text
    assert len(searched) == 1


@pytest.mark.parametrize("text, parsed", [
    ("eplb", (1.10, True, 0.5)), ("eplb:0.25", (1.10, True, 0.25)), ("auto:1.05", (1.05, True, None)),
    ("1.2", (1.2, False, None)),
])
def test_expert_cap_mode_flag(text, parsed):
    assert parse_expert_cap_mode(text) == parsed


@pytest.mark.parametrize("text, message", [
    ("eplb:1.5", "share of EPLB's slack must be in"), ("eplb:x", "must be a number or auto"),
    ("eplbx", "must be a number or auto"),
])
def test_a_bad_eplb_share_is_one_clear_error(text, message):
    with pytest.raises(LocusError, match=message):
        parse_expert_cap_mode(text)
    with pytest.raises(LocusError, match="--expert-cap"):  # the two-value parser refuses the mode by name
        parse_expert_cap(text)


def _planning_figures(reader, result, topology):
    """Each layer's expected max/mean rank load on the plan's planning grouping, and EPLB's there."""
    sig = collect_signatures(reader, 0, 100)
    a = result.assignment
    decode = a.ranks if a.decode_ranks is None else a.decode_ranks
    G = topology.gpus_per_node
    demand = group_demand(sig, a.ranks // G, decode // G, topology.nodes)
    eplb_reach = layer_caps(demand, reader.meta.moe_layers, topology, 1.1, auto=True).eplb_imbalance
    return max_over_mean(rank_loads(result.plan.slots, demand)), eplb_reach


def test_the_eplb_mode_plans_no_layer_above_eplbs_balance(skewed):
    topology = Topology(2, 2, 9)
    fixed = make_plan("locality", skewed, topology, (0, 100), PlanOptions())
    imbalance, eplb_reach = _planning_figures(skewed, fixed, topology)
    assert (imbalance > eplb_reach + 1e-3).any()  # the fixed 1.10 cap leaves a layer less balanced than EPLB
    result = make_plan("locality", skewed, topology, (0, 100), PlanOptions(expert_cap_eplb_share=0.5))
    imbalance, eplb_reach = _planning_figures(skewed, result, topology)
    chosen = result.plan.provenance["expert_cap_eplb"]
    assert chosen["share"] == 0.5 and chosen["ceiling"] == 1.10 and len(chosen["layers"]) == 12
    caps = np.array(chosen["layers"])
    assert (imbalance <= caps + 1e-5).all() and (imbalance <= eplb_reach + 1e-5).all()
    # searched at half EPLB's slack (at most 1.10); raised above it only to a figure EPLB does not beat
    target = np.minimum(1.10, 1 + 0.5 * (eplb_reach - 1))
    assert (caps <= np.maximum(target, eplb_reach) + 1e-5).all()


def test_the_eplb_mode_never_stops_on_the_cap(skewed):
    topology = Topology(2, 2, 8)  # no spare slot: the fixed 1.10 cannot be met (first test)
    with pytest.raises(LocusError, match="cannot be met"):
        make_plan("locality", skewed, topology, (0, 100), PlanOptions())
    result = make_plan("locality", skewed, topology, (0, 100), PlanOptions(expert_cap_eplb_share=0.5))
    imbalance, eplb_reach = _planning_figures(skewed, result, topology)
    assert (imbalance <= eplb_reach + 1e-5).all()


def test_locus_plan_expert_cap_eplb(skewed, tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", str(skewed.path), "--topology", "2x2", "--slots", "9", "--requests", "0:100",
                 "--expert-cap", "eplb:0.25", "-o", str(out)]) == 0
    chosen = load_plan(out).provenance["expert_cap_eplb"]
    assert chosen["share"] == 0.25 and len(chosen["layers"]) == 12
    # the summary says what each layer was planned at, as under auto
    printed = capsys.readouterr().out
    first = ", ".join(f"{i}: {c:.3f}" for i, c in enumerate(chosen["layers"][:8]))
    assert "expert cap (eplb, per layer)" in printed and f"kept (MoE index: cap) {first}, ..." in printed
    assert f"lowest {min(chosen['layers']):.3f}, highest {max(chosen['layers']):.3f}" in printed
