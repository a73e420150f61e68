"""The decode step-time model on toy placements small enough to time by hand (every figure below is
worked out in the comments): a replica that adds a weight read, a rank with twice the tokens, a
link-bound and a compute-bound step, two-batch overlap, and the decode step order it runs on."""

import numpy as np
import pytest

from locus.errors import LocusError
from locus.routing.plan.placement import PlacementPlan
from locus.routing.plan.topology import Topology
from locus.routing.replay.assignment import Assignment
from locus.routing.replay.hardware import FIGURES, parse_hardware
from locus.routing.replay.model_shape import parse_shape
from locus.routing.replay.simulator import decode_step_order, replay
from locus.traces.format import TraceMeta
from locus.traces.reader import TraceReader
from locus.traces.writer import TraceWriter

# The toy model: one layer, MoE, 4 experts, top-1, hidden 4, expert width 8, one head of 4, vocab 4, bf16.
#   expert weights 3 * 4 * 8 * 2 = 192 B; a token through an expert 6 * 4 * 8 = 192 FLOPs
#   dense weights: attention 4*4 + 2*4*4 + 4*4 = 64, router 4*4 = 16, lm_head 4*4 = 16: 96 params = 192 B,
#   192 FLOPs a token; KV cache 2 * 1 * 4 * 2 = 16 B a context token
SHAPE = parse_shape("toy", {
    "source": "hand-made", "hidden_size": 4, "moe_intermediate_size": 8, "num_hidden_layers": 1, "num_moe_layers": 1,
    "num_experts": 4, "top_k": 1, "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 4,
    "dense_intermediate_size": 0, "shared_intermediate_size": 0, "vocab_size": 4}, "test")
META = TraceMeta("toy", num_experts=4, top_k=1, moe_layers=(0,), hidden_size=4, dtype_bytes=2)  # a row: 8 B


def profile(**overrides) -> dict:
    """192 B/s memory: reading an expert's (or the dense) weights takes 1 s; 192 FLOP/s: a token through
    an expert (or the dense layers) 1 s; a context token's KV 16/192 = 1/12 s. Links: 8 B/s, a row 1 s."""
    link = {"dispatch_bytes_per_s": 8, "combine_bytes_per_s": 8, "shared_by_node": False, "message_bytes": 0,
            "dispatch_collective_bytes": 0, "combine_collective_bytes": 0}
    doc = {"format": "locus-hardware", "version": 1, "name": "toy", "description": "by hand",
           "memory_bytes_per_s": 192, "tensor_flops_per_s": 192, "expert_efficiency": [[1, 1.0]],
           "expert_kernel_floor_s": 0, "inter_node": dict(link), "intra_node": dict(link),
           "dispatch_latency_s": 0, "combine_latency_s": 0, "step_overhead_s": 0, "step_link_bytes": 0,
           "host_overlap": "none"}
    for key, value in overrides.items():
        if "." in key:
            outer, inner = key.split(".")
            doc[outer][inner] = value
        else:
            doc[key] = value
    doc["sources"] = {k: "hand" for k in FIGURES}
    return parse_hardware(doc, "test")


def trace(tmp_path, requests, name="trace"):
    """requests: (prompt tokens, [expert id of each row]); every request is tagged `code`."""
    with TraceWriter(tmp_path / name, META) as writer:
        for i, (prompt, ids) in enumerate(requests):
            writer.add_request(f"r{i}", "code", prompt, np.asarray(ids, dtype=np.int64).reshape(-1, 1, 1))
    return TraceReader(tmp_path / name)


def plan(topology, slots):
    return PlacementPlan("toy", 4, (0,), topology, np.array([slots]), provenance={"planner": "hand"})


def run(reader, topology, slots, ranks, hardware, concurrency=16, overlap=False):
    report = replay(reader, plan(topology, slots), topology, Assignment("hand", 0, np.array(ranks)),
                    step_order="decode", concurrency=concurrency, hardware=hardware, model_shape=SHAPE,
                    two_batch_overlap=overlap)
    return report.step_time


