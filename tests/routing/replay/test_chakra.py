"""Chakra execution traces of a replay (`locus replay --chakra`): decoded back and checked against the
replay's byte figures and against a one-token-at-a-time reference of the two-tier dispatch."""

import re
from collections import Counter, defaultdict

import numpy as np
import pytest
from tests.routing.routing_reference import reference_destination, reference_steps

from locus.cli import main
from locus.errors import LocusError
from locus.routing.plan.placement import PlacementPlan
from locus.routing.plan.topology import Topology
from locus.routing.replay import chakra
from locus.routing.replay import chakra_et_pb2 as pb
from locus.routing.replay import simulator as replay_module
from locus.routing.replay.assignment import Assignment
from locus.routing.replay.chakra import PHASES, PairTraffic, read_chakra, write_chakra
from locus.routing.replay.simulator import replay
from locus.traces.format import TraceMeta
from locus.traces.reader import TraceReader
from locus.traces.writer import TraceWriter

# 2 nodes x 2 GPUs, 3 slots each (12 slots for 8 experts: replicas on both tiers), two MoE layers
# placed differently. Layer 3: e0 on ranks 0 and 2, e1 on 0 and 1, e2 on 1 and 3, e3 on 2 and 3.
TOPOLOGY = Topology(2, 2, 3)
SLOTS = [
    [[0, 1, 4], [1, 2, 5], [0, 3, 6], [2, 3, 7]],
    [[0, 7, 6], [1, 6, 5], [2, 3, 4], [4, 0, 1]],
]
LAYERS = (3, 5)
META = TraceMeta("toy", num_experts=8, top_k=3, moe_layers=LAYERS, hidden_size=4, dtype_bytes=2)
ROW_BYTES = 4 * 2
US_PER_PAIR = 0.7


def make_trace(path, requests=9, seed=0):
    rng = np.random.default_rng(seed)
    rows = []
    with TraceWriter(path, META) as writer:
        for i in range(requests):
            n = int(rng.integers(1, 7))
            ids = np.stack([rng.permutation(8)[:3] for _ in range(n * len(LAYERS))]).reshape(n, len(LAYERS), 3)
            ids[rng.random(ids.shape) < 0.1] = -1  # a few missing experts
            writer.add_request(f"r{i}", "code", 1, ids)
            rows.append(ids.tolist())
    return TraceReader(path), rows


def plan():
    return PlacementPlan("toy", 8, LAYERS, TOPOLOGY, np.array(SLOTS), provenance={"planner": "hand"})


