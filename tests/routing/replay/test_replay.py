"""Replay figures on a toy small enough to compute by hand (every number below is worked out in the
comments), plus request ranges and the reader glue."""

import numpy as np
import pytest

from locus.errors import LocusError
from locus.routing.replay import simulator as replay_module
from locus.routing.replay.assignment import Assignment
from locus.routing.plan.placement import PlacementPlan
from locus.routing.replay.simulator import count_expert_loads, parse_request_range, replay
from locus.routing.replay.metrics import LinkModel
from locus.routing.plan.topology import Topology
from locus.traces.format import TraceMeta
from locus.traces.reader import TraceReader
from locus.traces.writer import TraceWriter

# 2 nodes x 2 GPUs (node 0 = ranks 0, 1; node 1 = ranks 2, 3), 2 slots each, 6 experts, one MoE layer.
TOPOLOGY = Topology(2, 2, 2)
SLOTS = [[[0, 1], [2, 0], [3, 4], [5, 3]]]
# Replicas: e0 on ranks 0, 1 (both node 0); e1 rank 0; e2 rank 1; e3 ranks 2, 3 (both node 1);
# e4 rank 2; e5 rank 3.
META = TraceMeta("toy", num_experts=6, top_k=3, moe_layers=(3,), hidden_size=4, dtype_bytes=2)
# Bytes per send: 2 * hidden 4 * 2 bytes = 16.
REQUEST_A = [[[0, 3, 4]], [[1, 3, -1]]]  # runs on rank 1 (node 0)
REQUEST_B = [[[0, 5, 3]], [[0, 2, 5]], [[1, 2, 4]]]  # runs on rank 2 (node 1)
# Destinations by the dispatch rule (token: src rank, position):
#   A0 (1, 0): e0 on rank 1 itself -> 1; e3 remote [2, 3], 0 % 2 -> 2; e4 remote -> 2      => [1, 2, 2]
#   A1 (1, 1): e1 node 0's rank 0 -> 0; e3 remote [2, 3], 1 % 2 -> 3; -1 ignored          => [0, 3]
#   B0 (2, 0): e0 remote [0, 1], 0 % 2 -> 0; e5 node 1's rank 3 -> 3; e3 on rank 2 -> 2  => [0, 3, 2]
#   B1 (2, 1): e0 remote, 1 % 2 -> 1; e2 remote -> 1; e5 -> 3                             => [1, 1, 3]
#   B2 (2, 2): e1 remote -> 0; e2 remote -> 1; e4 on rank 2 -> 2                          => [0, 1, 2]
# Per token: distinct remote nodes / pairs off node / tier-2 destinations (distinct ranks whose local
# index differs from the source's: own-node peers, and remote ranks other than the proxy) and the
# pairs they carry / own-node pairs / own-rank pairs:
#   A0: {1} 1 / 2 / {2} 1, 2 / 1 / 1      A1: {1} 1 / 1 / {0} 1, 1 / 1 / 0
#   B0: {0} 1 / 1 / {3} 1, 1 / 2 / 1      B1: {0} 1 / 2 / {1, 3} 2, 3 / 1 / 0    B2: {0} 1 / 2 / {1} 1, 1 / 1 / 1
# Sums: 14 pairs; 5 inter sends (80 B), 8 off-node pairs (128 B); 6 intra sends (96 B), 8 intra pairs
# (128 B); 6 own-node pairs -> locality 6/14; 3 own-rank pairs -> 3/14.
# Rank loads: r0 {A1, B0, B2} 3, r1 {A0, B1, B1, B2} 4, r2 {A0, A0, B0, B2} 4, r3 {A1, B0, B1} 3:
#   mean 3.5, max 4 -> imbalance 8/7.
# Tokens per rank: [0, 2, 3, 0] -> mean 1.25, max 3 -> attention imbalance 2.4.
# Steps of 2 tokens: [A0, A1], [B0, B1], [B2].
#   step loads [1, 1, 2, 1] -> 2/1.25 = 1.6; [1, 2, 1, 2] -> 2/1.5 = 4/3; [1, 1, 1, 0] -> 1/0.75 = 4/3.
#   step tokens [0, 2, 0, 0], [0, 0, 2, 0], [0, 0, 1, 0] -> attention imbalance 4 in each.
# Link model chosen so one send takes 1 s between nodes (16 B at 16 B/s), 0.5 s within, latency 0.1 s:
#   step 1: rank 1 sends 2 inter (2 s), 2 intra (1 s)   -> 0.2 + 2 = 2.2 s
#   step 2: rank 2 sends 2 inter (2 s), 3 intra (1.5 s) -> 2.2 s
#   step 3: rank 2 sends 1 inter (1 s), 1 intra (0.5 s) -> 1.2 s;  total 5.6 s
LINKS = LinkModel(inter_gbps=16e-9, intra_gbps=32e-9, latency_us=1e5)


