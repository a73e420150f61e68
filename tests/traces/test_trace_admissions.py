"""What an expert-parallel recording adds to a trace for the live replay: the token id of every row
(token_ids.npy) and each request's admission (admitted / released / charge), merged from the ranks'
parts in admission order."""

from __future__ import annotations

import json

import numpy as np
import pytest

from locus.traces.admissions import AdmissionLog
from locus.traces.format import TraceFormatError, TraceMeta
from locus.traces.merge import merge_traces
from locus.traces.reader import TraceReader
from locus.traces.writer import TraceWriter

META = TraceMeta("toy", 4, 1, (1,), hidden_size=8, vocab_size=100)


def rows(n: int) -> np.ndarray:
    return (np.arange(n) % 4).reshape(n, 1, 1).astype(np.int16)


def write_part(path, requests, with_tokens=True):
    with TraceWriter(path, META, with_tokens=with_tokens) as w:
        for rid, n in requests:
            w.add_request(rid, "code", 1, rows(n), token_ids=np.arange(n) + 10 * len(rid) if with_tokens else None)


def test_token_ids_round_trip_and_are_checked(tmp_path):
    write_part(tmp_path / "t", [("a", 3), ("bb", 2)])
    reader = TraceReader(tmp_path / "t")
    assert reader.meta.vocab_size == 100
    assert reader.token_ids.tolist() == [10, 11, 12, 20, 21]
    with pytest.raises(TraceFormatError, match="needs the token id of every row"):
        with TraceWriter(tmp_path / "u", META, with_tokens=True) as w:
            w.add_request("a", "code", 1, rows(2))
    with pytest.raises(TraceFormatError, match="outside the vocabulary of 100"):
        with TraceWriter(tmp_path / "v", META, with_tokens=True) as w:
            w.add_request("a", "code", 1, rows(2), token_ids=np.array([5, 100]))
    np.save(tmp_path / "t" / "token_ids.npy", np.array([1, 2, 3], dtype=np.int32))
    with pytest.raises(TraceFormatError, match="token_ids.npy: 3 rows"):
        TraceReader(tmp_path / "t")


def test_the_merge_stamps_admissions_and_orders_by_them(tmp_path):
    write_part(tmp_path / "r0", [("a", 3), ("c", 2)])
    write_part(tmp_path / "r1", [("b", 2), ("d#0", 2), ("d#1", 3)])
    log = AdmissionLog()
    for event in ("+b", "+a", "-b", "+d", "+c", "-a", "-c", "-d"):
        (log.admit(event[1:], 7) if event[0] == "+" else log.release(event[1:]))
    merge_traces([tmp_path / "r0", tmp_path / "r1"], tmp_path / "m", ranks=[0, 3], admissions=log.records)
    reader = TraceReader(tmp_path / "m")
    got = [(r.id, r.rank, r.admitted, r.released, r.charge) for r in reader.requests]
    assert got == [("b", 3, 0, 2, 7), ("a", 0, 1, 5, 7), ("d#0", 3, 3, 7, 7), ("d#1", 3, 3, 7, 7), ("c", 0, 4, 6, 7)]
    # each request keeps its own rows and token ids
    assert reader.token_ids.tolist() == [10, 11, 10, 11, 12, 30, 31, 30, 31, 32, 10, 11]
    assert reader.request_rows(1).reshape(-1).tolist() == [0, 1, 2]
    # without admissions: source by source, as before, and no admission fields
    merge_traces([tmp_path / "r0", tmp_path / "r1"], tmp_path / "plain", ranks=[0, 3])
    plain = TraceReader(tmp_path / "plain")
    assert [r.id for r in plain.requests] == ["a", "c", "b", "d#0", "d#1"]
    assert plain.requests[0].admitted is None and "admitted" not in (tmp_path / "plain/requests.jsonl").read_text()


def test_a_part_without_token_ids_leaves_the_merge_without_them(tmp_path):
    write_part(tmp_path / "r0", [("a", 3)])
    write_part(tmp_path / "r1", [("b", 2)], with_tokens=False)
    merge_traces([tmp_path / "r0", tmp_path / "r1"], tmp_path / "m")
    assert TraceReader(tmp_path / "m").token_ids is None


@pytest.mark.parametrize("fields, message", [
    ({"admitted": -1}, "negative admitted -1"),
    ({"charge": "10"}, "charge"),
    ({"admitted": 4, "released": 4}, "released 4 is not after admitted 4"),
])
def test_bad_admission_fields_are_refused(tmp_path, fields, message):
    write_part(tmp_path / "t", [("a", 3)])
    path = tmp_path / "t" / "requests.jsonl"
    record = {**json.loads(path.read_text()), **fields}
    path.write_text(json.dumps(record) + "\n")
    with pytest.raises(TraceFormatError, match=message):
        TraceReader(tmp_path / "t")
