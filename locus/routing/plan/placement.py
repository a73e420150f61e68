"""Placement plan: which expert ids each rank holds in each MoE layer (`locus-placement`, version 1).

Shape legend: L MoE layers (in `moe_layers` order), R ranks, S slots per GPU, E experts.
    slots  [L, R, S] int64   slots[i, r] = the expert ids rank r holds in layer moe_layers[i]

An expert held by several slots has replicas; every expert has at least one slot in every layer.
A rank may hold the same expert in two slots (EPLB can do that with a very hot expert); each slot
counts as a replica for the dispatch rule's `position % count`.

Optional `dispatch`: the dispatch rule the plan is meant to run under (`position` or `node-aware`,
docs/replay.md); absent means the default rule (dispatch_rule.DEFAULT_RULE).

The JSON layout is docs/design.md's ("Placement plan format"); `load_plan` and `validate` reject anything else with a message that
names the layer, rank, slot or expert at fault.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from locus.errors import LocusError
from locus.files import read_json, write_text_atomic
from locus.routing.plan.topology import Topology

FORMAT = "locus-placement"
VERSION = 1
DISPATCH_RULES = ("position", "node-aware")  # dispatch_rule.RULES (that module imports this one)
_REQUIRED = ("format", "version", "model", "num_experts", "moe_layers", "topology", "layers")


class PlanError(LocusError):
    """A placement plan that is malformed or does not fit the model or topology."""


@dataclass
class PlacementPlan:
    model: str
    num_experts: int
    moe_layers: tuple[int, ...]
    topology: Topology
    slots: np.ndarray  # [L, R, S] expert ids
    grouping: dict | None = None
    provenance: dict = field(default_factory=dict)
    dispatch: str | None = None  # dispatch rule; None: dispatch_rule.DEFAULT_RULE

    @property
    def planner(self) -> str:
        return str(self.provenance.get("planner", "unknown"))

    def to_dict(self) -> dict:
        data = {
            "format": FORMAT,
            "version": VERSION,
            "model": self.model,
            "num_experts": int(self.num_experts),
            "moe_layers": [int(x) for x in self.moe_layers],
            "topology": self.topology.to_dict(),
            "layers": [
                {"layer": int(layer), "slots": self.slots[i].tolist()} for i, layer in enumerate(self.moe_layers)
            ],
        }
        if self.dispatch is not None:
            data["dispatch"] = self.dispatch
        if self.grouping is not None:
            data["grouping"] = self.grouping
        data["provenance"] = dict(self.provenance)
        return data

    def to_json(self) -> str:
        """JSON text with one line per layer, so a plan stays readable and diffable."""
        data = self.to_dict()
        layers = data.pop("layers")
        head = [f"{json.dumps(k)}: {json.dumps(v)}" for k, v in data.items()]
        body = ",\n  ".join(json.dumps(layer, separators=(", ", ": ")) for layer in layers)
        return "{" + ",\n ".join(head) + f',\n "layers": [\n  {body}\n ]' + "}\n"

    def save(self, path: str | Path) -> None:
        """Write atomically: a reader never sees half a plan, even if we are killed mid-write."""
        write_text_atomic(path, self.to_json())


def load_plan(path: str | Path) -> PlacementPlan:
    path = Path(path)
    try:
        data = read_json(path, "placement plan")
    except LocusError as exc:
        raise PlanError(str(exc)) from None
    try:
        return plan_from_dict(data)
    except PlanError as exc:
        raise PlanError(f"{path}: {exc}") from None


def plan_from_dict(data: object) -> PlacementPlan:
    if not isinstance(data, dict):
        raise PlanError("a placement plan must be a JSON object")
    missing = [k for k in _REQUIRED if k not in data]
    if missing:
        raise PlanError(f"placement plan is missing field(s): {', '.join(missing)}")
    if data["format"] != FORMAT:
        raise PlanError(f"format is {data['format']!r}, expected {FORMAT!r}")
    if not _is_int(data["version"]) or data["version"] != VERSION:
        raise PlanError(f"version {data['version']!r} is not supported (this Locus reads version {VERSION})")
    if not isinstance(data["model"], str):
        raise PlanError("model must be a string")
    num_experts = _positive_int(data["num_experts"], "num_experts")
    moe_layers = data["moe_layers"]
    if not isinstance(moe_layers, list) or not all(_is_int(x) and x >= 0 for x in moe_layers):
        raise PlanError("moe_layers must be a list of non-negative layer indices")
    topo = data["topology"]
    if not isinstance(topo, dict):
        raise PlanError("topology must be an object with nodes, gpus_per_node, slots_per_gpu")
    fields = ("nodes", "gpus_per_node", "slots_per_gpu")
    absent = [k for k in fields if k not in topo]
    if absent:
        raise PlanError(f"topology is missing field(s): {', '.join(absent)}")
    topology = Topology(*(_positive_int(topo[k], f"topology.{k}") for k in fields))
    for key in ("grouping", "provenance"):
        if data.get(key) is not None and not isinstance(data[key], dict):
            raise PlanError(f"{key} must be an object")
    dispatch = data.get("dispatch")
    if dispatch is not None and dispatch not in DISPATCH_RULES:
        raise PlanError(f"dispatch is {dispatch!r}; expected one of {', '.join(DISPATCH_RULES)}")
    slots = _parse_layers(data["layers"], moe_layers, topology)
    plan = PlacementPlan(
        model=data["model"],
        num_experts=num_experts,
        moe_layers=tuple(int(x) for x in moe_layers),
        topology=topology,
        slots=slots,
        grouping=data.get("grouping"),
        provenance=dict(data.get("provenance") or {}),
        dispatch=dispatch,
    )
    validate(plan)
    return plan


def _parse_layers(layers: object, moe_layers: list, topology: Topology) -> np.ndarray:
    """The `layers` list as a [L, R, S] array, in `moe_layers` order; shape errors name the layer and rank."""
    if not isinstance(layers, list):
        raise PlanError("layers must be a list of {layer, slots} objects")
    by_layer: dict[int, list] = {}
    for i, entry in enumerate(layers):
        if not isinstance(entry, dict) or "layer" not in entry or "slots" not in entry:
            raise PlanError(f"layers[{i}] must be an object with 'layer' and 'slots'")
        layer = entry["layer"]
        if not _is_int(layer):
            raise PlanError(f"layers[{i}].layer must be an integer, got {layer!r}")
        if layer not in moe_layers:
            raise PlanError(f"layer {layer} is placed but is not in the plan's moe_layers {moe_layers}")
        if layer in by_layer:
            raise PlanError(f"layer {layer} is placed twice")
        by_layer[layer] = entry["slots"]
    # Shapes are checked against the topology before anything is allocated for it: a topology's
    # numbers are the file's word, the lists are what it really holds.
    rows = []
    for layer in moe_layers:
        if layer not in by_layer:
            raise PlanError(f"MoE layer {layer} has no placement")
        ranks = by_layer[layer]
        if not isinstance(ranks, list) or len(ranks) != topology.ranks:
            got = len(ranks) if isinstance(ranks, list) else type(ranks).__name__
            raise PlanError(f"layer {layer}: slots lists {got} ranks, topology {topology} has {topology.ranks}")
        for rank, held in enumerate(ranks):
            if not isinstance(held, list) or len(held) != topology.slots_per_gpu:
                got = len(held) if isinstance(held, list) else type(held).__name__
                raise PlanError(
                    f"layer {layer}, rank {rank}: holds {got} expert ids, "
                    f"topology has {topology.slots_per_gpu} slots per GPU"
                )
            for j, expert in enumerate(held):
                if not _is_int(expert) or not -(2**63) <= expert < 2**63:
                    raise PlanError(f"layer {layer}, rank {rank}, slot {j}: expert id {expert!r} is not an integer "
                                    "(of 64 bits)")
        rows.append(ranks)
    shape = (len(moe_layers), topology.ranks, topology.slots_per_gpu)
    return np.array(rows, dtype=np.int64).reshape(shape)


def validate(plan: PlacementPlan, num_experts: int | None = None, moe_layers=None) -> None:
    """Raise PlanError unless `plan` is self-consistent and, when given, fits the model's experts and layers.
    A plan `load_plan` returned is self-consistent already: its fit to a model is `check_fit`'s alone."""
    topo, E = plan.topology, plan.num_experts
    _check_experts_fit(plan, num_experts)
    if len(set(plan.moe_layers)) != len(plan.moe_layers):
        raise PlanError(f"moe_layers {list(plan.moe_layers)} names a layer twice")
    _check_layers_fit(plan, moe_layers)
    slots = np.asarray(plan.slots)
    want = (len(plan.moe_layers), topo.ranks, topo.slots_per_gpu)
    if slots.shape != want:
        raise PlanError(f"slots have shape {slots.shape}, topology {topo} with {want[0]} layers needs {want}")
    if slots.size and not np.issubdtype(slots.dtype, np.integer):
        raise PlanError(f"expert ids must be integers, got dtype {slots.dtype}")
    bad = np.argwhere((slots < 0) | (slots >= E))
    if len(bad):
        i, rank, j = bad[0]
        raise PlanError(
            f"layer {plan.moe_layers[i]}, rank {rank}, slot {j}: expert id {slots[i, rank, j]} "
            f"is outside 0..{E - 1}"
        )
    if topo.total_slots < E:
        raise PlanError(f"topology {topo} has {topo.total_slots} slots per layer, fewer than the {E} experts")
    for i, layer in enumerate(plan.moe_layers):
        present = np.bincount(slots[i].ravel(), minlength=E)
        absent = np.flatnonzero(present == 0)
        if len(absent):
            shown = ", ".join(str(e) for e in absent[:10]) + (" ..." if len(absent) > 10 else "")
            raise PlanError(f"layer {layer}: expert(s) {shown} have no slot ({len(absent)} missing)")