def write_trace(path, meta, requests):
    with TraceWriter(path, meta) as writer:
        for i, rows in enumerate(requests):
            writer.add_request(f"r{i}", "code", 1, np.asarray(rows, dtype=np.int64))
    return TraceReader(path)


def toy_plan():
    return PlacementPlan("toy", 6, (3,), TOPOLOGY, np.array(SLOTS), provenance={"planner": "hand"})


def test_hand_computed_toy(tmp_path):
    reader = write_trace(tmp_path / "trace", META, [REQUEST_A, REQUEST_B])
    report = replay(reader, toy_plan(), TOPOLOGY, Assignment("hand", 0, np.array([1, 2])),
                    batch_tokens=2, links=LINKS)
    assert (report.tokens, report.steps, report.routings) == (5, 3, 14)
    assert (report.inter_node_bytes, report.inter_node_bytes_nodedup) == (80, 128)
    assert (report.intra_node_bytes, report.intra_node_bytes_nodedup) == (96, 128)
    assert report.inter_node_bytes_per_token == pytest.approx(16.0)
    assert report.locality == pytest.approx(6 / 14) and report.own_rank_share == pytest.approx(3 / 14)
    assert report.expert_imbalance_mean == pytest.approx(8 / 7) == report.expert_imbalance_worst
    assert report.expert_imbalance_worst_layer == 3 and report.layer_imbalance == [pytest.approx(8 / 7)]
    assert report.step_expert_imbalance_mean == pytest.approx((1.6 + 4 / 3 + 4 / 3) / 3)
    assert report.step_expert_imbalance_worst == pytest.approx(1.6)
    assert report.attention_imbalance == pytest.approx(2.4)
    assert report.step_attention_imbalance_mean == pytest.approx(4.0) == report.step_attention_imbalance_worst
    assert report.a2a_seconds == pytest.approx(5.6)
    assert report.a2a_ms_per_step == pytest.approx(5600 / 3)
    assert report.planner == "hand" and report.topology == "2x2" and report.requests == (0, 2)
    assert "inter-node bytes (node-dedup)" in report.format_table()
    assert report.to_dict()["requests"] == [0, 2]


def test_hand_computed_toy_in_rank_order(tmp_path):
    # batch 8 over 4 ranks: each rank takes 2 rows of its queue per step. Rank 1's queue is A0 A1,
    # rank 2's is B0 B1 B2: step 0 = A0 A1 B0 B1, step 1 = B2.
    #   step 0 loads [2, 3, 3, 3] -> 3 / 2.75 = 12/11; tokens [0, 2, 2, 0] -> 2 / 1 = 2;
    #     rank 1 sends 2 inter (2 s) + 2 intra (1 s), rank 2 sends 2 inter (2 s) + 3 intra (1.5 s) -> 2.2 s
    #   step 1 loads [1, 1, 1, 0] -> 4/3; tokens [0, 0, 1, 0] -> 4; rank 2 sends 1 inter + 1 intra -> 1.2 s
    reader = write_trace(tmp_path / "trace", META, [REQUEST_A, REQUEST_B])
    report = replay(reader, toy_plan(), TOPOLOGY, Assignment("hand", 0, np.array([1, 2])),
                    batch_tokens=8, links=LINKS, step_order="ranks")
    assert report.steps == 2 and report.step_order == "ranks"
    assert report.step_expert_imbalance_mean == pytest.approx((12 / 11 + 4 / 3) / 2)
    assert report.step_expert_imbalance_worst == pytest.approx(4 / 3)
    assert report.step_attention_imbalance_mean == pytest.approx(3.0)
    assert report.step_attention_imbalance_worst == pytest.approx(4.0)
    assert report.a2a_seconds == pytest.approx(3.4)
    # Whole-replay figures do not depend on the order.
    assert (report.inter_node_bytes, report.intra_node_bytes, report.routings) == (80, 96, 14)
    assert report.expert_imbalance_mean == pytest.approx(8 / 7)


def test_chunking_does_not_change_the_figures(tmp_path, monkeypatch):
    reader = write_trace(tmp_path / "trace", META, [REQUEST_A, REQUEST_B])
    args = (reader, toy_plan(), TOPOLOGY, Assignment("hand", 0, np.array([1, 2])))
    whole = replay(*args, batch_tokens=2, links=LINKS).to_dict()
    ranked = replay(*args, batch_tokens=8, links=LINKS, step_order="ranks").to_dict()
    monkeypatch.setattr(replay_module, "CHUNK_ROUTINGS", 3)  # one row per chunk
    assert replay(*args, batch_tokens=2, links=LINKS).to_dict() == whole
    assert replay(*args, batch_tokens=8, links=LINKS, step_order="ranks").to_dict() == ranked