def test_a_rank_with_twice_the_tokens_sets_the_step(tmp_path):
    # 1x2, every expert local to the rank its tokens come from: no exchange bytes, no latency.
    # Three requests of one prompt row and one decode row: step 0 runs the prompts, step 1 decodes.
    # Decode step: rank 0 has A (position 1: context 2) -> e0; rank 1 has B and C (contexts 2 + 2) -> e2 both.
    #   rank 0: KV 2/12 + dense max(1, 1 token) 1 + e0 max(1 read, 1 token) 1          = 2 + 1/6 s
    #   rank 1: KV 4/12 + dense max(1, 2 tokens) 2 + e2 max(1 read, 2 tokens) 2        = 4 + 1/3 s
    # The step costs its slowest rank: 4 1/3 s.
    reader = trace(tmp_path, [(1, [0, 0]), (1, [2, 2]), (1, [2, 2])])
    t = run(reader, Topology(1, 2, 2), [[0, 1], [2, 3]], [0, 1, 1], profile())
    assert t["steps"] == 1
    assert t["tpot_p50_ms"] == pytest.approx(1e3 * (4 + 1 / 3))
    assert t["split_ms"]["attention"] == pytest.approx(1e3 * (1 / 3 + 2))  # the slowest rank's
    assert t["split_ms"]["experts"] == pytest.approx(2e3)
    assert t["split_ms"]["exchange"] == 0
    # the same tokens spread one more evenly: rank 0 takes C too -> both ranks 2 tokens -> 4 1/3 on rank 0 now
    t = run(reader, Topology(1, 2, 2), [[0, 1], [2, 3]], [0, 1, 0], profile())
    # rank 0: A -> e0, C -> e2 on rank 1 (same node: tier 2, a row each way 1 s): KV 4/12 + dense 2 + e0 1
    assert t["split_ms"]["exchange"] == pytest.approx(2e3)  # dispatch 1 s + combine 1 s
    assert t["tpot_p50_ms"] == pytest.approx(1e3 * (1 / 3 + 2 + 1 + 2))


def test_a_replica_adds_a_weight_read(tmp_path):
    # Memory-bound experts: tensor 10x faster, so a token costs an expert 0.1 s and a read 1 s dominates.
    # Four requests on rank 0, their decode rows at positions 1 (odd) and 2 ... all routed to e0.
    # One slot of e0: one read for all four tokens -> 1 s. Two slots of e0 on rank 0: the rule splits the
    # tokens by position % 2 over them -> two reads -> 2 s.
    hw = profile(tensor_flops_per_s=1920)
    reader = trace(tmp_path, [(1, [3, 0]), (2, [3, 3, 0]), (1, [3, 0]), (2, [3, 3, 0])])
    one = run(reader, Topology(1, 2, 3), [[0, 1, 1], [2, 3, 3]], [0, 0, 0, 0], hw)
    two = run(reader, Topology(1, 2, 3), [[0, 0, 1], [2, 3, 3]], [0, 0, 0, 0], hw)
    assert one["steps"] == two["steps"] == 1
    assert one["split_ms"]["experts"] == pytest.approx(1e3)
    assert two["split_ms"]["experts"] == pytest.approx(2e3)
    assert two["tpot_p50_ms"] - one["tpot_p50_ms"] == pytest.approx(1e3)


def test_link_bound_step(tmp_path):
    # 2x1: rank 0 on node 0, rank 1 on node 1; e0 and e1 on rank 0, e2 and e3 on rank 1. Links: a row 1 s
    # between nodes (8 B at 8 B/s), latency 0.5 s a collective. Two requests on rank 0 decode to e2:
    #   dispatch: rank 0 sends 2 rows, rank 1 receives 2: 2 s + 0.5; combine the same back   = 5 s
    #   rank 0: KV (2 + 2)/12 + dense max(1, 2) = 2 1/3; rank 1: e2 max(1, 2 tokens) = 2      -> 2 1/3
    reader = trace(tmp_path, [(1, [0, 2]), (1, [0, 2])])
    hw = profile(dispatch_latency_s=0.5, combine_latency_s=0.5)
    t = run(reader, Topology(2, 1, 2), [[0, 1], [2, 3]], [0, 0], hw)
    assert t["split_ms"]["exchange"] == pytest.approx(5e3)
    assert t["tpot_p50_ms"] == pytest.approx(1e3 * (5 + 2 + 1 / 3))
    # bytes a message and a collective: dispatch + 8 B for the one message and 8 B the collective: 2 s more
    # each way in dispatch (rank 0 sends 16 + 8 + 8 = 32 B = 4 s), combine + 1 s (message only)
    t = run(reader, Topology(2, 1, 2), [[0, 1], [2, 3]], [0, 0],
            profile(**{"dispatch_latency_s": 0.5, "combine_latency_s": 0.5, "inter_node.message_bytes": 8,
                       "inter_node.dispatch_collective_bytes": 8}))
    assert t["split_ms"]["exchange"] == pytest.approx(1e3 * (4.5 + 3.5))
    # the inter-node bandwidth of the shaped link given at replay time: 16 B/s halves every row's time
    assert run(reader, Topology(2, 1, 2), [[0, 1], [2, 3]], [0, 0],
               hw.with_links(inter_bytes_per_s=16))["split_ms"]["exchange"] == pytest.approx(1e3 * (1.5 + 1.5))


