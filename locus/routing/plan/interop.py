"""Placement plans in other engines' terms, both ways: SGLang, vLLM and DeepSeek EPLB expert maps.

All three describe a placement by *physical experts*: a layer's R x S slots numbered rank-major, so
physical expert p lives on rank p // S (SGLang: `physical_expert_id // num_local_physical_experts`;
vLLM's rebalance_execute: rows `ep_rank * num_local_experts ...`). A plan's slots [L, R, S] reshaped
to [L, R*S] is therefore exactly their physical_to_logical_map of the MoE layers.

Shape legend: L MoE layers, NL all model layers (SGLang), R ranks, S slots per GPU, P = R*S physical
experts, E logical experts, X replicas of the most replicated expert.
    sglang    {"physical_to_logical_map": [NL, P]}  (SGLang --init-expert-location; one row per model
              layer, dense layers get SGLang's own trivial row p % E; import also reads a recorder
              dump's "last_physical_to_logical_map", the map in force while it recorded)
    vllm      {"physical_to_logical_map": [L, P], "logical_to_physical_map": [L, E, X] (-1 padded),
               "logical_replica_count": [L, E]}  (vLLM EplbModelState's three tensors)
    deepseek  (phy2log [L, P], log2phy [L, E, X], logcnt [L, E])  (deepseek-ai/EPLB rebalance_experts)

What does not survive a trip through these formats: the model name, the grouping, the provenance and
which model layers are MoE layers (the engines' files have no place for them: an import is told the
MoE layers, never guesses 0..L-1); slots, topology and expert count do.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from locus.errors import LocusError
from locus.routing.plan.map_files import int_array, load_map_file, save_map_file
from locus.routing.plan.placement import PlacementPlan, validate
from locus.routing.plan.topology import Topology, parse_topology

FORMATS = ("sglang", "vllm", "deepseek")
P2L, L2P, COUNT = "physical_to_logical_map", "logical_to_physical_map", "logical_replica_count"
DEEPSEEK_KEYS = ("phy2log", "log2phy", "logcnt")
SGLANG_DUMP_P2L = "last_physical_to_logical_map"  # in SGLang's expert-distribution recorder dumps


# ---------------------------------------------------------------- plan -> arrays


def physical_map(plan: PlacementPlan) -> np.ndarray:
    """physical_to_logical_map of the MoE layers, [L, P], rows in ascending layer order."""
    order = np.argsort(plan.moe_layers, kind="stable")  # engines number MoE layers in model order
    return np.asarray(plan.slots, dtype=np.int64)[order].reshape(len(order), -1)


MAX_MAP_ENTRIES = 1 << 28  # 2 GiB of int64: far beyond any real model's [L, E, X] map


def replica_counts(p2l: np.ndarray, num_experts: int) -> np.ndarray:
    """Replicas of each expert per layer [L, E] (ids must lie in 0..num_experts - 1)."""
    return np.stack([np.bincount(row, minlength=num_experts) for row in p2l]).astype(np.int64)


def replica_maps(p2l: np.ndarray, num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """logical_to_physical [L, E, X] (each expert's physical ids ascending, -1 padded) and replica count [L, E]."""
    L, P = p2l.shape
    count = replica_counts(p2l, num_experts)
    width = max(1, int(count.max()))
    if L * num_experts * width > MAX_MAP_ENTRIES:  # one expert with most of the slots makes X as large as P
        raise LocusError(f"a logical_to_physical_map of {L} layers x {num_experts} experts x {width} replicas "
                         f"would hold {L * num_experts * width} entries, more than {MAX_MAP_ENTRIES}")
    # A stable sort by expert keeps each expert's physical ids ascending; a replica's column is its
    # position inside its expert's run, i.e. its index minus where the run starts.
    order = np.argsort(p2l, axis=1, kind="stable")
    experts = np.take_along_axis(p2l, order, axis=1)
    starts = np.cumsum(count, axis=1) - count
    column = np.arange(P)[None, :] - np.take_along_axis(starts, experts, axis=1)
    l2p = np.full((L, num_experts, width), -1, dtype=np.int64)
    l2p[np.arange(L)[:, None], experts, column] = order
    return l2p, count


def sglang_document(plan: PlacementPlan, num_hidden_layers: int | None = None) -> dict[str, np.ndarray]:
    """SGLang's --init-expert-location mapping: exactly one key, since SGLang passes the dict as
    keyword arguments to ExpertLocationMetadata.init_by_mapping (another key would be a TypeError)."""
    layers = num_hidden_layers if num_hidden_layers is not None else max(plan.moe_layers) + 1
    if layers <= max(plan.moe_layers):
        raise LocusError(
            f"--num-hidden-layers {layers} is too small: the plan places layer {max(plan.moe_layers)}"
        )
    P = plan.topology.total_slots
    # Dense layers get SGLang's init_trivial row (physical p holds logical p % E): SGLang keeps a row
    # for every model layer and never routes through the dense ones, so any valid row would do.
    rows = np.tile(np.arange(P, dtype=np.int64) % plan.num_experts, (layers, 1))
    rows[list(plan.moe_layers)] = np.asarray(plan.slots, dtype=np.int64).reshape(len(plan.moe_layers), P)
    return {P2L: rows}


def vllm_document(plan: PlacementPlan) -> dict[str, np.ndarray]:
    p2l = physical_map(plan)
    l2p, count = replica_maps(p2l, plan.num_experts)
    return {P2L: p2l, L2P: l2p, COUNT: count}


def deepseek_triple(plan: PlacementPlan) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    p2l = physical_map(plan)
    l2p, count = replica_maps(p2l, plan.num_experts)
    return p2l, l2p, count


def export_plan(plan: PlacementPlan, fmt: str, out: str | Path, num_hidden_layers: int | None = None) -> None:
    """Write `plan` as `fmt` to `out` (.json or .pt)."""
    if fmt == "sglang":
        save_map_file(out, sglang_document(plan, num_hidden_layers))
    elif fmt == "vllm":
        save_map_file(out, vllm_document(plan))
    elif fmt == "deepseek":
        triple = deepseek_triple(plan)
        # .pt keeps EPLB's own tuple; JSON has no tuples, so name the three arrays instead.
        save_map_file(out, triple if Path(out).suffix.lower() == ".pt" else dict(zip(DEEPSEEK_KEYS, triple)))
    else:
        raise LocusError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")


# ---------------------------------------------------------------- arrays -> plan


@dataclass
class ImportedPlan:
    plan: PlacementPlan
    notes: list[str] = field(default_factory=list)  # what was inferred, for the user to check


def import_plan(src: str | Path, fmt: str, topology: str, model: str, moe_layers: tuple[int, ...],
                num_experts: int | None = None) -> ImportedPlan:
    """A placement plan from an engine's map file; slots per GPU = physical experts / ranks. `moe_layers`:
    the model's MoE layer indices (sglang: which rows to take; vllm/deepseek: the layer of each row)."""
    if fmt not in FORMATS:
        raise LocusError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if num_experts is not None and num_experts < 1:
        raise LocusError(f"--num-experts must be positive, got {num_experts}")
    nodes, gpus = _topology_shape(topology)
    _check_layer_list(moe_layers)
    data = load_map_file(src)
    notes: list[str] = []
    if fmt == "sglang":
        p2l, layers = _sglang_rows(src, data, moe_layers)
        l2p = count = None
    else:
        p2l, l2p, count = _triple(src, data, fmt)
        layers = _row_layers(src, p2l.shape[0], moe_layers)
    E = _num_experts(src, p2l, l2p, count, num_experts, notes)
    _check_ids(src, p2l, layers, E)  # before anything is sized by E: the ids and E are the file's word
    if l2p is not None or count is not None:
        _check_replica_maps(src, p2l, l2p, count, layers, E)
    plan = _plan(src, p2l, layers, E, nodes, gpus, model, fmt)
    return ImportedPlan(plan, notes)


def _topology_shape(text: str) -> tuple[int, int]:
    # parse_topology also sizes slots for an expert count; the import learns slots from the file, so
    # only the NxG shape is wanted here (one expert, one slot always fits).
    shape = parse_topology(text, num_experts=1, slots=1)
    return shape.nodes, shape.gpus_per_node


def _check_layer_list(moe_layers: tuple[int, ...] | None) -> None:
    if moe_layers is None:  # every format's rows leave it open; 0..L-1 would be a guess
        raise LocusError("the map does not say which model layers are MoE layers; pass --moe-layers")
    layers = list(moe_layers)
    if not layers:
        raise LocusError("--moe-layers names no layer")
    if layers[0] < 0 or any(b <= a for a, b in zip(layers, layers[1:])):
        raise LocusError(f"--moe-layers must be strictly increasing non-negative layer indices, got {layers}")


def _sglang_rows(src, data: Any, moe_layers: tuple[int, ...]) -> tuple[np.ndarray, tuple[int, ...]]:
    """The MoE rows of SGLang's [NL, P] map (rows are model layers) and their layer indices."""
    # The recorder's per_token / per_pass dumps carry the map in force as last_physical_to_logical_map.
    key = P2L if isinstance(data, dict) and P2L in data else SGLANG_DUMP_P2L
    if not isinstance(data, dict) or key not in data:
        raise LocusError(f"{src}: not an SGLang expert-location file (no {P2L!r} or {SGLANG_DUMP_P2L!r} key)")
    rows = int_array(data[key], src, key, 2)
    if max(moe_layers) >= rows.shape[0]:
        raise LocusError(
            f"{src}: --moe-layers names layer {max(moe_layers)}, but the map has rows for layers "
            f"0..{rows.shape[0] - 1} only"
        )
    return rows[list(moe_layers)], tuple(moe_layers)


def _triple(src, data: Any, fmt: str) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """(physical_to_logical [L, P], logical_to_physical [L, E, X] or None, replica count [L, E] or None)."""
    if isinstance(data, (tuple, list)) and len(data) == 3 and fmt == "deepseek":
        raw = dict(zip(DEEPSEEK_KEYS, data))
    elif isinstance(data, dict) and all(k in data for k in DEEPSEEK_KEYS):
        raw = {k: data[k] for k in DEEPSEEK_KEYS}
    elif isinstance(data, dict) and P2L in data:
        raw = dict(zip(DEEPSEEK_KEYS, (data[P2L], data.get(L2P), data.get(COUNT))))
    else:
        want = "(phy2log, log2phy, logcnt) or a dict of them" if fmt == "deepseek" else f"a dict with {P2L!r}"
        raise LocusError(f"{src}: not a {fmt} expert map; expected {want}")
    names = (P2L, L2P, COUNT) if fmt == "vllm" else DEEPSEEK_KEYS
    p2l = int_array(raw["phy2log"], src, names[0], 2)
    l2p = None if raw["log2phy"] is None else int_array(raw["log2phy"], src, names[1], 3)
    count = None if raw["logcnt"] is None else int_array(raw["logcnt"], src, names[2], 2)
    return p2l, l2p, count


def _row_layers(src, rows: int, moe_layers: tuple[int, ...]) -> tuple[int, ...]:
    """Model layer index of each row of a vLLM / DeepSeek map (their rows are the MoE layers only)."""
    if len(moe_layers) != rows:
        raise LocusError(f"{src}: the map has {rows} MoE layer rows, but --moe-layers names {len(moe_layers)} layers")
    return tuple(moe_layers)


def _num_experts(src, p2l, l2p, count, given: int | None, notes: list[str]) -> int:
    """E from the file's logical-side shapes, else --num-experts, else the largest id + 1 (noted)."""
    stated = {a.shape[1] for a in (l2p, count) if a is not None}
    if len(stated) > 1:
        raise LocusError(f"{src}: {L2P} and {COUNT} disagree on the number of experts ({sorted(stated)})")
    if stated:
        E = stated.pop()
        if given is not None and given != E:
            raise LocusError(f"{src}: the map is for {E} experts, --num-experts says {given}")
        return E
    if given is not None:
        return given
    E = int(p2l.max()) + 1
    if E > p2l.shape[1]:
        raise LocusError(f"{src}: logical id {E - 1} implies at least {E} experts, but a layer has only "
                         f"{p2l.shape[1]} physical experts (every expert needs one in every layer)")
    notes.append(f"num_experts inferred as {E} (largest expert id + 1); pass --num-experts to check it")
    return max(E, 1)


def _check_ids(src, p2l: np.ndarray, layers: tuple[int, ...], E: int) -> None:
    bad = np.argwhere((p2l < 0) | (p2l >= E))
    if len(bad):
        i, p = bad[0]
        raise LocusError(f"{src}: layer {layers[i]}, physical expert {p}: logical id {p2l[i, p]} is outside 0..{E - 1}")
    if E > p2l.shape[1]:  # checked before bincount(minlength=E) below allocates for E
        raise LocusError(f"{src}: {E} experts cannot all have a slot among the {p2l.shape[1]} physical experts of "
                         "a layer (every expert needs one in every layer)")
    for i, row in enumerate(p2l):
        absent = np.flatnonzero(np.bincount(row, minlength=E) == 0)
        if len(absent):
            shown = ", ".join(str(e) for e in absent[:10]) + (" ..." if len(absent) > 10 else "")
            raise LocusError(f"{src}: layer {layers[i]}: expert(s) {shown} have no physical slot (every expert "
                             f"0..{E - 1} must appear in every MoE layer)")


def _check_replica_maps(src, p2l, l2p, count, layers: tuple[int, ...], E: int) -> None:
    """The logical-side maps must say what physical_to_logical_map says (replica order may differ:
    DeepSeek's EPLB lists replicas by replica rank, vLLM's initial map by physical id)."""
    L, P = p2l.shape
    for name, array in ((L2P, l2p), (COUNT, count)):
        if array is not None and array.shape[0] != L:
            raise LocusError(f"{src}: {name} has {array.shape[0]} layer rows, {P2L} has {L}")
    if count is not None:
        want_count = replica_counts(p2l, E)
        diff = np.argwhere(count != want_count)
        if len(diff):
            i, e = diff[0]
            raise LocusError(f"{src}: layer {layers[i]}, expert {e}: {COUNT} says {count[i, e]} replica(s), "
                             f"{P2L} places {want_count[i, e]}")
    if l2p is None:
        return
    bad = np.argwhere((l2p < -1) | (l2p >= P))
    if len(bad):
        i, e, j = bad[0]
        raise LocusError(f"{src}: layer {layers[i]}, expert {e}: {L2P} names physical expert {l2p[i, e, j]}, "
                         f"outside 0..{P - 1} (-1 pads)")
    # Compare (layer, expert, physical) triples, sorted, pads dropped: what each side lists, whatever
    # its width (vLLM's live state pads to 1024 columns, EPLB's output to the largest replica count)
    # and without a dense [L, E, X] map, whose X a single much-replicated expert makes as large as P.
    placed = _triples(np.repeat(np.arange(L), P), p2l.ravel(), np.tile(np.arange(P), L))
    where = np.nonzero(l2p >= 0)
    listed = _triples(where[0], where[1], l2p[where])
    n = min(len(placed), len(listed))
    differ = np.flatnonzero((placed[:n] != listed[:n]).any(axis=1))
    if len(differ) or len(placed) != len(listed):
        k = int(differ[0]) if len(differ) else n
        i, e = min(tuple(side[k, :2]) for side in (placed, listed) if k < len(side))
        show = [_ids(side[(side[:, 0] == i) & (side[:, 1] == e), 2]) for side in (listed, placed)]
        raise LocusError(f"{src}: layer {layers[i]}, expert {e}: {L2P} lists physical {show[0]}, "
                         f"{P2L} places it at {show[1]}")


def _ids(values: np.ndarray, shown: int = 10) -> str:
    """'[1, 2]', or the first `shown` and the count of a long list."""
    head = ", ".join(str(int(x)) for x in values[:shown])
    return f"[{head}]" if len(values) <= shown else f"[{head}, ...] ({len(values)} in all)"


def _triples(layer: np.ndarray, expert: np.ndarray, physical: np.ndarray) -> np.ndarray:
    """[N, 3] (layer, expert, physical) rows in lexicographic order."""
    rows = np.stack([layer, expert, physical], axis=1).astype(np.int64)
    return rows[np.lexsort((rows[:, 2], rows[:, 1], rows[:, 0]))]


def _plan(src, p2l, layers, E: int, nodes: int, gpus: int, model: str, fmt: str) -> PlacementPlan:
    ranks = nodes * gpus
    L, P = p2l.shape
    if P % ranks:
        raise LocusError(f"{src}: {P} physical experts per layer do not divide among the {ranks} ranks of "
                         f"topology {nodes}x{gpus}")
    topology = Topology(nodes, gpus, P // ranks)
    plan = PlacementPlan(
        model=model, num_experts=E, moe_layers=tuple(int(x) for x in layers), topology=topology,
        slots=p2l.reshape(L, ranks, P // ranks).copy(),
        provenance={"planner": f"imported-{fmt}", "source": str(src)},
    )
    validate(plan)  # the checks above should make this a formality; it guards the plan format's own rules
    return plan
