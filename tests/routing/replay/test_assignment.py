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
