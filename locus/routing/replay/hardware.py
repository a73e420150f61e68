"""Hardware profiles for the decode step-time model: a machine's memory bandwidth and tensor peak, the
expert kernels' measured efficiency, and the two tiers of the exchange (docs/design.md, "File formats",
`locus-hardware`).

Profiles are data files (hardware/<name>.json beside this module, or any path), every figure with its
source. A profile is validated once, where it is loaded; a bad one is refused in one line naming the
file and the field.

`host_overlap` says how a step's host work and its collectives compose: "none" (each layer's compute,
then its exchange, after the step's overhead: a GPU rank without two-batch overlap), or "per_collective"
(each collective's time runs under the host work before it, and costs the longer of the two: a testbed
whose ranks share cores and whose link drains queued bytes while they compute; step_time.py).

A figure that depends on the expert-parallel size (DeepEP's bandwidths and latencies are published per
EP size) is a list of [ranks, value] pairs; a replay on R ranks takes the pair whose ranks is nearest
to R on a log scale (ties to the smaller), as the tuned kernel tables pick their token count.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

from locus.errors import LocusError

PROFILE_DIR = Path(__file__).with_name("hardware")
FORMAT_NAME = "locus-hardware"
FORMAT_VERSION = 1
FIGURES = ("memory_bytes_per_s", "tensor_flops_per_s", "expert_efficiency", "expert_kernel_floor_s", "inter_node",
           "intra_node", "dispatch_latency_s", "combine_latency_s", "step_overhead_s", "step_link_bytes", "host_overlap")
HOST_OVERLAPS = ("none", "per_collective")
LINK_FIELDS = ("dispatch_bytes_per_s", "combine_bytes_per_s", "shared_by_node", "message_bytes",
               "dispatch_collective_bytes", "combine_collective_bytes")


@dataclass(frozen=True)
class RankTable:
    """A figure by expert-parallel size: ((ranks, value), ...) sorted by ranks; one pair = a constant."""

    points: tuple[tuple[int, float], ...]

    @classmethod
    def constant(cls, value: float) -> "RankTable":
        return cls(((1, float(value)),))

    def at(self, ranks: int) -> float:
        """The value of the pair whose ranks is nearest to `ranks` on a log scale (ties: the smaller)."""
        target = math.log(max(int(ranks), 1))
        return min(self.points, key=lambda p: (abs(math.log(p[0]) - target), p[0]))[1]


@dataclass(frozen=True)
class Link:
    """One tier of the exchange: inter-node (tier 1) or intra-node (tier 2)."""

    dispatch_bytes_per_s: RankTable
    combine_bytes_per_s: RankTable
    shared_by_node: bool  # one link for the node's ranks together (else one a rank: a NIC a GPU)
    message_bytes: float  # wire bytes a non-empty message (sender -> receiver, one collective) costs beyond its rows
    dispatch_collective_bytes: float  # wire bytes every sender puts on the tier per dispatch whatever it sends
    combine_collective_bytes: float


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    description: str
    memory_bytes_per_s: float  # HBM (or DRAM) bandwidth of one rank
    tensor_flops_per_s: float  # dense matmul peak of one rank in the served dtype
    # ((tokens per expert, efficiency), ...) sorted: the share of the roofline the expert kernels reach
    expert_efficiency: tuple[tuple[float, float], ...]
    expert_kernel_floor_s: float  # a MoE layer's expert kernels on a rank cost at least this once they run
    inter_node: Link
    intra_node: Link
    dispatch_latency_s: RankTable  # per dispatch collective
    combine_latency_s: RankTable
    step_overhead_s: float  # host time a step costs whatever its tokens (scheduling, sampling, control)
    step_link_bytes: float  # control-plane bytes a node puts on the inter-node link every step
    host_overlap: str  # HOST_OVERLAPS: "none" (compute, then exchange) or "per_collective" (the longer of the two)
    sources: dict
    path: str = ""

    def efficiency(self, tokens_per_expert):
        """The expert kernels' efficiency at that many tokens per expert: linear in log(tokens) between
        the profile's points, the end points' value beyond them (numpy array in, array out)."""
        import numpy as np

        n = np.log(np.maximum(np.asarray(tokens_per_expert, dtype=np.float64), 1e-9))
        xs = np.log([p[0] for p in self.expert_efficiency])
        ys = np.array([p[1] for p in self.expert_efficiency])
        return np.interp(n, xs, ys)

    def with_links(self, inter_bytes_per_s: float | None = None, intra_bytes_per_s: float | None = None,
                   latency_s: float | None = None) -> "HardwareProfile":
        """The profile with its tier bandwidths (both directions) or collective latency replaced: `locus
        replay --inter-gbps / --intra-gbps / --latency-us` given with --hardware (e.g. a shaped link's rate)."""
        out = self
        for attr, value in (("inter_node", inter_bytes_per_s), ("intra_node", intra_bytes_per_s)):
            if value is not None:
                table = RankTable.constant(value)
                out = replace(out, **{attr: replace(getattr(out, attr), dispatch_bytes_per_s=table,
                                                    combine_bytes_per_s=table)})
        if latency_s is not None:
            out = replace(out, dispatch_latency_s=RankTable.constant(latency_s),
                          combine_latency_s=RankTable.constant(latency_s))
        return out


def profile_names() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json"))


def load_hardware(spec: str) -> HardwareProfile:
    """A profile by name (hardware/<name>.json) or from a file path."""
    path = PROFILE_DIR / f"{spec}.json"
    if not path.is_file():
        path = Path(spec)
        if not path.is_file():
            raise LocusError(f"hardware profile {spec!r}: neither a known profile ({', '.join(profile_names())}) nor a file")
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise LocusError(f"hardware profile {path}: cannot read it as JSON ({exc})") from None
    return parse_hardware(doc, str(path))


def parse_hardware(doc, where: str) -> HardwareProfile:
    """Check every field of a profile document; the first problem is one LocusError naming file and field."""
    def fail(field: str, problem: str):
        raise LocusError(f"hardware profile {where}: {field}: {problem}")

    if not isinstance(doc, dict):
        fail("(document)", "must be a JSON object")
    if doc.get("format") != FORMAT_NAME:
        fail("format", f"is {doc.get('format')!r}, expected {FORMAT_NAME!r}")
    if doc.get("version") != FORMAT_VERSION:
        fail("version", f"is {doc.get('version')!r}, this reader knows {FORMAT_VERSION}")
    known = {"format", "version", "name", "description", "sources", *FIGURES}
    if unknown := sorted(set(doc) - known):
        fail(unknown[0], "unknown field")
    for key in ("name", "description", *FIGURES, "sources"):
        if key not in doc:
            fail(key, "missing")
    for key in ("name", "description"):
        if not isinstance(doc[key], str) or not doc[key].strip():
            fail(key, "must be a non-empty string")
    sources = doc["sources"]
    if not isinstance(sources, dict):
        fail("sources", "must be an object naming where each figure comes from")
    for key in FIGURES:
        if not isinstance(sources.get(key), str) or not sources[key].strip():
            fail(f"sources.{key}", "missing: every figure names its source")

    def number(value, field: str, positive: bool = True) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or value < 0 or (positive and value == 0):
            fail(field, f"must be a {'positive' if positive else 'non-negative'} number, got {value!r}")
        return float(value)

    def table(value, field: str, positive: bool = True) -> RankTable:
        if not isinstance(value, list):
            return RankTable.constant(number(value, field, positive))
        if not value:
            fail(field, "an empty list of [ranks, value] pairs")
        points = []
        for item in value:
            if not isinstance(item, list) or len(item) != 2 or isinstance(item[0], bool) or not isinstance(item[0], int) \
                    or item[0] < 1:
                fail(field, f"each entry must be [ranks, value] with ranks a positive integer, got {item!r}")
            points.append((item[0], number(item[1], field, positive)))
        ranks = [p[0] for p in points]
        if ranks != sorted(set(ranks)):
            fail(field, "the ranks of its pairs must be strictly increasing")
        return RankTable(tuple(points))

    def link(value, field: str) -> Link:
        if not isinstance(value, dict):
            fail(field, "must be an object")
        if unknown := sorted(set(value) - set(LINK_FIELDS)):
            fail(f"{field}.{unknown[0]}", "unknown field")
        for key in LINK_FIELDS:
            if key not in value:
                fail(f"{field}.{key}", "missing")
        if not isinstance(value["shared_by_node"], bool):
            fail(f"{field}.shared_by_node", "must be true or false")
        return Link(table(value["dispatch_bytes_per_s"], f"{field}.dispatch_bytes_per_s"),
                    table(value["combine_bytes_per_s"], f"{field}.combine_bytes_per_s"), value["shared_by_node"],
                    *(number(value[k], f"{field}.{k}", positive=False)
                      for k in ("message_bytes", "dispatch_collective_bytes", "combine_collective_bytes")))

    if doc["host_overlap"] not in HOST_OVERLAPS:
        fail("host_overlap", f"must be one of {', '.join(HOST_OVERLAPS)}, got {doc['host_overlap']!r}")
    curve = doc["expert_efficiency"]
    if not isinstance(curve, list) or not curve:
        fail("expert_efficiency", "must be a non-empty list of [tokens per expert, efficiency] pairs")
    points = []
    for item in curve:
        if not isinstance(item, list) or len(item) != 2:
            fail("expert_efficiency", f"each entry must be [tokens per expert, efficiency], got {item!r}")
        n, e = number(item[0], "expert_efficiency"), number(item[1], "expert_efficiency")
        if e > 1:
            fail("expert_efficiency", f"an efficiency is a share of the roofline, at most 1, got {e}")
        points.append((n, e))
    if [p[0] for p in points] != sorted({p[0] for p in points}):
        fail("expert_efficiency", "its token counts must be strictly increasing")
    return HardwareProfile(
        name=doc["name"], description=doc["description"],
        memory_bytes_per_s=number(doc["memory_bytes_per_s"], "memory_bytes_per_s"),
        tensor_flops_per_s=number(doc["tensor_flops_per_s"], "tensor_flops_per_s"),
        expert_efficiency=tuple(points),
        expert_kernel_floor_s=number(doc["expert_kernel_floor_s"], "expert_kernel_floor_s", positive=False),
        inter_node=link(doc["inter_node"], "inter_node"), intra_node=link(doc["intra_node"], "intra_node"),
        dispatch_latency_s=table(doc["dispatch_latency_s"], "dispatch_latency_s", positive=False),
        combine_latency_s=table(doc["combine_latency_s"], "combine_latency_s", positive=False),
        step_overhead_s=number(doc["step_overhead_s"], "step_overhead_s", positive=False),
        step_link_bytes=number(doc["step_link_bytes"], "step_link_bytes", positive=False),
        host_overlap=doc["host_overlap"],
        sources=dict(sources), path=where)
