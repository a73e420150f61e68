"""Traces recorded across placement epochs: epochs.npy (one epoch per row) and plans/epoch-<e>.json,
written, read back, merged, and refused when inconsistent."""

from __future__ import annotations

import numpy as np
import pytest
from trace_fixtures import random_rows, tiny_meta

from locus.traces.format import TraceFormatError
from locus.traces.merge import merge_traces
from locus.traces.reader import TraceReader
from locus.traces.writer import TraceWriter

PLAN_A, PLAN_B = {"format": "locus-placement", "tag": "a"}, {"format": "locus-placement", "tag": "b"}


def write(path, epochs_per_request, plans=None, rank_seed=0):
    meta = tiny_meta()
    rng = np.random.default_rng(rank_seed)
    with TraceWriter(path, meta, with_epochs=True) as w:
        for epoch, plan in (plans or {}).items():
            w.add_plan(epoch, plan)
        for i, epochs in enumerate(epochs_per_request):
            w.add_request(f"r{rank_seed}-{i}", "code", 1, random_rows(rng, len(epochs), meta), epochs=np.array(epochs))
    return path


def test_epochs_and_plans_round_trip_and_merge(tmp_path):
    a = write(tmp_path / "a", [[0, 0, 1], [1, 1]], {0: PLAN_A, 1: PLAN_B})
    b = write(tmp_path / "b", [[0, 1, 1, 1]], {0: PLAN_A, 1: PLAN_B}, rank_seed=1)
    reader = TraceReader(a)
    assert reader.epochs.tolist() == [0, 0, 1, 1, 1] and reader.plans() == {0: PLAN_A, 1: PLAN_B}
    merge_traces([a, b], tmp_path / "m", ranks=[0, 1])
    merged = TraceReader(tmp_path / "m")
    assert merged.epochs.tolist() == [0, 0, 1, 1, 1, 0, 1, 1, 1] and merged.plans() == {0: PLAN_A, 1: PLAN_B}
    assert [r.rank for r in merged.requests] == [0, 0, 1]


def test_a_part_without_epochs_merges_as_epoch_zero_and_conflicting_plans_are_refused(tmp_path):
    a = write(tmp_path / "a", [[2, 2]], {2: PLAN_B})
    meta = tiny_meta()
    with TraceWriter(tmp_path / "plain", meta) as w:
        w.add_request("p", "chat", 1, random_rows(np.random.default_rng(3), 3, meta))
    merge_traces([a, tmp_path / "plain"], tmp_path / "m")
    assert TraceReader(tmp_path / "m").epochs.tolist() == [2, 2, 0, 0, 0]
    c = write(tmp_path / "c", [[2]], {2: PLAN_A}, rank_seed=4)
    with pytest.raises(TraceFormatError, match="another plan for epoch 2"):
        merge_traces([a, c], tmp_path / "bad")


def test_bad_epochs_are_refused_by_the_writer_and_the_reader(tmp_path):
    meta = tiny_meta()
    rows = random_rows(np.random.default_rng(0), 3, meta)
    with TraceWriter(tmp_path / "w", meta, with_epochs=True) as w:
        with pytest.raises(TraceFormatError, match="one per row"):
            w.add_request("x", "code", 1, rows, epochs=np.array([0, 1]))
        with pytest.raises(TraceFormatError, match="needs the epoch"):
            w.add_request("x", "code", 1, rows)
        with pytest.raises(TraceFormatError, match="two different plans"):
            w.add_plan(0, PLAN_A)
            w.add_plan(0, PLAN_B)
        w.add_request("x", "code", 1, rows, epochs=np.array([0, 0, 1]))
    path = write(tmp_path / "t", [[0, 1]])
    np.save(path / "epochs.npy", np.array([0, 1, 2], dtype=np.int32))
    with pytest.raises(TraceFormatError, match="epochs.npy: 3 rows"):
        TraceReader(path)
    np.save(path / "epochs.npy", np.array([0, -1], dtype=np.int32))
    with pytest.raises(TraceFormatError, match="non-negative"):
        TraceReader(path)
    (path / "plans").mkdir()
    (path / "plans" / "epoch-x.json").write_text("{}")
    np.save(path / "epochs.npy", np.array([0, 1], dtype=np.int32))
    with pytest.raises(TraceFormatError, match="epoch-x.json"):
        TraceReader(path).plans()
