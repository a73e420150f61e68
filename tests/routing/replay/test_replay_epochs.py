"""Replaying a trace recorded across live re-plans: every row is routed by the plan of its placement
epoch (`--plan embedded` or `--plans DIR`), and the report gives each epoch's tokens and bytes."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from locus.routing.plan.placement import PlacementPlan
from locus.routing.plan.topology import Topology
from locus.routing.planners.baselines import round_robin
from locus.routing.replay.assignment import assign_balanced
from locus.routing.replay.simulator import replay
from locus.traces.format import TraceMeta
from locus.traces.reader import TraceReader
from locus.traces.writer import TraceWriter

TOPO = Topology(2, 2, 3)


def plans() -> tuple[PlacementPlan, PlacementPlan]:
    a = round_robin(8, (0, 1), TOPO, model="toy")
    b = PlacementPlan("toy", 8, (0, 1), TOPO, np.array(a.slots)[:, [3, 2, 1, 0]], dispatch="position")
    a.dispatch = "position"
    return a, b


def write_trace(path, with_plans: bool = True):
    meta = TraceMeta(model="toy", num_experts=8, top_k=2, moe_layers=(0, 1), hidden_size=16)
    rng = np.random.default_rng(7)
    a, b = plans()
    with TraceWriter(path, meta, with_epochs=True) as w:
        if with_plans:
            w.add_plan(0, a.to_dict())
            w.add_plan(1, b.to_dict())
        for i in range(12):
            n = 5 + i % 4
            ids = np.argsort(rng.random((n, 2, 8)), axis=2)[:, :, :2].astype(np.int16)
            epochs = (np.arange(n) >= n // 2 if i % 3 else np.zeros(n)).astype(np.int32)  # switches mid-request
            w.add_request(f"r{i}", "code", 2, ids, epochs=epochs)
    return path


def per_epoch(report) -> dict[int, tuple]:
    return {e["epoch"]: (e["tokens"], e["inter_node_bytes"], e["intra_node_bytes"]) for e in report.epochs}


def test_each_row_is_routed_by_its_epochs_plan(tmp_path):
    reader = TraceReader(write_trace(tmp_path / "t"))
    a, b = plans()
    assign = assign_balanced(np.diff(reader.offsets), TOPO.ranks)
    only_a = per_epoch(replay(reader, a, TOPO, assign, epoch_plans={0: a, 1: a}))
    only_b = per_epoch(replay(reader, a, TOPO, assign, epoch_plans={0: b, 1: b}))
    mixed = replay(reader, a, TOPO, assign, epoch_plans={0: a, 1: b})
    assert per_epoch(mixed) == {0: only_a[0], 1: only_b[1]}
    assert only_a[1] != only_b[1]  # the plans differ where it shows
    assert mixed.inter_node_bytes == only_a[0][1] + only_b[1][1]
    assert replay(reader, a, TOPO, assign).inter_node_bytes == only_a[0][1] + only_a[1][1]


def locus(*args):
    return subprocess.run([sys.executable, "-m", "locus.cli", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.slow  # runs `locus replay` as a subprocess
def test_cli_plan_embedded_and_plans_dir(tmp_path):
    trace = write_trace(tmp_path / "t")
    a, b = plans()
    done = locus("replay", str(trace), "--plan", "embedded", "--json", str(tmp_path / "e.json"))
    assert done.returncode == 0, done.stderr
    embedded = json.loads((tmp_path / "e.json").read_text())
    (tmp_path / "plans").mkdir()
    a.save(tmp_path / "plans" / "epoch-0.json")
    b.save(tmp_path / "plans" / "epoch-1.json")
    done = locus("replay", str(trace), "--plan", str(tmp_path / "plans" / "epoch-0.json"), "--plans",
                 str(tmp_path / "plans"), "--json", str(tmp_path / "d.json"))
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "d.json").read_text())["epochs"] == embedded["epochs"]
    assert len(embedded["epochs"]) == 2 and "placement epochs" in locus("replay", str(trace), "--plan", "embedded").stdout
    one = locus("replay", str(trace), "--plan", str(tmp_path / "plans" / "epoch-0.json"))
    assert one.returncode == 0 and "2 placement epochs" in one.stderr  # a what-if: said, not refused


@pytest.mark.slow  # runs `locus replay` as a subprocess
@pytest.mark.parametrize("setup,message", [
    ("no-plans", "keeps no plans"), ("missing-epoch", "no plan for them"), ("empty-dir", "no epoch-<e>.json")])
def test_cli_refuses_what_cannot_be_replayed(tmp_path, setup, message):
    trace = write_trace(tmp_path / "t", with_plans=setup != "no-plans")
    folder = tmp_path / "plans"
    folder.mkdir()
    args = ["replay", str(trace), "--plan", "embedded"]
    if setup == "missing-epoch":
        plans()[0].save(folder / "epoch-0.json")
        args += ["--plans", str(folder)]
    elif setup == "empty-dir":
        args += ["--plans", str(folder)]
    done = locus(*args)
    assert done.returncode == 2 and message in done.stderr, done.stderr


@pytest.mark.slow  # runs `locus replay` as a subprocess
def test_a_trace_with_no_routed_token_says_so_instead_of_nan(tmp_path):
    """Issue 30, finding 8: a trace whose ids are all -1 printed `nan` locality."""
    meta = TraceMeta(model="toy", num_experts=8, top_k=2, moe_layers=(0, 1), hidden_size=16)
    with TraceWriter(tmp_path / "t", meta) as w:
        w.add_request("r", "code", 1, np.full((3, 2, 2), -1, dtype=np.int16))
    done = locus("replay", str(tmp_path / "t"), "--plan", "round_robin", "--topology", "2x2")
    assert done.returncode == 0, done.stderr
    assert "no token was routed" in done.stdout and "nan" not in done.stdout.split("locality")[1].splitlines()[0]



@pytest.mark.slow  # runs `locus replay` as a subprocess
@pytest.mark.parametrize("content, message", [
    ('{"format": "locus-placement"}'.encode("utf-16"), "not a plan file of an epoch ('utf-8' codec can't decode"),
    (b"[" * 100_000, "not a plan file of an epoch (JSON nested too deeply to read)"),
    (b"\x00\xff" * 64, "not a plan file of an epoch"),
    (None, "layer 0: slots lists 4 ranks, topology 1000000000x2 (3 slots/GPU) has 2000000000"),
], ids=["utf16", "deep", "garbage", "huge-topology"])
def test_a_corrupt_epoch_plan_is_one_line_naming_the_file(tmp_path, content, message):
    """Issue 41: `replay --plan embedded` with a corrupt epoch file gave a traceback (RecursionError;
    numpy allocating for the topology's word before reading the lists)."""
    trace = write_trace(tmp_path / "t")
    path = trace / "plans" / "epoch-1.json"
    if content is None:
        plan = json.loads(path.read_text())
        plan["topology"]["nodes"] = 10**9
        content = json.dumps(plan).encode()
    path.write_bytes(content)
    done = locus("replay", str(trace), "--plan", "embedded")
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert done.stderr.startswith(f"locus: error: {path}: ") and done.stderr.count("\n") == 1, done.stderr
