"""The router's assignment log (locus-route-log): written as events happen, read back with the last
admission of a retried request, matched to the ids engines give the requests they were told."""

import json

import pytest

from locus.traces.format import Admission, TraceFormatError
from locus.traces.route_log import RouteLogWriter, candidate_ids, is_route_log, read_route_log


def test_written_events_read_back_and_a_retry_keeps_the_last_admission(tmp_path):
    path = tmp_path / "route.jsonl"
    log = RouteLogWriter(path, {"plan": "p.json", "backends": []})
    log.admit("a", 2, "code", "tagged", 40, 8, 1)
    log.admit("b", 0, None, "least-loaded", 30, 10, 2)
    log.release("a")
    log.admit("b2", 1, "math", "predicted", 12, 4, 1)
    log.release("b")  # b failed on rank 0 ...
    log.admit("b", 3, None, "predicted", 30, 10, 2)  # ... and ran on rank 3
    assert is_route_log(path)  # readable while the router runs: every event is flushed
    log.close()
    read = read_route_log(path)
    assert read.header["plan"] == "p.json"
    assert list(read.requests) == ["a", "b2", "b"]
    assert [(r.rank, r.admitted, r.released) for r in read.requests.values()] == [(2, 0, 2), (1, 3, None), (3, 5, None)]
    assert read.requests["a"].admission == Admission(0, 2, 40)
    assert read.requests["b"].how == "predicted" and read.requests["b"].streams == 2


def test_trace_ids_match_the_ids_engines_give_requests(tmp_path):
    assert candidate_ids("cmpl-q1-0") == ["cmpl-q1-0", "q1-0", "q1"]
    assert candidate_ids("chatcmpl-q1#2") == ["chatcmpl-q1#2", "chatcmpl-q1", "q1"]
    path = tmp_path / "route.jsonl"
    log = RouteLogWriter(path, {})
    log.admit("q1", 1, None, "least-loaded", 1, 1, 1)
    log.admit("q1-0", 2, None, "least-loaded", 1, 1, 1)  # an id that itself ends in -0 is taken literally
    log.close()
    read = read_route_log(path)
    assert read.match("cmpl-q1-1").rank == 1 and read.match("cmpl-q1-0").rank == 2 and read.match("q1").rank == 1
    assert read.match("cmpl-q2-0") is None


@pytest.mark.parametrize("lines, message", [
    ([], "empty file"),
    (['{"format": "other"}'], "line 1 is not a locus-route-log header"),
    (['{"format": "locus-route-log", "version": 2}'], "version 2"),
    (["{}", "[]"], "line 1 is not"),
    (['{"format": "locus-route-log", "version": 1}', "nope"], "line 2: not JSON"),
    (['{"format": "locus-route-log", "version": 1}', '{"event": "admit", "seq": 0, "id": "a", "rank": -1, '
      '"how": "tagged", "charge": 1, "prompt_tokens": 1, "streams": 1}'], "line 2: an admission needs integers"),
    (['{"format": "locus-route-log", "version": 1}', '{"event": "admit", "seq": 0, "id": "a", "rank": 0, '
      '"how": "guessed", "charge": 1, "prompt_tokens": 1, "streams": 1}'], "\"how\" must be one of"),
    (['{"format": "locus-route-log", "version": 1}', '{"event": "release", "seq": 0, "id": "a"}'],
     "line 2: release of 'a', which was never admitted"),
    (['{"format": "locus-route-log", "version": 1}', '{"event": "move", "seq": 0, "id": "a"}'], "unknown event"),
])
def test_a_malformed_log_is_refused_naming_the_line(tmp_path, lines, message):
    path = tmp_path / "route.jsonl"
    path.write_text("\n".join(lines) + ("\n" if lines else ""))
    with pytest.raises(TraceFormatError, match=message):
        read_route_log(path)


def test_an_assignment_json_is_not_a_route_log(tmp_path):
    path = tmp_path / "a.json"
    path.write_text(json.dumps({"a": 1}))
    assert not is_route_log(path) and not is_route_log(tmp_path / "absent")


def test_trace_merge_stamps_the_router_s_admissions(tmp_path, capsys):
    """`locus trace merge --route-log`: the backends' traces as one, each request marked with the rank it
    ran on and carrying its logged admission, in admission order."""
    import numpy as np

    from locus.cli import main
    from locus.traces.reader import TraceReader
    from locus.traces.writer import TraceWriter
    from tests.traces.trace_fixtures import random_rows, tiny_meta

    meta, rng = tiny_meta(), np.random.default_rng(0)
    for rank, ids in enumerate((["cmpl-a-0", "cmpl-c-0"], ["chatcmpl-b"])):
        with TraceWriter(tmp_path / f"t{rank}", meta) as w:
            for rid in ids:
                w.add_request(rid, "code", 2, random_rows(rng, 4, meta))
    log = RouteLogWriter(tmp_path / "route.jsonl", {})
    log.admit("b", 1, None, "least-loaded", 9, 2, 1)
    log.admit("a", 0, "code", "tagged", 8, 2, 1)
    log.release("b")
    log.admit("c", 0, "code", "tagged", 7, 2, 1)
    log.release("a")
    log.close()
    out = tmp_path / "merged"
    assert main(["trace", "merge", str(tmp_path / "t0"), str(tmp_path / "t1"), "-o", str(out), "--route-log",
                 str(tmp_path / "route.jsonl")]) == 0
    assert "3 requests from 2 traces" in capsys.readouterr().out
    records = TraceReader(out).requests
    assert [(r.id, r.rank, r.admitted, r.released, r.charge) for r in records] == [
        ("chatcmpl-b", 1, 0, 2, 9), ("cmpl-a-0", 0, 1, 4, 8), ("cmpl-c-0", 0, 3, None, 7)]
    assert main(["trace", "merge", str(tmp_path / "t0"), "-o", str(out)]) == 2
    assert "exists (use --force" in capsys.readouterr().err
    assert main(["trace", "merge", str(tmp_path / "t0"), "-o", str(tmp_path / "m2"), "--ranks", "0,1"]) == 2
    assert "--ranks names 2 ranks for 1 source traces" in capsys.readouterr().err
    (tmp_path / "short.jsonl").write_text((tmp_path / "route.jsonl").read_text().splitlines()[0] + "\n")
    assert main(["trace", "merge", str(tmp_path / "t0"), "-o", str(tmp_path / "m3"), "--route-log",
                 str(tmp_path / "short.jsonl")]) == 2
    assert "the router logged no request for 'cmpl-a-0'" in capsys.readouterr().err