def test_a_node_shared_link_adds_its_ranks_bytes(tmp_path):
    # 2x2: node 0 = ranks 0, 1. One request on rank 0 and one on rank 1 each decode to e2 on rank 2 (node 1).
    # A NIC a rank: each sends 1 row, rank 2 receives 1 (tier 1 goes to the proxy with the sender's local
    # index: rank 0 -> rank 2, rank 1 -> rank 3, which forwards over tier 2): 1 s a direction.
    # A link a node: node 0 sends 2 rows: 2 s a direction.
    reader = trace(tmp_path, [(1, [0, 2]), (1, [1, 2])])
    slots = [[0], [1], [2], [3]]
    own = run(reader, Topology(2, 2, 1), slots, [0, 1], profile())
    shared = run(reader, Topology(2, 2, 1), slots, [0, 1], profile(**{"inter_node.shared_by_node": True}))
    assert own["split_ms"]["exchange"] == pytest.approx(2e3)  # tier 2 (rank 3 -> 2) runs beside tier 1
    assert shared["split_ms"]["exchange"] == pytest.approx(4e3)


def test_compute_bound_step_and_the_efficiency_curve(tmp_path):
    # Five requests on rank 0 decode to e0 (local): 5 tokens on one expert, 5 s of FLOPs against 1 s of
    # weights: compute-bound. With the kernels at half the roofline from 4 tokens an expert up: 10 s;
    # and the floor once rank 0's experts run: + 0.25 s.
    reader = trace(tmp_path, [(1, [1, 0])] * 5)
    topo, slots = Topology(1, 2, 2), [[0, 1], [2, 3]]
    assert run(reader, topo, slots, [0] * 5, profile())["split_ms"]["experts"] == pytest.approx(5e3)
    curved = profile(expert_efficiency=[[1, 1.0], [4, 0.5]], expert_kernel_floor_s=0.25)
    assert run(reader, topo, slots, [0] * 5, curved)["split_ms"]["experts"] == pytest.approx(10.25e3)
    # two tokens: log-linear between 1 (1.0) and 4 (0.5): 0.75 -> max(1, 2) / 0.75 + 0.25
    two = trace(tmp_path, [(1, [1, 0])] * 2, name="two")
    assert run(two, topo, slots, [0, 0], curved)["split_ms"]["experts"] == pytest.approx(1e3 * (2 / 0.75 + 0.25))


def test_two_batch_overlap(tmp_path):
    # The link-bound toy of test_link_bound_step with 4 requests: lanes a and b take 2 tokens each.
    # A lane: compute rank 0: KV (2 + 2)/12 + dense 2 = 2 1/3; rank 1: e2 2 tokens = 2 -> c = 2 1/3;
    # exchange: 0.5 + 2 rows = 2.5 a direction, x = 5. Per layer c_a + max(x_a, c_b) + x_b = 2 1/3 + 5 + 5.
    # Serial: compute max(KV 8/12 + dense 4, e2 4) = 4 2/3, exchange 2 x (0.5 + 4) = 9 -> 13 2/3.
    reader = trace(tmp_path, [(1, [0, 2])] * 4)
    hw = profile(dispatch_latency_s=0.5, combine_latency_s=0.5)
    topo, slots = Topology(2, 1, 2), [[0, 1], [2, 3]]
    serial = run(reader, topo, slots, [0] * 4, hw)
    tbo = run(reader, topo, slots, [0] * 4, hw, overlap=True)
    assert serial["tpot_p50_ms"] == pytest.approx(1e3 * (4 + 2 / 3 + 9))
    assert tbo["tpot_p50_ms"] == pytest.approx(1e3 * (2 + 1 / 3 + 10))
    assert tbo["split_ms"]["overlap"] == pytest.approx(tbo["tpot_p50_ms"] - serial["tpot_p50_ms"])
    assert tbo["two_batch_overlap"] and not serial["two_batch_overlap"]


