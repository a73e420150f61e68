"""Chakra execution traces of a replay, for ASTRA-sim: one file per rank, `PREFIX.<rank>.et`.

    replay(..., pair_sink=PairTraffic()) -> PairTraffic.finish() -> write_chakra(PREFIX, ...)

A file is a GlobalMetadata message followed by Node messages, each prefixed by its length as a
varint (Chakra's protolib encodeMessage / decodeMessage). For every replay step and MoE layer, in
order, rank r's file holds five phases, each waiting (data_deps) on the last non-empty phase before it
on that rank:

    tier-1 dispatch   COMM_SEND to the proxy of every remote node r's tokens go to, COMM_RECV from
                      every rank that made r its proxy (inter-node)
    tier-2 dispatch   COMM_SEND / COMM_RECV within r's node: own rows and rows r received as a proxy
    experts           COMP_NODE, only with a compute model (us_per_pair > 0)
    tier-2 combine    the tier-2 dispatch reversed: the same rows go back, receiver to sender
    tier-1 combine    the tier-1 dispatch reversed

Each (sender, receiver) pair with at least one row gets one COMM_SEND in the sender's file and one
COMM_RECV in the receiver's, both with the exact bytes (rows x hidden x dtype bytes): the dispatch is
not an equal-split all-to-all, so no COMM_COLL_NODE. The replay's inter_node_bytes are the sum of the
tier-1 sends (both directions), its intra_node_bytes the sum of the tier-2 sends.

Attributes, named and typed as ASTRA-sim's Chakra feeder reads them (src/feeder_v3/et_feeder_node_attr.h;
the older src/feeder reads the same names):
    is_cpu_op bool (false on every node: ASTRA-sim refuses a comm node on the CPU), comm_src int32,
    comm_dst int32, comm_size int64 (bytes), comm_tag int32.
comm_tag = (((step * L + layer) * 4 + phase) * R + src) * R + dst, phase 0..3 = tier-1 dispatch,
tier-2 dispatch, tier-2 combine, tier-1 combine; unique per message, identical on its send and its
receive, and below 2**31 (the feeder reads an int32) or write_chakra refuses.

Compute model (kept simple on purpose): a rank's expert time in a layer is us_per_pair times the
(token, expert) pairs it computes there, rounded to whole microseconds (duration_micros is integer).

chakra_et_pb2.py is generated from chakra_et.proto (field numbers and types as in Chakra's
schema/protobuf/et_def.proto). Regenerate it with protoc 26.1 (grpcio-tools 1.63.0, whose Python
code needs only protobuf >= 5.26), in a scratch virtualenv so the project's does not get grpcio-tools,
from the repository root:

    python -m venv /tmp/protoc-venv && /tmp/protoc-venv/bin/pip install grpcio-tools==1.63.0
    /tmp/protoc-venv/bin/python -m grpc_tools.protoc -I. --python_out=. locus/routing/replay/chakra_et.proto
    sed -i '1i # Generated from chakra_et.proto; regenerate with the commands in locus/routing/replay/chakra.py.' \\
        locus/routing/replay/chakra_et_pb2.py
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterator

import numpy as np

from locus.errors import LocusError
from locus.routing.plan.topology import Topology
from locus.routing.replay import chakra_et_pb2 as pb
from locus.routing.replay.metrics import PairChunk

CHAKRA_VERSION = "0.0.4"  # GlobalMetadata.version, as ASTRA-sim's example traces write it
SCHEMA = "1.0.2-chakra.0.0.4"  # the "schema" attribute Chakra's converters write
PHASES = ("tier1_dispatch", "tier2_dispatch", "tier2_combine", "tier1_combine")  # index = tag phase
MAX_TAG = 2**31 - 1


@dataclass(frozen=True)
class StepTraffic:
    """A replay's rows per (step, layer, sender, receiver), steps numbered 0..steps-1 like the report's.

    Shape legend: M entries with at least one row, S steps, L MoE layers, R ranks.
        tier1, tier2 [M, 5] int64 columns (step, layer, sender, receiver, rows), rows per direction
        loads [S, L, R] int64 (token, expert) pairs each rank computes
    """

    tier1: np.ndarray
    tier2: np.ndarray
    loads: np.ndarray

    @property
    def steps(self) -> int:
        return self.loads.shape[0]


class PairTraffic:
    """A `pair_sink` for replay(): keeps every chunk's PairChunk; finish() merges them per step.

    Refuses, as soon as the replay gets there, more steps than comm_tags can number (see write_chakra),
    rather than holding their rows first.
    """

    def __init__(self) -> None:
        self.chunks: list[PairChunk] = []
        self.busy: set[int] = set()  # step ids with tokens: explicit ids may leave gaps (no step there)

    def __call__(self, chunk: PairChunk) -> None:
        self.chunks.append(chunk)
        self.busy.update((chunk.first_step + np.flatnonzero(chunk.tokens.any(axis=1))).tolist())
        _check_tags(len(self.busy), *chunk.loads.shape[1:])

    def finish(self) -> StepTraffic:
        if not self.chunks:
            raise LocusError("no replay rows were collected for the Chakra traces")
        loads: dict[int, np.ndarray] = defaultdict(int)
        for c in self.chunks:  # a step may span two chunks: sum its parts
            for i in range(len(c.tokens)):
                loads[c.first_step + i] = loads[c.first_step + i] + c.loads[i]
        step_ids = np.array(sorted(self.busy), dtype=np.int64)  # like the report, only steps with tokens
        return StepTraffic(
            tier1=_merge([c.tier1 for c in self.chunks], step_ids),
            tier2=_merge([c.tier2 for c in self.chunks], step_ids),
            loads=np.stack([loads[int(s)] for s in step_ids]).astype(np.int64),
        )


def _merge(parts: list[np.ndarray], step_ids: np.ndarray) -> np.ndarray:
    """Sum rows of equal (step, layer, sender, receiver) over chunks; renumber steps densely."""
    table = np.concatenate(parts)
    keys, inverse = np.unique(table[:, :4], axis=0, return_inverse=True)
    rows = np.bincount(inverse.ravel(), weights=table[:, 4], minlength=len(keys)).astype(np.int64)
    keys[:, 0] = np.searchsorted(step_ids, keys[:, 0])  # a step with rows always has tokens
    return np.concatenate([keys, rows[:, None]], axis=1)


def write_chakra(prefix: str | Path, traffic: StepTraffic, topology: Topology, moe_layers,
                 row_bytes: int | tuple[int, int], us_per_pair: float = 0.0) -> list[tuple[Path, int]]:
    """Write `prefix.<rank>.et` for every rank; returns (path, nodes) per file.

    row_bytes: bytes of one row in one direction (hidden_size x dtype_bytes), or (dispatch, combine)
    where the two travel in different formats (formats.payload_row_bytes); moe_layers names the
    trace's MoE layers (node names use them); us_per_pair > 0 adds the expert COMP nodes.
    """
    R, S, L = topology.ranks, traffic.steps, len(moe_layers)
    if isinstance(row_bytes, int):
        row_bytes = (row_bytes, row_bytes)
    if not us_per_pair >= 0 or not np.isfinite(us_per_pair):
        raise LocusError(f"the Chakra compute model needs a non-negative time per pair, got {us_per_pair}")
    _check_tags(S, L, R)
    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    written = []
    for rank in range(R):
        path = prefix.parent / f"{prefix.name}.{rank}.et"
        with open(path, "wb") as out:
            _write_message(out, _metadata(rank, topology, S))
            count = 0
            for node in _rank_nodes(rank, traffic, topology, [int(x) for x in moe_layers], row_bytes, us_per_pair):
                _write_message(out, node)
                count += 1
        written.append((path, count))
    return written


def _check_tags(steps: int, layers: int, ranks: int) -> None:
    if steps * layers * len(PHASES) * ranks * ranks - 1 > MAX_TAG:
        raise LocusError(f"{steps} steps x {layers} MoE layers on {ranks} ranks need more Chakra comm_tags than an "
                         f"int32 holds; replay fewer requests or use a larger --batch-tokens")


def _metadata(rank: int, topology: Topology, steps: int) -> pb.GlobalMetadata:
    meta = pb.GlobalMetadata(version=CHAKRA_VERSION)
    meta.attr.add(name="schema", string_val=SCHEMA)
    meta.attr.add(name="producer", string_val="locus replay")
    for name, value in (("rank", rank), ("ranks", topology.ranks), ("gpus_per_node", topology.gpus_per_node),
                        ("steps", steps)):
        meta.attr.add(name=name, int32_val=value)
    return meta


class _RankRows:
    """One rank's entries of one tier, as sender and as receiver, found by (step, layer) in O(log M)."""

    def __init__(self, table: np.ndarray, rank: int, L: int):
        self.sent = self._by_step_layer(table[table[:, 2] == rank], L)
        self.received = self._by_step_layer(table[table[:, 3] == rank], L)

    @staticmethod
    def _by_step_layer(rows: np.ndarray, L: int):
        key = rows[:, 0] * L + rows[:, 1]
        order = np.argsort(key, kind="stable")
        return rows[order], key[order]

    @staticmethod
    def _at(part, key: int) -> np.ndarray:
        rows, keys = part
        return rows[np.searchsorted(keys, key, "left") : np.searchsorted(keys, key, "right")]

    def sent_at(self, key: int) -> np.ndarray:
        return self._at(self.sent, key)

    def received_at(self, key: int) -> np.ndarray:
        return self._at(self.received, key)


