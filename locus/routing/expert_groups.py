"""Expert groups: group-limited routing, and the nodes a placement lets one token reach.

DeepSeek-V3 (and V2 under `group_limited_greedy`) splits its E routed experts into `n_group` groups of
E / n_group consecutive experts and routes every token within its `topk_group` best groups. A placement
that keeps every replica of a group's experts on one node ("node-aligned") therefore bounds the nodes a
token's experts lie on by topk_group, whatever the router picks; a group whose replicas span several
nodes lifts that bound by its span. The bytes a plan costs already follow from where the experts are
(the replay routes the recorded experts); this module adds the structural figures: how many groups a
plan splits across nodes, and the most nodes a token of the model can reach under it.

Where the group structure comes from (`resolve_groups`): `--expert-groups G [--topk-group K]`, else the
trace's meta.json (`n_group`, `topk_group`: an engine recording of a group-limited model writes them),
else the trace's model name in KNOWN_GROUPS with the trace's expert count (traces recorded before, or
synthesized).

Shape legend: L MoE layers, R ranks, S slots per GPU, N nodes, E experts, Gn groups.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from locus.errors import LocusError
from locus.routing.plan.topology import Topology

# (routed experts, n_group, topk_group) of the group-limited models Locus knows by name: DeepSeek-V3's
# published config, and the `tiny-deepseek-v3` preset's (locus/engine/checkpoint/presets.py; routing may not
# import the engine, tests/routing/test_expert_groups.py checks they agree).
KNOWN_GROUPS = {"deepseek-v3": (256, 8, 4), "tiny-deepseek-v3": (16, 4, 2)}


@dataclass(frozen=True)
class ExpertGroups:
    num_experts: int
    num_groups: int
    topk_group: int | None = None  # None: the groups are known, the router's limit is not

    def __post_init__(self) -> None:
        E, G, K = self.num_experts, self.num_groups, self.topk_group
        if not isinstance(G, int) or G < 1:
            raise LocusError(f"--expert-groups must be a positive integer, got {G!r}")
        if E % G:
            raise LocusError(f"--expert-groups {G} does not divide the model's {E} experts into equal groups")
        if K is not None and not 1 <= K <= G:
            raise LocusError(f"--topk-group must be in 1..{G} (the expert groups), got {K}")

    @property
    def size(self) -> int:
        """Experts per group."""
        return self.num_experts // self.num_groups

    def group_of(self, experts: np.ndarray) -> np.ndarray:
        return np.asarray(experts) // self.size

    def check_fits(self, topology: Topology) -> None:
        """Refuse a topology whose nodes cannot each hold whole groups: node-aligned placement puts all of a
        group's experts on one node, so a node's G * S slots must hold some whole groups, and all nodes
        together every group."""
        per_node = topology.gpus_per_node * topology.slots_per_gpu
        fit = per_node // self.size
        if fit * topology.nodes < self.num_groups:
            raise LocusError(
                f"--align-groups: {self.num_groups} groups of {self.size} experts do not fit {topology.nodes} nodes of "
                f"{per_node} slots (a node holds {fit} whole group{'s' if fit != 1 else ''}); give more --slots")


def resolve_groups(model: str, num_experts: int, expert_groups: int | None = None,
                   topk_group: int | None = None, recorded: tuple[int, int] | None = None) -> ExpertGroups | None:
    """The expert groups of a trace's model: the flags' if given, else the trace's own (`recorded`: its
    meta.json's n_group, topk_group), else KNOWN_GROUPS by model name and expert count (a known or recorded
    topk_group goes with its own group count unless --topk-group says otherwise), else None."""
    known = KNOWN_GROUPS.get(model)
    if known is not None and known[0] != num_experts:  # the name reused by a model of another shape
        known = None
    if recorded is not None:
        known = (num_experts, *recorded)
    if topk_group is not None and expert_groups is None and known is None:
        raise LocusError("--topk-group needs --expert-groups G (the trace's model is not one whose groups Locus knows)")
    if expert_groups is None:
        if known is None:
            return None
        expert_groups = known[1]
    if topk_group is None and known is not None and known[1] == expert_groups:
        topk_group = known[2]
    return ExpertGroups(num_experts, expert_groups, topk_group)


def rows_over_limit(expert_ids: np.ndarray, groups: ExpertGroups) -> int:
    """(token, layer) rows of expert_ids [T, L, K] (-1 none) whose experts lie in more than topk_group groups:
    rows the node bound does not cover (a synthesized trace, or groups given wrongly). 0 without a limit."""
    if groups.topk_group is None or len(expert_ids) == 0:
        return 0
    ids = np.asarray(expert_ids)
    g = np.sort(np.where(ids >= 0, ids // groups.size, -1), axis=-1)
    first = np.ones(g.shape, dtype=bool)
    first[..., 1:] = g[..., 1:] != g[..., :-1]
    return int(np.count_nonzero(((first & (g >= 0)).sum(-1)) > groups.topk_group))


def trace_rows_over_limit(reader, start: int, stop: int, groups: ExpertGroups, chunk_rows: int = 1 << 16) -> int:
    """rows_over_limit over the rows of requests [start, stop) of a TraceReader, a chunk at a time."""
    lo, hi = int(reader.offsets[start]), int(reader.offsets[stop])
    return sum(rows_over_limit(reader.expert_ids[a : min(a + chunk_rows, hi)], groups) for a in range(lo, hi, chunk_rows))


@dataclass(frozen=True)
class GroupFigures:
    """A plan's expert groups across nodes (see the module docstring)."""

    num_groups: int
    group_size: int  # experts per group
    topk_group: int | None
    split_groups: int  # (layer, group) pairs whose experts' replicas lie on two or more nodes
    layer_groups: int  # L * num_groups: what split_groups is out of
    split_per_layer: list[int]
    max_span: int  # the most nodes one group's replicas lie on, any layer
    node_bound: int  # the most nodes one token's experts can lie on under this plan, any layer
    aligned_bound: int  # the same for a node-aligned plan on this topology: min(topk_group, top_k, nodes)

    def to_dict(self) -> dict:
        return asdict(self)

    def describe(self) -> str:
        limit = f"top {self.topk_group} groups" if self.topk_group is not None else "limit unknown"
        return (f"{self.num_groups} of {self.group_size} experts ({limit}): {self.split_groups} of {self.layer_groups} "
                f"(layer, group) split across nodes; a token reaches at most {self.node_bound} nodes "
                f"({self.aligned_bound} if aligned)")