def reference(requests, ranks, batch_tokens, order):
    """Rows per (step, layer, sender, receiver) of both tiers, and pairs computed per (step, layer, rank)."""
    G = TOPOLOGY.gpus_per_node
    tier1, tier2, loads = Counter(), Counter(), Counter()
    for step, rows in enumerate(reference_steps(requests, ranks, TOPOLOGY.ranks, batch_tokens, order)):
        for src, pos, row in rows:
            for l, experts in enumerate(row):
                dests = [reference_destination(SLOTS[l], G, src, e, pos) for e in experts if e >= 0]
                for d in dests:
                    loads[step, l, d] += 1
                for node in {d // G for d in dests} - {src // G}:  # once per remote node, to its proxy
                    tier1[step, l, src, node * G + src % G] += 1
                for d in {d for d in dests if d % G != src % G}:  # sent by d's node's rank with src's index
                    tier2[step, l, (d // G) * G + src % G, d] += 1
    return tier1, tier2, loads


def decode_tag(tag):
    R, L = TOPOLOGY.ranks, len(LAYERS)
    dst, tag = tag % R, tag // R
    src, tag = tag % R, tag // R
    phase, tag = tag % len(PHASES), tag // len(PHASES)
    return tag // L, tag % L, phase, src, dst  # step, layer, phase, src, dst


def attrs(node):
    return {a.name: getattr(a, a.WhichOneof("value")) for a in node.attr}


def run(tmp_path, order="trace", batch_tokens=8, us_per_pair=US_PER_PAIR):
    reader, requests = make_trace(tmp_path / "trace")
    ranks = [0, 3, 1, 2, 2, 0, 1, 3, 0]
    pairs = PairTraffic()
    report = replay(reader, plan(), TOPOLOGY, Assignment("hand", 0, np.array(ranks)), batch_tokens=batch_tokens,
                    step_order=order, pair_sink=pairs)
    traffic = pairs.finish()
    files = write_chakra(tmp_path / "et" / "toy", traffic, TOPOLOGY, LAYERS, ROW_BYTES, us_per_pair=us_per_pair)
    decoded = [read_chakra(path) for path, _ in files]
    return report, reference(requests, ranks, batch_tokens, order), files, decoded


@pytest.mark.parametrize("order, batch_tokens", [("trace", 8), ("ranks", 8), ("trace", 1000)])
def test_sent_bytes_match_the_replay_and_the_reference(tmp_path, order, batch_tokens):
    report, (tier1, tier2, _), files, decoded = run(tmp_path, order, batch_tokens)
    assert [path.name for path, _ in files] == [f"toy.{r}.et" for r in range(TOPOLOGY.ranks)]
    sent = {1: Counter(), 2: Counter()}  # tier -> (step, layer, phase, src, dst) -> bytes
    per_rank = {1: Counter(), 2: Counter()}
    for rank, (_, nodes) in enumerate(decoded):
        for node in nodes:
            if node.type != pb.COMM_SEND_NODE:
                continue
            a = attrs(node)
            step, layer, phase, src, dst = decode_tag(a["comm_tag"])
            assert (src, dst) == (a["comm_src"], a["comm_dst"]) and src == rank
            tier = 1 if PHASES[phase].startswith("tier1") else 2
            sent[tier][step, layer, phase, src, dst] += a["comm_size"]
            per_rank[tier][rank] += a["comm_size"]
    # Totals: the replay's own figures (dispatch and combine both counted there).
    assert sum(per_rank[1].values()) == report.inter_node_bytes
    assert sum(per_rank[2].values()) == report.intra_node_bytes
    assert report.inter_node_bytes > 0 and report.intra_node_bytes > 0
    # Per step, layer and (sender, receiver): dispatch as the reference, combine its mirror image.
    for tier, ref, (dispatch, combine) in ((1, tier1, (0, 3)), (2, tier2, (1, 2))):
        expect = Counter()
        for (step, layer, src, dst), rows in ref.items():
            expect[step, layer, dispatch, src, dst] += rows * ROW_BYTES
            expect[step, layer, combine, dst, src] += rows * ROW_BYTES
        assert sent[tier] == expect
        # per rank, per step: what each rank puts on its links
        got_rank_step, want_rank_step = Counter(), Counter()
        for (step, _, _, src, _), size in sent[tier].items():
            got_rank_step[src, step] += size
        for (step, _, _, src, _), size in expect.items():
            want_rank_step[src, step] += size
        assert got_rank_step == want_rank_step
    steps = {key[0] for tier in sent.values() for key in tier}
    assert steps <= set(range(report.steps))
    assert decoded[0][0].attr[-1].int32_val == report.steps  # "steps" in the metadata


def test_dispatch_and_combine_in_their_own_formats(tmp_path):
    """An MXFP8 dispatch (hidden 4: 4 + 1 bytes a row) and a combine in the model's dtype (8): the
    dispatch phases' messages and the combine phases' take their own row sizes, and sum to the replay's."""
    reader, _ = make_trace(tmp_path / "trace")
    pairs = PairTraffic()
    report = replay(reader, plan(), TOPOLOGY, Assignment("hand", 0, np.array([0, 3, 1, 2, 2, 0, 1, 3, 0])),
                    batch_tokens=8, pair_sink=pairs, dispatch_format="mxfp8")
    files = write_chakra(tmp_path / "et" / "toy", pairs.finish(), TOPOLOGY, LAYERS, (5, ROW_BYTES))
    sizes, totals = {"dispatch": set(), "combine": set()}, Counter()
    for path, _ in files:
        for node in read_chakra(path)[1]:
            if node.type == pb.COMM_SEND_NODE:
                a = attrs(node)
                phase = decode_tag(a["comm_tag"])[2]
                rows_bytes = 5 if phase < 2 else ROW_BYTES
                assert a["comm_size"] % rows_bytes == 0
                sizes["dispatch" if phase < 2 else "combine"].add(rows_bytes)
                totals[1 if PHASES[phase].startswith("tier1") else 2] += a["comm_size"]
    assert sizes == {"dispatch": {5}, "combine": {ROW_BYTES}}
    assert (totals[1], totals[2]) == (report.inter_node_bytes, report.intra_node_bytes)


def test_every_send_has_exactly_one_matching_receive(tmp_path):
    _, _, _, decoded = run(tmp_path)
    sends, recvs = {}, {}
    for rank, (_, nodes) in enumerate(decoded):
        for node in nodes:
            if node.type not in (pb.COMM_SEND_NODE, pb.COMM_RECV_NODE):
                continue
            a = attrs(node)
            assert a["is_cpu_op"] is False and a["comm_size"] > 0
            assert rank == (a["comm_src"] if node.type == pb.COMM_SEND_NODE else a["comm_dst"])
            assert a["comm_src"] != a["comm_dst"]
            side = sends if node.type == pb.COMM_SEND_NODE else recvs
            assert a["comm_tag"] not in side, "tags are unique per message"
            side[a["comm_tag"]] = (a["comm_src"], a["comm_dst"], a["comm_size"])
    assert sends and sends == recvs
    assert max(sends) <= chakra.MAX_TAG


def test_dependencies_point_back_in_phase_order(tmp_path):
    _, _, _, decoded = run(tmp_path)
    order = {"tier1_dispatch": 0, "tier2_dispatch": 1, "experts": 2, "tier2_combine": 3, "tier1_combine": 4}
    pattern = re.compile(r"step(\d+)_layer(\d+)_(tier[12]_dispatch|tier[12]_combine|experts)")

    def phase_key(node):
        step, layer, phase = pattern.match(node.name).groups()
        return int(step), LAYERS.index(int(layer)), order[phase]

    for _, nodes in decoded:
        assert [n.id for n in nodes] == list(range(len(nodes)))
        by_id = {n.id: n for n in nodes}
        for node in nodes:
            assert all(dep < node.id for dep in node.data_deps)
            for dep in node.data_deps:
                assert phase_key(by_id[dep]) < phase_key(node)
        # each phase waits on all of the previous non-empty phase: the first nodes have no deps, and
        # every later node depends on exactly the nodes of the phase before it
        groups = defaultdict(list)
        for node in nodes:
            groups[phase_key(node)].append(node.id)
        keys = sorted(groups)
        assert all(not by_id[i].data_deps for i in groups[keys[0]])
        for before, key in zip(keys, keys[1:]):
            for i in groups[key]:
                assert list(by_id[i].data_deps) == groups[before]


def test_compute_nodes_follow_the_pairs_model(tmp_path):
    _, (_, _, loads), _, decoded = run(tmp_path)
    seen = Counter()
    for rank, (_, nodes) in enumerate(decoded):
        for node in nodes:
            if node.type == pb.COMP_NODE:
                step, layer = re.match(r"step(\d+)_layer(\d+)_experts", node.name).groups()
                pairs = loads[int(step), LAYERS.index(int(layer)), rank]
                assert attrs(node) == {"is_cpu_op": False, "expert_pairs": pairs}
                assert node.duration_micros == int(pairs * US_PER_PAIR + 0.5)
                seen[int(step), LAYERS.index(int(layer)), rank] = pairs
    assert seen == +loads
    # Without a compute model there are no COMP nodes.
    (tmp_path / "plain").mkdir()
    _, _, _, plain = run(tmp_path / "plain", us_per_pair=0.0)
    assert not any(n.type == pb.COMP_NODE for _, nodes in plain for n in nodes)


def test_first_message_is_global_metadata(tmp_path):
    _, _, files, _ = run(tmp_path)
    data = files[2][0].read_bytes()
    size, pos = data[0], 1  # a varint below 128 is its own byte
    assert size < 128
    meta = pb.GlobalMetadata.FromString(data[pos : pos + size])
    assert meta.version == chakra.CHAKRA_VERSION
    assert {a.name: getattr(a, a.WhichOneof("value")) for a in meta.attr} == {
        "schema": chakra.SCHEMA, "producer": "locus replay", "rank": 2, "ranks": 4, "gpus_per_node": 2,
        "steps": read_chakra(files[2][0])[0].attr[-1].int32_val}
    # what follows are Nodes, the first one on this rank being a tier-1 send or receive
    first, _ = chakra._read_varint(data, pos + size)
    assert first > 0 and read_chakra(files[2][0])[1][0].type in (pb.COMM_SEND_NODE, pb.COMM_RECV_NODE)


def test_the_sink_does_not_change_the_figures_and_chunking_does_not_change_the_traces(tmp_path, monkeypatch):
    reader, _ = make_trace(tmp_path / "trace")
    args = (reader, plan(), TOPOLOGY, Assignment("hand", 0, np.array([0, 3, 1, 2, 2, 0, 1, 3, 0])))
    plain = replay(*args, batch_tokens=8).to_dict()
    whole = PairTraffic()
    assert replay(*args, batch_tokens=8, pair_sink=whole).to_dict() == plain
    monkeypatch.setattr(replay_module, "CHUNK_ROUTINGS", 7)  # one row per chunk: steps span chunks
    rowwise = PairTraffic()
    replay(*args, batch_tokens=8, pair_sink=rowwise)
    a, b = whole.finish(), rowwise.finish()
    for x, y in ((a.tier1, b.tier1), (a.tier2, b.tier2), (a.loads, b.loads)):
        assert np.array_equal(x, y)


@pytest.mark.parametrize("shape", [(1, 4), (4, 1)])
def test_one_tier_topologies(tmp_path, shape):
    topology = Topology(*shape, 2)
    reader, _ = make_trace(tmp_path / "trace")
    slots = np.array([[[0, 1], [2, 3], [4, 5], [6, 7]]] * 2)
    placement = PlacementPlan("toy", 8, LAYERS, topology, slots, provenance={"planner": "hand"})
    pairs = PairTraffic()
    report = replay(reader, placement, topology, Assignment("hand", 0, np.arange(9) % 4), batch_tokens=8,
                    pair_sink=pairs)
    files = write_chakra(tmp_path / "toy", pairs.finish(), topology, LAYERS, ROW_BYTES)
    sizes = Counter()
    for path, _ in files:
        for node in read_chakra(path)[1]:
            if node.type == pb.COMM_SEND_NODE:
                sizes[PHASES[decode_tag(attrs(node)["comm_tag"])[2]][:5]] += attrs(node)["comm_size"]
    assert (sizes["tier1"], sizes["tier2"]) == (report.inter_node_bytes, report.intra_node_bytes)
    assert (sizes["tier1"] == 0) == (shape[0] == 1) and (sizes["tier2"] == 0) == (shape[1] == 1)


def test_too_many_tags_is_refused(tmp_path, monkeypatch):
    reader, _ = make_trace(tmp_path / "trace")
    args = (reader, plan(), TOPOLOGY, Assignment("hand", 0, np.arange(9) % 4))
    pairs = PairTraffic()
    replay(*args, batch_tokens=8, pair_sink=pairs)  # 5 steps x 2 layers x 4 phases x 16 pairs = 640 tags
    monkeypatch.setattr(chakra, "MAX_TAG", 639)
    write_chakra(tmp_path / "toy", pairs.finish(), TOPOLOGY, LAYERS, ROW_BYTES)
    monkeypatch.setattr(chakra, "MAX_TAG", 638)
    with pytest.raises(LocusError, match="5 steps x 2 MoE layers on 4 ranks need more Chakra comm_tags"):
        write_chakra(tmp_path / "toy", pairs.finish(), TOPOLOGY, LAYERS, ROW_BYTES)
    with pytest.raises(LocusError, match="comm_tags"):  # the collector stops the replay itself
        replay(*args, batch_tokens=8, pair_sink=PairTraffic())


def test_cli_writes_one_file_per_rank(tmp_path, capsys):
    make_trace(tmp_path / "trace")
    prefix = tmp_path / "out" / "run"
    assert main(["replay", str(tmp_path / "trace"), "--plan", "round_robin", "--topology", "2x2", "--slots", "3",
                 "--batch-tokens", "8", "--chakra", str(prefix), "--chakra-us-per-pair", "0.5"]) == 0
    out = capsys.readouterr().out
    for rank in range(4):
        path = tmp_path / "out" / f"run.{rank}.et"
        assert path.exists() and str(path) in out
        assert any(n.type == pb.COMP_NODE for n in read_chakra(path)[1])
    assert main(["replay", str(tmp_path / "trace"), "--plan", "round_robin", "--topology", "2x2",
                 "--chakra-us-per-pair", "1"]) == 2
    assert "add --chakra OUT_PREFIX" in capsys.readouterr().err