def _rank_nodes(rank: int, traffic: StepTraffic, topology: Topology, layer_ids: list[int],
                row_bytes: tuple[int, int], us_per_pair: float) -> Iterator[pb.Node]:
    """Rank `rank`'s nodes in file order, ids from 0; each phase depends on the previous non-empty one."""
    R, L = topology.ranks, len(layer_ids)
    tier1, tier2 = _RankRows(traffic.tier1, rank, L), _RankRows(traffic.tier2, rank, L)
    next_id, deps = 0, []
    for step in range(traffic.steps):
        for layer in range(L):
            key = step * L + layer
            sent1, recv1 = tier1.sent_at(key), tier1.received_at(key)
            sent2, recv2 = tier2.sent_at(key), tier2.received_at(key)
            # (phase, [(src, dst, rows)]) for sends and receives; a combine reverses its dispatch
            comm = {
                0: (_pairs(sent1, False), _pairs(recv1, False)),
                1: (_pairs(sent2, False), _pairs(recv2, False)),
                2: (_pairs(recv2, True), _pairs(sent2, True)),
                3: (_pairs(recv1, True), _pairs(sent1, True)),
            }
            name = f"step{step}_layer{layer_ids[layer]}"
            for phase in (0, 1, "experts", 2, 3):
                if phase == "experts":
                    nodes = _compute_nodes(name, int(traffic.loads[step, layer, rank]), us_per_pair)
                else:
                    sends, recvs = comm[phase]
                    size = row_bytes[0 if phase < 2 else 1]  # dispatch phases, then combine
                    tag_base = (key * len(PHASES) + phase) * R
                    nodes = [_comm_node(pb.COMM_SEND_NODE, f"{name}_{PHASES[phase]}", src, dst, rows * size,
                                        (tag_base + src) * R + dst) for src, dst, rows in sends]
                    nodes += [_comm_node(pb.COMM_RECV_NODE, f"{name}_{PHASES[phase]}", src, dst, rows * size,
                                         (tag_base + src) * R + dst) for src, dst, rows in recvs]
                if not nodes:
                    continue
                ids = list(range(next_id, next_id + len(nodes)))
                for node, node_id in zip(nodes, ids):
                    node.id = node_id
                    node.data_deps.extend(deps)
                    yield node
                next_id, deps = next_id + len(nodes), ids


