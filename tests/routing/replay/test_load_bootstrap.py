"""Per-request rank loads and the paired bootstrap of the expert imbalance: the loads against the hand-computed
toy of test_replay.py and against the replay on a random trace, the bootstrap on cases whose answer is
known."""

import numpy as np
import pytest

from locus.errors import LocusError
from locus.routing.plan.placement import PlacementPlan
from locus.routing.plan.topology import Topology
from locus.routing.replay.assignment import Assignment, assign_balanced
from locus.routing.replay.load_bootstrap import expert_imbalance, paired_bootstrap, request_rank_loads
from locus.routing.replay.simulator import replay
from locus.traces.format import TraceMeta
from locus.traces.reader import TraceReader
from locus.traces.writer import TraceWriter
from tests.routing.replay.test_replay import META, REQUEST_A, REQUEST_B, SLOTS, TOPOLOGY, toy_plan, write_trace


def test_toy_loads_by_hand(tmp_path):
    reader = write_trace(tmp_path / "trace", META, [REQUEST_A, REQUEST_B])
    loads = request_rank_loads(reader, toy_plan(), Assignment("hand", 0, np.array([1, 2])))
    # test_replay.py's destinations: A0 [1, 2, 2], A1 [0, 3]; B0 [0, 3, 2], B1 [1, 1, 3], B2 [0, 1, 2]
    assert loads.shape == (2, 1, 4) and loads.dtype == np.int32
    assert loads[0, 0].tolist() == [1, 1, 2, 1]
    assert loads[1, 0].tolist() == [2, 3, 2, 2]
    assert expert_imbalance(loads) == pytest.approx(8 / 7)  # the replay's figure for the toy
    # each request's first rows only: A0 [1, 2, 2]; B0 [0, 3, 2], B1 [1, 1, 3]
    first = request_rank_loads(reader, toy_plan(), Assignment("hand", 0, np.array([1, 2])), first_rows=np.array([1, 2]))
    assert first[0, 0].tolist() == [0, 1, 2, 0] and first[1, 0].tolist() == [1, 2, 1, 2]
    with pytest.raises(LocusError, match="one count per request"):
        request_rank_loads(reader, toy_plan(), Assignment("hand", 0, np.array([1, 2])), first_rows=np.array([1]))


def test_loads_sum_to_the_replays_imbalance(tmp_path):
    rng = np.random.default_rng(3)
    topology = Topology(2, 2, 3)
    meta = TraceMeta("rand", num_experts=8, top_k=2, moe_layers=(1, 3, 5), hidden_size=4, dtype_bytes=2)
    with TraceWriter(tmp_path / "t", meta) as w:
        for i in range(40):
            n = int(rng.integers(1, 30))
            ids = np.stack([rng.choice(8, size=(3, 2), replace=False, p=None) for _ in range(n)])
            w.add_request(f"r{i}", "code", int(rng.integers(1, n + 1)), ids.astype(np.int64))
    reader = TraceReader(tmp_path / "t")
    slots = np.stack([rng.permutation(np.r_[np.arange(8), rng.integers(0, 8, 4)]).reshape(4, 3) for _ in range(3)])
    for rule in ("position", "node-aware"):
        plan = PlacementPlan("rand", 8, (1, 3, 5), topology, slots, provenance={"planner": "hand"}, dispatch=rule)
        start = 10  # a range, not the whole trace
        balanced = assign_balanced([r.tokens for r in reader.requests[start:]], 4, request_start=start)
        moved = Assignment("moved", start, balanced.ranks, (balanced.ranks + 1) % 4, split_at=np.full(30, 3))
        for assignment in (balanced, moved):
            loads = request_rank_loads(reader, plan, assignment)
            assert loads.shape == (30, 3, 4)
            assert loads.sum() == 3 * 2 * (reader.offsets[-1] - reader.offsets[start])  # every (layer, k) routing lands once
            assert expert_imbalance(loads) == pytest.approx(replay(reader, plan, topology, assignment).expert_imbalance_mean,
                                                            abs=1e-12)


def test_bootstrap_of_identical_sides_is_zero():
    loads = np.random.default_rng(0).integers(0, 9, size=(50, 2, 4)).astype(np.int32)
    d = paired_bootstrap(loads, loads, draws=200)
    assert (d.point, d.sd, d.low, d.high) == (0.0, 0.0, 0.0, 0.0) and d.requests == 50 and d.draws == 200


def test_bootstrap_separates_a_level_side_from_a_lumpy_one():
    """Side a: every request spreads its load evenly (imbalance 1 on any resample); side b: every request
    loads one rank, four requests a rank (imbalance 1 served, above 1 on almost every resample)."""
    Q, R = 32, 4
    level = np.full((Q, 1, R), 2, dtype=np.int32)
    lumpy = np.zeros((Q, 1, R), dtype=np.int32)
    lumpy[np.arange(Q), 0, np.arange(Q) % R] = 8
    d = paired_bootstrap(level, lumpy, draws=500, seed=1)
    assert d.point == 0.0 and d.a == d.b == 1.0
    assert d.sd > 0.05  # resamples of 8 requests a rank move the busiest rank by a lot
    again = paired_bootstrap(level, lumpy, draws=500, seed=1)
    assert again == d  # a seed gives the same interval
    assert d.low == pytest.approx(-1.959964 * d.sd) and d.high == pytest.approx(1.959964 * d.sd)


def test_bad_inputs_are_refused_by_name(tmp_path):
    a = np.ones((3, 1, 4), dtype=np.int32)
    with pytest.raises(LocusError, match="one shape"):
        paired_bootstrap(a, np.ones((2, 1, 4), dtype=np.int32))
    with pytest.raises(LocusError, match="at least one request"):
        paired_bootstrap(a[:0], a[:0])
    with pytest.raises(LocusError, match="at least one draw"):
        paired_bootstrap(a, a, draws=0)
    reader = write_trace(tmp_path / "trace", META, [REQUEST_A, REQUEST_B])
    with pytest.raises(LocusError, match="covers requests 0:3"):
        request_rank_loads(reader, toy_plan(), Assignment("hand", 0, np.array([1, 2, 0])))
    other_model = PlacementPlan("toy", 6, (2,), TOPOLOGY, np.array(SLOTS), provenance={"planner": "hand"})
    with pytest.raises(LocusError):
        request_rank_loads(reader, other_model, Assignment("hand", 0, np.array([1, 2])))


def test_a_trace_across_placement_epochs_is_refused(tmp_path):
    with TraceWriter(tmp_path / "e", META, with_epochs=True) as w:
        w.add_request("r0", "code", 1, np.asarray(REQUEST_A, dtype=np.int64), epochs=np.array([0, 1], dtype=np.int32))
    with pytest.raises(LocusError, match="placement epochs"):
        request_rank_loads(TraceReader(tmp_path / "e"), toy_plan(), Assignment("hand", 0, np.array([1])))