def test_replays_only_the_assigned_range(tmp_path):
    reader = write_trace(tmp_path / "trace", META, [REQUEST_A, REQUEST_B])
    report = replay(reader, toy_plan(), TOPOLOGY, Assignment("hand", 1, np.array([2])), batch_tokens=2, links=LINKS)
    # Request B alone: B0, B1, B2 -> 3 inter sends (48 B), 9 pairs, loads [2, 3, 2, 2] -> 3 / 2.25.
    assert (report.tokens, report.routings, report.inter_node_bytes) == (3, 9, 48)
    assert report.expert_imbalance_mean == pytest.approx(4 / 3)
    assert count_expert_loads(reader, 1, 2).tolist() == [[2, 1, 2, 1, 1, 2]]


def test_replay_rejects_mismatches(tmp_path):
    reader = write_trace(tmp_path / "trace", META, [REQUEST_A, REQUEST_B])
    ok = Assignment("hand", 0, np.array([1, 2]))
    with pytest.raises(LocusError, match="laid out for 2x2"):
        replay(reader, toy_plan(), Topology(1, 4, 2), ok)
    with pytest.raises(LocusError, match="names rank 4"):
        replay(reader, toy_plan(), TOPOLOGY, Assignment("hand", 0, np.array([1, 4])))
    with pytest.raises(LocusError, match="covers requests 1:3"):
        replay(reader, toy_plan(), TOPOLOGY, Assignment("hand", 1, np.array([1, 2])))
    with pytest.raises(LocusError, match="plan places layer 5, which is not an MoE layer"):
        plan = PlacementPlan("toy", 6, (5,), TOPOLOGY, np.array(SLOTS))
        replay(reader, plan, TOPOLOGY, ok)
    with pytest.raises(LocusError, match="hold no tokens"):
        replay(reader, toy_plan(), TOPOLOGY, Assignment("hand", 1, np.array([], dtype=int)))


def test_plan_layers_are_matched_to_trace_layers_by_index(tmp_path):
    # Two MoE layers; the plan lists them in the opposite order. Layer 7 keeps everything on node 0.
    meta = TraceMeta("toy", num_experts=4, top_k=1, moe_layers=(2, 7), hidden_size=4, dtype_bytes=2)
    reader = write_trace(tmp_path / "trace", meta, [[[[0], [1]]]])
    slots = np.array([[[0, 1], [2, 3], [0, 1], [2, 3]],  # layer 7: source rank 0 holds e0 and e1
                      [[2, 3], [2, 3], [0, 1], [0, 1]]])  # layer 2: e0, e1 only on node 1
    plan = PlacementPlan("toy", 4, (7, 2), TOPOLOGY, slots)
    report = replay(reader, plan, TOPOLOGY, Assignment("hand", 0, np.array([0])))
    assert report.inter_node_bytes == 16  # layer 2's e0 crosses; layer 7's e1 stays on rank 0
    assert report.own_rank_share == pytest.approx(0.5)


@pytest.mark.parametrize(
    "spec, want",
    [(None, (0, 10)), (":", (0, 10)), ("0:0.5", (0, 5)), ("0.5:1", (5, 10)), ("0.5:", (5, 10)),
     ("2:7", (2, 7)), (":3", (0, 3)), ("-3:", (7, 10)), ("0.25:0.75", (2, 7))],
)
def test_request_ranges(spec, want):
    assert parse_request_range(spec, 10) == want


@pytest.mark.parametrize("spec", ["5", "1:2:3", "a:b", "0.5:1.5", "7:3", "0:11"])
def test_bad_request_ranges(spec):
    with pytest.raises(LocusError, match="request range"):
        parse_request_range(spec, 10)


@pytest.mark.parametrize("dispatch_format,combine_format,per_send", [
    ("model", "model", 16), ("mxfp8", "model", 5 + 8), ("mxint8", "model", 5 + 8), ("mxfp8", "mxfp8", 5 + 5)])
def test_payload_formats_set_the_bytes_of_each_send(tmp_path, dispatch_format, combine_format, per_send):
    """A row of hidden 4 is 8 bytes in the trace's 2-byte dtype and 4 + 1 in an MX format (4 elements,
    one E8M0 scale), whichever way it travels: the toy's 5 inter- and 6 intra-node sends cost that."""
    reader = write_trace(tmp_path / "trace", META, [REQUEST_A, REQUEST_B])
    report = replay(reader, toy_plan(), TOPOLOGY, Assignment("hand", 0, np.array([1, 2])), batch_tokens=2,
                    links=LINKS, dispatch_format=dispatch_format, combine_format=combine_format)
    assert (report.inter_node_bytes, report.intra_node_bytes) == (5 * per_send, 6 * per_send)
    assert (report.inter_node_bytes_nodedup, report.intra_node_bytes_nodedup) == (8 * per_send, 8 * per_send)
    assert (report.dispatch_format, report.combine_format) == (dispatch_format, combine_format)
    if dispatch_format != "model":
        assert f"{dispatch_format} / {combine_format}" in report.format_table()
    with pytest.raises(LocusError, match="dispatch format 'fp8'"):
        replay(reader, toy_plan(), TOPOLOGY, Assignment("hand", 0, np.array([1, 2])), dispatch_format="fp8")