def _pairs(rows: np.ndarray, reverse: bool) -> list[tuple[int, int, int]]:
    """[M, 5] entries -> (src, dst, rows) of each message; reverse: the combine, receiver to sender."""
    src, dst = (3, 2) if reverse else (2, 3)
    return [(int(r[src]), int(r[dst]), int(r[4])) for r in rows]


def _comm_node(kind: int, name: str, src: int, dst: int, size: int, tag: int) -> pb.Node:
    verb = "send" if kind == pb.COMM_SEND_NODE else "recv"
    node = pb.Node(name=f"{name}_{verb}_{src}_to_{dst}", type=kind)
    node.attr.add(name="is_cpu_op", bool_val=False)
    node.attr.add(name="comm_src", int32_val=src)
    node.attr.add(name="comm_dst", int32_val=dst)
    node.attr.add(name="comm_size", int64_val=size)
    node.attr.add(name="comm_tag", int32_val=tag)
    return node


def _compute_nodes(name: str, pairs: int, us_per_pair: float) -> list[pb.Node]:
    if us_per_pair <= 0 or pairs == 0:
        return []
    node = pb.Node(name=f"{name}_experts", type=pb.COMP_NODE, duration_micros=int(pairs * us_per_pair + 0.5))
    node.attr.add(name="is_cpu_op", bool_val=False)
    node.attr.add(name="expert_pairs", int64_val=pairs)  # not read by ASTRA-sim; for inspection
    return [node]


def _write_message(out: BinaryIO, message) -> None:
    """One message, prefixed by its length as a varint (Chakra's protolib encodeMessage)."""
    body = message.SerializeToString()
    size, prefix = len(body), bytearray()
    while size > 0x7F:
        prefix.append(0x80 | (size & 0x7F))
        size >>= 7
    prefix.append(size)
    out.write(bytes(prefix) + body)


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(data):
            raise LocusError("Chakra trace ends inside a length prefix")
        byte = data[pos]
        value |= (byte & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if not byte & 0x80:
            return value, pos


def read_chakra(path: str | Path) -> tuple[pb.GlobalMetadata, list[pb.Node]]:
    """Decode a Chakra ET file written by write_chakra (or any uncompressed one with these fields)."""
    data = Path(path).read_bytes()
    messages, pos = [], 0
    while pos < len(data):
        size, pos = _read_varint(data, pos)
        if pos + size > len(data):
            raise LocusError(f"{path}: truncated Chakra message at byte {pos}")
        messages.append(data[pos : pos + size])
        pos += size
    if not messages:
        raise LocusError(f"{path}: empty Chakra trace (no GlobalMetadata)")
    meta = pb.GlobalMetadata.FromString(messages[0])
    return meta, [pb.Node.FromString(m) for m in messages[1:]]
