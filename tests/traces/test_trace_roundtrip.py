"""Writer -> reader round trips, chunked iteration, and the writer's all-or-nothing behaviour."""

from __future__ import annotations

import json

import numpy as np
import pytest
from trace_fixtures import random_rows, tiny_meta, write_tiny_trace

from locus.traces.format import RequestRecord, TraceFormatError, TraceMeta
from locus.traces.reader import TraceReader
from locus.traces.writer import TraceWriter


def test_round_trip_is_exact(tmp_path):
    path = tmp_path / "t"
    meta, rows = write_tiny_trace(path, with_weights=True)
    r = TraceReader(path)
    assert r.meta == meta
    assert [q.id for q in r.requests] == ["req-0", "req-1", "req-2", "req-3"]
    assert [(q.prompt_tokens, q.tokens) for q in r.requests] == [(3, 5), (0, 2), (4, 4), (2, 7)]
    assert r.num_tokens == 18
    assert list(r.offsets) == [0, 5, 7, 11, 18]
    for i, (ids, weights) in enumerate(rows):
        np.testing.assert_array_equal(r.request_rows(i), ids)
        np.testing.assert_array_equal(r.expert_weights[r.offsets[i] : r.offsets[i + 1]], weights)
    assert r.expert_ids.dtype == np.int16 and isinstance(r.expert_ids, np.memmap)
    # Plain numpy reads the files too.
    loaded = np.load(path / "expert_ids.npy", mmap_mode="r")
    np.testing.assert_array_equal(loaded, np.concatenate([ids for ids, _ in rows]))
    assert np.load(path / "expert_weights.npy").dtype == np.float16


def test_an_aborted_request_is_marked_and_the_mark_is_optional(tmp_path):
    """Issue 55, item 3: `"aborted": true` marks a request that ended before finishing; it is written
    only when true, and a line without it reads as not aborted."""
    meta = tiny_meta()
    with TraceWriter(tmp_path / "t", meta) as w:
        w.add_request("cut", "chat", 2, random_rows(np.random.default_rng(0), 2, meta), aborted=True)
        w.add_request("whole", "chat", 1, random_rows(np.random.default_rng(1), 3, meta))
    lines = [json.loads(line) for line in (tmp_path / "t" / "requests.jsonl").read_text().splitlines()]
    assert lines[0]["aborted"] is True and "aborted" not in lines[1]
    assert [(r.id, r.aborted) for r in TraceReader(tmp_path / "t").requests] == [("cut", True), ("whole", False)]
    assert RequestRecord("x", "", 0, 1, aborted=True).to_json()["aborted"] is True


def test_meta_json_has_the_contract_fields(tmp_path):
    write_tiny_trace(tmp_path / "t")
    d = json.loads((tmp_path / "t" / "meta.json").read_text())
    assert d["format"] == "locus-trace" and d["version"] == 1
    assert d["moe_layers"] == [1, 3, 5] and d["dtype_bytes"] == 2
    assert TraceMeta.from_json(d) == tiny_meta()


def test_iter_requests_and_chunks(tmp_path):
    write_tiny_trace(tmp_path / "t")
    r = TraceReader(tmp_path / "t")
    got = [(q.id, rows.shape[0]) for q, rows in r.iter_requests(1, 3)]
    assert got == [("req-1", 2), ("req-2", 4)]
    chunks = list(r.iter_chunks(max_tokens=7))
    # 5+2 fit in 7; 4 alone (4+7 > 7); 7 alone.
    assert [(c.request_start, c.request_stop, c.row_start, c.expert_ids.shape[0]) for c in chunks] == [
        (0, 2, 0, 7), (2, 3, 7, 4), (3, 4, 11, 7)]
    # A request longer than the budget is a chunk of its own; every row is covered once.
    chunks = list(r.iter_chunks(max_tokens=3))
    assert [c.num_requests for c in chunks] == [1, 1, 1, 1]
    np.testing.assert_array_equal(np.concatenate([c.expert_ids for c in chunks]), r.expert_ids)
    assert [c.num_requests for c in r.iter_chunks(100, max_requests=3)] == [3, 1]
    assert [(c.request_start, c.request_stop) for c in r.iter_chunks(100, start=1, stop=3)] == [(1, 3)]
    # copy=True reads the same rows into fresh arrays instead of views of the mapping.
    for view, copy in zip(r.iter_chunks(7), r.iter_chunks(7, copy=True)):
        assert not isinstance(copy.expert_ids, np.memmap)
        np.testing.assert_array_equal(view.expert_ids, copy.expert_ids)
    np.testing.assert_array_equal(r.read_rows(3, 9), r.expert_ids[3:9])
    np.testing.assert_array_equal(r.read_rows(16, 99), r.expert_ids[16:])