def trace_groups(meta, expert_groups: int | None = None, topk_group: int | None = None) -> ExpertGroups | None:
    """resolve_groups for a trace's meta (TraceMeta): its recorded n_group / topk_group count."""
    recorded = None if getattr(meta, "n_group", None) is None else (meta.n_group, meta.topk_group)
    return resolve_groups(meta.model, meta.num_experts, expert_groups, topk_group, recorded)


def group_figures(slots, groups: ExpertGroups, topology: Topology, top_k: int) -> GroupFigures:
    """GroupFigures of slots [L, R, S] (expert ids; -1 none)."""
    slots = np.asarray(slots)
    L, R, S = slots.shape
    N, Gn = topology.nodes, groups.num_groups
    node = np.repeat(np.arange(R) // topology.gpus_per_node, S)  # [R * S] node of every slot
    flat = slots.reshape(L, R * S)
    held = np.zeros((L, Gn, N), dtype=bool)  # group g has a replica on node n
    for l in range(L):
        valid = flat[l] >= 0
        held[l, groups.group_of(flat[l][valid]), node[valid]] = True
    span = held.sum(-1)  # [L, Gn]
    split = (span > 1).sum(-1)  # [L]
    limit = Gn if groups.topk_group is None else groups.topk_group
    widest = -np.sort(-span, axis=1)[:, :limit].sum(1)  # [L] the topk_group widest groups' spans together
    bound = np.minimum(np.minimum(widest, top_k), N)
    return GroupFigures(
        num_groups=Gn, group_size=groups.size, topk_group=groups.topk_group, split_groups=int(split.sum()),
        layer_groups=L * Gn,
        split_per_layer=[int(x) for x in split], max_span=int(span.max()), node_bound=int(bound.max()),
        aligned_bound=int(min(limit, top_k, N)))
