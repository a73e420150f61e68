import json

import pytest

from locus.errors import LocusError
from locus.routing.replay.assignment import assign_balanced, assign_round_robin, load_assignment, save_assignment


def test_balanced_sends_each_request_to_the_least_loaded_rank_lowest_first():
    # loads after each: [5,0,0] [5,3,0] [5,3,4] -> next to rank 1 (3) -> [5,5,4] -> rank 2 -> [5,5,5]
    # -> tie: rank 0.
    a = assign_balanced([5, 3, 4, 2, 1, 7], 3, request_start=10)
    assert a.ranks.tolist() == [0, 1, 2, 1, 2, 0]
    assert (a.policy, a.request_start, a.request_stop) == ("balanced", 10, 16)


def test_round_robin():
    assert assign_round_robin(5, 2).ranks.tolist() == [0, 1, 0, 1, 0]


def test_file_round_trip_and_errors(tmp_path):
    a = assign_balanced([5, 3, 4], 2)
    path = tmp_path / "assign.json"
    save_assignment(a, ["a", "b", "c"], path)
    assert json.loads(path.read_text()) == {"a": 0, "b": 1, "c": 1}
    loaded = load_assignment(path, ["a", "b", "c"], num_ranks=2, request_start=4)
    assert loaded.ranks.tolist() == [0, 1, 1] and loaded.request_start == 4
    with pytest.raises(LocusError, match=r"request 'd' \(index 7\) has no rank"):
        load_assignment(path, ["a", "b", "c", "d"], num_ranks=2, request_start=4)
    with pytest.raises(LocusError, match=r"request 'b' has rank 1, expected an integer in 0..0"):
        load_assignment(path, ["a", "b"], num_ranks=1)
    path.write_text("[1, 2]")
    with pytest.raises(LocusError, match="must be a JSON object"):
        load_assignment(path, ["a"], num_ranks=2)
    path.write_text("{")
    with pytest.raises(LocusError, match="not valid JSON"):
        load_assignment(path, ["a"], num_ranks=2)
    with pytest.raises(LocusError, match="cannot read assignment"):
        load_assignment(tmp_path / "absent.json", ["a"], num_ranks=2)


def test_the_router_s_assignment_log_is_an_assignment(tmp_path):
    """`locus replay --assign FILE` reads `locus route`'s log: each trace request takes the rank its
    logged request last went to, matched through the engine's id for it (cmpl-<id>-<i>)."""
    from locus.traces.route_log import RouteLogWriter

    path = tmp_path / "route.jsonl"
    log = RouteLogWriter(path, {})
    log.admit("a", 1, "code", "tagged", 10, 5, 1)
    log.admit("b", 0, None, "least-loaded", 10, 5, 1)
    log.release("b")
    log.admit("b", 3, None, "least-loaded", 10, 5, 1)  # retried elsewhere
    log.close()
    loaded = load_assignment(path, ["cmpl-a-0", "cmpl-b-0", "b"], num_ranks=4, request_start=2)
    assert loaded.ranks.tolist() == [1, 3, 3] and loaded.policy == "route-log:route.jsonl"
    with pytest.raises(LocusError, match=r"logged no request for trace request 'c' \(index 5\)"):
        load_assignment(path, ["a", "b", "a", "c"], num_ranks=4, request_start=2)
    with pytest.raises(LocusError, match="went to rank 3, but the plan has 2 ranks"):
        load_assignment(path, ["b"], num_ranks=2)