def check_fit(plan: PlacementPlan, num_experts: int | None, moe_layers) -> None:
    """Raise PlanError unless a self-consistent plan (loaded, planned) fits the model's experts and MoE layers."""
    _check_experts_fit(plan, num_experts)
    _check_layers_fit(plan, moe_layers)


def _check_experts_fit(plan: PlacementPlan, num_experts: int | None) -> None:
    if num_experts is not None and plan.num_experts != num_experts:
        raise PlanError(f"plan is for {plan.num_experts} experts, the model has {num_experts}")


def _check_layers_fit(plan: PlacementPlan, moe_layers) -> None:
    if moe_layers is None:
        return
    model_layers = [int(x) for x in moe_layers]
    extra = [x for x in plan.moe_layers if x not in model_layers]
    if extra:
        raise PlanError(f"plan places layer {extra[0]}, which is not an MoE layer of the model {model_layers}")
    absent = [x for x in model_layers if x not in plan.moe_layers]
    if absent:
        raise PlanError(f"plan has no placement for MoE layer {absent[0]}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _positive_int(value: object, name: str) -> int:
    if not _is_int(value) or value < 1:
        raise PlanError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


def node_replicas(slots: np.ndarray, nodes: int, num_experts: int) -> np.ndarray:
    """Replicas of each expert per node, [L, N, E] int64, from slots [L, R, S]."""
    L, R, S = slots.shape
    G = R // nodes
    node = np.repeat(np.arange(R) // G, S)  # [R * S] node of every slot
    keys = (np.arange(L)[:, None] * nodes + node[None, :]) * num_experts + slots.reshape(L, R * S)
    return np.bincount(keys.ravel(), minlength=L * nodes * num_experts).reshape(L, nodes, num_experts)