def test_add_requests_batch_equals_one_by_one(tmp_path):
    meta = tiny_meta()
    rng = np.random.default_rng(3)
    ids = random_rows(rng, 9, meta)
    records = [RequestRecord("a", "chat", 2, 4), RequestRecord("b", "chat", 5, 5)]
    with TraceWriter(tmp_path / "batch", meta) as w:
        w.add_requests(records, ids)
    with TraceWriter(tmp_path / "single", meta) as w:
        w.add_request("a", "chat", 2, ids[:4])
        w.add_request("b", "chat", 5, ids[4:])
    for name in ("expert_ids.npy", "requests.jsonl", "meta.json"):
        assert (tmp_path / "batch" / name).read_bytes() == (tmp_path / "single" / name).read_bytes()


def test_empty_trace_round_trips(tmp_path):
    with TraceWriter(tmp_path / "t", tiny_meta()):
        pass
    r = TraceReader(tmp_path / "t")
    assert r.num_tokens == 0 and r.requests == [] and r.expert_ids.shape == (0, 3, 2)
    assert list(r.iter_chunks(10)) == []


def test_exception_leaves_no_trace(tmp_path):
    path = tmp_path / "t"
    with pytest.raises(RuntimeError):
        with TraceWriter(path, tiny_meta()) as w:
            w.add_request("a", "chat", 1, random_rows(np.random.default_rng(0), 3, tiny_meta()))
            raise RuntimeError("generator crashed")
    assert not path.exists()
    assert list(tmp_path.iterdir()) == []  # the staging directory is gone too


def test_existing_target_needs_overwrite(tmp_path):
    write_tiny_trace(tmp_path / "t")
    with pytest.raises(TraceFormatError, match="already exists"):
        TraceWriter(tmp_path / "t", tiny_meta())
    write_tiny_trace(tmp_path / "other", lengths=((1, 1),))
    with TraceWriter(tmp_path / "t", tiny_meta(), overwrite=True) as w:
        w.add_request("x", "chat", 0, np.tile(np.array([0, 1], dtype=np.int16), (2, 3, 1)))
    assert TraceReader(tmp_path / "t").num_tokens == 2
    (tmp_path / "notatrace").mkdir()
    (tmp_path / "notatrace" / "precious.txt").write_text("keep me")
    with pytest.raises(TraceFormatError, match="not a trace directory"):
        with TraceWriter(tmp_path / "notatrace", tiny_meta(), overwrite=True):
            pass
    assert (tmp_path / "notatrace" / "precious.txt").exists()


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda w, ids: w.add_request("a", "c", 9, ids), "prompt_tokens 9"),
        (lambda w, ids: w.add_request("a", "c", 0, ids[:, :2]), "shape"),
        (lambda w, ids: w.add_request("a", "c", 0, ids + 8), "expert ids must lie in -1..7"),
        (lambda w, ids: [w.add_request("a", "c", 0, ids), w.add_request("a", "c", 0, ids)], "duplicate request id"),
        (lambda w, ids: w.add_request("a", "c", 0, ids, np.zeros((4, 3, 2))), "with_weights=False"),
    ],
)
def test_writer_rejects_bad_input(tmp_path, call, message):
    ids = random_rows(np.random.default_rng(0), 4, tiny_meta())
    with pytest.raises(TraceFormatError, match=message):
        with TraceWriter(tmp_path / "t", tiny_meta()) as w:
            call(w, ids)
    assert not (tmp_path / "t").exists()


def test_writer_checks_weights_shape(tmp_path):
    ids = random_rows(np.random.default_rng(0), 4, tiny_meta())
    with pytest.raises(TraceFormatError, match="expert_weights has shape"):
        with TraceWriter(tmp_path / "t", tiny_meta(), with_weights=True) as w:
            w.add_request("a", "c", 0, ids, np.zeros((4, 3, 1)))


def test_meta_rejects_inconsistent_shapes():
    with pytest.raises(TraceFormatError, match="top_k"):
        TraceMeta("m", num_experts=4, top_k=5, moe_layers=(0,), hidden_size=8)
    with pytest.raises(TraceFormatError, match="strictly increasing"):
        TraceMeta("m", num_experts=4, top_k=1, moe_layers=(3, 1), hidden_size=8)
    with pytest.raises(TraceFormatError, match="num_experts"):
        TraceMeta("m", num_experts=40000, top_k=1, moe_layers=(0,), hidden_size=8)
