"""The --plan is read once, where `locus serve`'s CLI loads it (issue 58, item 3): a rank's `plan_for` reads
the file only when no loaded plan came with the setup (the launch's topology is still checked against it),
and one process's `load_plan_grouping` takes the loaded plan too."""

from __future__ import annotations

import pytest

from locus.engine.ep.ranks import launch
from locus.engine.ep.ranks.launch import EPSetup, plan_for
from locus.engine.checkpoint.loader import config_of
from locus.errors import LocusError
from locus.routing.plan.topology import Topology
from locus.routing.planners.baselines import round_robin


@pytest.fixture
def loads(monkeypatch):
    paths = []
    real = launch.load_plan
    monkeypatch.setattr(launch, "load_plan", lambda path: paths.append(path) or real(path))
    return paths


def test_a_rank_takes_the_loaded_plan_without_reading_the_file_again(tmp_path, loads):
    config = config_of("tiny")
    plan = round_robin(config.num_local_experts, config.moe_layers, Topology(1, 2, config.num_local_experts))
    path = tmp_path / "plan.json"
    plan.save(path)
    setup = EPSetup(1, 2, 2, 5.0, str(path), plan=plan)
    assert plan_for(setup, config) is plan and loads == []
    assert plan_for(EPSetup(1, 2, 2, 5.0, str(path)), config).slots.tolist() == plan.slots.tolist()
    assert loads == [str(path)]  # a setup made without the CLI (no loaded plan) reads it, once
    with pytest.raises(LocusError, match="the plan is for 1x2 ranks, but this launch has 2x1"):
        plan_for(EPSetup(1, 2, 1, 5.0, str(path), plan=plan), config)


def test_one_process_takes_the_loaded_plan_too(tmp_path, monkeypatch):
    from locus.engine.frontend.build import load_plan_grouping
    from locus.routing.plan import placement

    monkeypatch.setattr(placement, "load_plan", lambda path: pytest.fail(f"{path} read again"))
    config = config_of("tiny")
    plan = round_robin(config.num_local_experts, config.moe_layers, Topology(1, 1, config.num_local_experts))
    with pytest.raises(LocusError, match="no grouping section"):  # got as far as the plan's grouping: no read
        load_plan_grouping(str(tmp_path / "plan.json"), config, plan)