def test_host_overlap_per_collective_link_bound_and_host_bound(tmp_path):
    # The toy of test_link_bound_step (2x1, two requests on rank 0 decode to e2 on rank 1, 0.5 s a
    # collective) with 3 s of step overhead on a profile whose collectives run under the host work:
    # L = 1, so 1 + 2L = 3 collectives (control, dispatch, combine), o = 3 / 3 = 1 s before each.
    # Before the dispatch: o + rank 0's attention (KV 4/12 + dense 2) = 3 1/3; before the combine:
    # o + rank 1's experts (e2, 2 tokens) = 3. The control plane sends nothing (step_link_bytes 0).
    reader = trace(tmp_path, [(1, [0, 2]), (1, [0, 2])])
    topo, slots = Topology(2, 1, 2), [[0, 1], [2, 3]]
    hw = profile(dispatch_latency_s=0.5, combine_latency_s=0.5, step_overhead_s=3, host_overlap="per_collective")
    serial_hw = profile(dispatch_latency_s=0.5, combine_latency_s=0.5, step_overhead_s=3)
    # host-bound at 8 B/s (a row 1 s): dispatch 0.5 + 2 = 2.5 < 3 1/3, combine 2.5 < 3: the link is hidden,
    # the step is the host's: max(1, 0) + 3 1/3 + 3 = 7 1/3 (serial: 3 + 2 1/3 + 5 = 10 1/3)
    host = run(reader, topo, slots, [0, 0], hw)
    assert host["tpot_p50_ms"] == pytest.approx(1e3 * (7 + 1 / 3))
    assert run(reader, topo, slots, [0, 0], serial_hw)["tpot_p50_ms"] == pytest.approx(1e3 * (10 + 1 / 3))
    assert host["split_ms"]["exchange"] == pytest.approx(5e3)  # the serial parts, and what the overlap saved
    assert host["split_ms"]["overlap"] == pytest.approx(-3e3)
    # link-bound at 4 B/s (a row 2 s): dispatch and combine 0.5 + 4 = 4.5 each, longer than the host work
    # before them: max(1, 0) + 4.5 + 4.5 = 10 (serial: 3 + 2 1/3 + 9 = 14 1/3)
    link = run(reader, topo, slots, [0, 0], hw.with_links(inter_bytes_per_s=4))
    assert link["tpot_p50_ms"] == pytest.approx(10e3)
    # the control plane's bytes: 16 B at 4 B/s = 4 s, longer than its 1 s of host work: 4 + 4.5 + 4.5 = 13
    control = profile(dispatch_latency_s=0.5, combine_latency_s=0.5, step_overhead_s=3, host_overlap="per_collective",
                      step_link_bytes=16)
    assert run(reader, topo, slots, [0, 0], control.with_links(inter_bytes_per_s=4))["tpot_p50_ms"] == \
        pytest.approx(13e3)
    with pytest.raises(LocusError, match="two-batch overlap is modelled on a profile whose host_overlap is 'none'"):
        run(reader, topo, slots, [0, 0], hw, overlap=True)


def test_decode_step_order_by_hand():
    # Requests (prompt, tokens): r0 (2, 4), r1 (1, 1), r2 (1, 3); two in flight.
    # r0 admitted at step 0: prompt rows 0, 1 at step 0, decode rows 2, 3 at steps 1, 2; frees step 3.
    # r1 admitted at step 0: its one (prompt) row at step 0; no decode: frees step 1.
    # r2 admitted at step 1: prompt row at 1, decode rows at 2, 3.
    offsets = np.array([0, 4, 5, 8])
    rows, steps = decode_step_order(offsets, 0, 3, np.array([2, 1, 1]), concurrency=2)
    assert rows.tolist() == [0, 1, 4, 2, 5, 3, 6, 7]
    assert steps.tolist() == [0, 0, 0, 1, 1, 2, 2, 3]
    with pytest.raises(LocusError, match="at least one request in flight"):
        decode_step_order(offsets, 0, 3, np.array([2, 1, 1]), concurrency=0)


def test_decode_order_keeps_whole_replay_figures(tmp_path):
    reader = trace(tmp_path, [(1, [0, 2, 3]), (2, [1, 1, 2, 0]), (1, [3, 2])])
    topo = Topology(2, 1, 2)
    common = dict(plan=plan(topo, [[0, 1], [2, 3]]), topology=topo, assignment=Assignment("hand", 0, np.array([0, 1, 0])))
    a = replay(reader, **common, batch_tokens=2)
    b = replay(reader, **common, step_order="decode", concurrency=2, hardware=profile(), model_shape=SHAPE)
    for key in ("tokens", "routings", "inter_node_bytes", "intra_node_bytes", "locality", "expert_imbalance_mean",
                "attention_imbalance"):
        assert getattr(a, key) == getattr(b, key), key
    assert a.step_time is None and b.step_time["steps"] > 0


def test_step_model_needs_a_matching_shape(tmp_path):
    reader = trace(tmp_path, [(1, [0, 2])])
    topo = Topology(2, 1, 2)
    other = parse_shape("other", {**{f: getattr(SHAPE, f) for f in (
        "source", "moe_intermediate_size", "num_hidden_layers", "num_moe_layers", "num_experts", "top_k",
        "num_attention_heads", "num_key_value_heads", "head_dim", "dense_intermediate_size",
        "shared_intermediate_size", "vocab_size")}, "hidden_size": 8}, "test")
    with pytest.raises(LocusError, match="model shape 'other' has hidden_size 8, the trace 4"):
        replay(reader, plan(topo, [[0, 1], [2, 3]]), topo, Assignment("hand", 0, np.array([0])),
               hardware=profile(), model_shape=other)
    with pytest.raises(LocusError, match="both a hardware profile and a model shape"):
        replay(reader, plan(topo, [[0, 1], [2, 3]]), topo, Assignment("hand", 0, np.array([0])), hardware=profile())
