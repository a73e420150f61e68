"""Surviving a lost rank (`--ep-elastic`): the survivors form a new process group, re-plan onto
themselves, and go on; the lost rank's requests are re-admitted on them from their prompt and the
tokens already streamed (rank 0's side: driver.py).

    a collective fails (a peer died: its connections closed; or it hung past --ep-timeout); a fault
    of a rank's own (a bug, a placement that does not fit) is not a lost peer: it fails the server
      -> every survivor leaves the old group at once (its own peers' collectives then fail too), and
         writes g<N>/alive/<identity> (with the placement epoch it holds) into the launch's store
         (rank 0 hosts it; every value signed with the launch's secret, rendezvous.py)
      -> rank 0 waits for every previous member still alive (it started them: it knows), then writes
         g<N>/members; a survivor not listed leaves
      -> every member says it is ready and waits for the others (polled): if a member dies (or hangs
         past --ep-timeout) before it joins, rank 0 calls generation N off and everyone starts
         generation N+1 without it, instead of waiting in torch's rendezvous for the whole timeout
      -> each member joins a new process group on the same store under g<N>/pg/ (its rank its index in
         members; at most JOIN_TIMEOUT_S for torch's rendezvous and the groups, else N+1 again)
      -> re-plan onto the survivors (rank 0 computes it, the others read it, signed): every expert keeps
         the slots it has on a survivor; an expert only the lost rank held takes a spare slot (a rank may
         grow to `max_slots` slots when the survivors have too few), its weights read from the checkpoint
         (or drawn from the preset's seed); each rank checks its slots' weights (invariant.py)
      -> a new placement epoch (past every member's), whose digest every rank's next header carries: no
         rank steps unless all agree. The engines' requests are untouched (the failed step left no trace:
         sampling runs after every forward), so the next iteration re-runs it.

Topology after a loss: the survivors keep their nodes when every node keeps the same number of ranks;
otherwise each survivor is its own node (the two-tier exchange needs equal nodes), which counts every
peer as remote: conservative for the inter-node figures, and the same definition for replay.
"""

from __future__ import annotations

import gc
import json
import logging
import time
from collections import Counter
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from locus.engine.ep.groups import make_groups, set_timeout
from locus.engine.ep.invariant import PlacementDisagreement
from locus.engine.model.expert_rows import stack_experts
from locus.engine.ep.ranks.control import ControlPlane
from locus.engine.ep.ranks.rendezvous import RecoveryCancelled, RendezvousRefused, SignedStore
from locus.errors import LocusError, forget_frames
from locus.routing.plan.placement import PlacementPlan, plan_from_dict, validate
from locus.routing.plan.topology import Topology

log = logging.getLogger("locus.engine")
JOIN_TIMEOUT_S = 10.0  # torch's rendezvous of survivors that all said they are ready (ready_barrier), at most


class NotASurvivor(LocusError):
    """This rank registered too late: the others went on without it."""


def survivor_topology(old: Topology, survivors: list[int], slots: int) -> Topology:
    """The topology of the surviving old ranks (see the module doc)."""
    G = old.gpus_per_node
    per_node = Counter(r // G for r in survivors)
    counts = set(per_node.values())
    if len(counts) == 1:
        return Topology(len(per_node), counts.pop(), slots)
    return Topology(len(survivors), 1, slots)


def survivor_slots(num_experts: int, slots_per_gpu: int, survivors: int, max_slots: int) -> int:
    """The expert slots each of `survivors` ranks needs for every expert to keep one (at least the
    plan's own); LocusError when that is more than `max_slots`."""
    need = max(slots_per_gpu, -(-num_experts // survivors))
    if need > max_slots:
        raise LocusError(f"the {survivors} surviving ranks need {need} expert slots each to hold all {num_experts} "
                         f"experts, more than --ep-max-slots {max_slots}")
    return need


def plan_onto(plan: PlacementPlan, survivors: list[int], max_slots: int) -> PlacementPlan:
    """`plan` re-laid onto the surviving old ranks: each keeps its slots; experts no survivor holds
    take spare slots, replacing the most replicated experts first, then growing every rank's slot count
    (up to `max_slots`) when there is nothing left to replace."""
    E, L = plan.num_experts, len(plan.moe_layers)
    S = plan.topology.slots_per_gpu
    try:
        slots_per = survivor_slots(E, S, len(survivors), max_slots)
    except LocusError as exc:
        raise LocusError(f"{exc}; the server cannot continue") from None
    topology = survivor_topology(plan.topology, survivors, slots_per)
    table = np.full((L, len(survivors), slots_per), -1, dtype=np.int64)
    for moe_index in range(L):
        held = [list(plan.slots[moe_index][r]) + [-1] * (slots_per - S) for r in survivors]
        count = Counter(e for slots in held for e in slots if e >= 0)
        missing = [e for e in range(E) if count[e] == 0]
        for e in missing:
            # a free slot first; else the slot of the expert with the most replicas (never the last one)
            free = [(i, j) for i, slots in enumerate(held) for j, x in enumerate(slots) if x < 0]
            if free:
                i, j = min(free, key=lambda ij: (sum(x >= 0 for x in held[ij[0]]), ij))
            else:
                i, j = max(((i, j) for i, slots in enumerate(held) for j, x in enumerate(slots) if count[x] > 1),
                           key=lambda ij: (count[held[ij[0]][ij[1]]], -ij[0], -ij[1]))
                count[held[i][j]] -= 1
            held[i][j] = e
            count[e] += 1
        for i, slots in enumerate(held):  # a slot still free repeats the rank's first expert (a second copy)
            table[moe_index, i] = [x if x >= 0 else slots[0] for x in slots]
    new = PlacementPlan(plan.model, E, tuple(plan.moe_layers), topology, table, grouping=None,
                        provenance={**plan.provenance, "planner": plan.provenance.get("planner", "round_robin"),
                                    "survivors_of": [int(r) for r in survivors]},
                        dispatch=plan.dispatch)
    validate(new)
    return new


def rendezvous_members(store: SignedStore, generation: int, identity: int, previous: list[int], grace: float,
                       timeout: float, is_alive=None, epoch: int = 0, cancelled=None,
                       excluded: set[int] | None = None) -> tuple[list[int], int]:
    """Register this rank (its identity, and the placement epoch it holds) as alive; rank 0 decides who
    made it. Returns the members and the highest epoch any of them holds.

    Rank 0 waits for every previous member that is still alive (`is_alive(identity)`: the processes it
    started itself; a hung one counts as dead past `timeout`; `excluded`: ones an earlier attempt of
    this regroup already waited out), or, without that knowledge, `grace` seconds."""
    prefix = f"g{generation}/"
    store.set(f"{prefix}alive/{identity}", json.dumps({"epoch": epoch}))
    if identity == 0:
        excluded = excluded or set()
        deadline = time.monotonic() + (timeout if is_alive is not None else grace)
        epochs = {0: epoch}
        while True:
            for r in previous:
                if r not in epochs and store.check(f"{prefix}alive/{r}"):
                    epochs[r] = _verified_json(store, f"{prefix}alive/{r}", {"epoch": -1})["epoch"]
            registered = [r for r in previous if epochs.get(r, -1) >= 0]
            waiting = [r for r in previous if r not in epochs and r not in excluded and (is_alive is None or is_alive(r))]
            if not waiting or time.monotonic() >= deadline:
                break
            if cancelled is not None and cancelled():
                raise RecoveryCancelled("the server is stopping; the survivors' regroup was given up")
            time.sleep(0.02)
        top = max(epochs[r] for r in registered)
        store.set(f"{prefix}members", json.dumps({"members": registered, "epoch": top}))
        return registered, top
    record = json.loads(store.wait_get(f"{prefix}members", timeout, cancelled))
    if identity not in record["members"]:
        raise NotASurvivor(f"rank {identity} registered after the survivors of generation {generation} were decided")
    return record["members"], record["epoch"]


def _verified_json(store: SignedStore, name: str, refused):
    """A signed JSON value of the store; `refused` when it is not signed by this launch (logged)."""
    try:
        return json.loads(store.get_verified(name))
    except RendezvousRefused as exc:
        log.error("%s", exc)
        return refused


class RegroupRestart(Exception):
    """This attempt to regroup is called off (a member died or hung before joining): start the next."""


def ready_barrier(store: SignedStore, generation: int, identity: int, members: list[int], timeout: float,
                  is_alive=None, cancelled=None) -> None:
    """Every member says it is about to join the new process group, and waits until all have. torch's
    process-group rendezvous waits for a member that never comes until its timeout; this barrier is
    polled instead, and rank 0 (which knows which of the processes it started are alive) calls the
    attempt off the moment a member dies before joining, or when one has not come within `timeout`:
    RegroupRestart, on every member, and the next generation goes on without it."""
    prefix = f"g{generation}/"
    store.set(f"{prefix}ready/{identity}", "1")
    deadline = time.monotonic() + timeout
    while True:
        if store.check(f"{prefix}abort"):
            lost = _verified_json(store, f"{prefix}abort", None)
            if lost is not None:
                raise RegroupRestart(f"rank(s) {lost} did not join generation {generation}")
        missing = [m for m in members if not store.check(f"{prefix}ready/{m}")]
        if not missing:
            return
        late = time.monotonic() >= deadline
        if identity == 0:
            dead = [m for m in missing if is_alive is not None and not is_alive(m)]
            if dead or late:
                store.set(f"{prefix}abort", json.dumps(dead or missing))
                raise RegroupRestart(f"rank(s) {dead or missing} did not join generation {generation}"
                                     + (" (dead)" if dead else f" within {timeout:g} s"), dead or missing)
        elif late:
            raise RegroupRestart(f"generation {generation}: rank(s) {missing} did not join within {timeout:g} s")
        if cancelled is not None and cancelled():
            raise RecoveryCancelled("the server is stopping; the survivors' regroup was given up")
        time.sleep(0.005)


def join_group(store: SignedStore, generation: int, members: list[int], identity: int, backend: str,
               timeout: timedelta) -> int:
    """Join the survivors' new process group (the old one was left before the rendezvous, regroup);
    returns the new rank."""
    new_rank = members.index(identity)
    dist.init_process_group(backend, store=store.process_group_store(generation), rank=new_rank,
                            world_size=len(members), timeout=timeout)
    return new_rank


def refill_experts(runtime, new_plan: PlacementPlan, new_rank: int, read_experts) -> int:
    """Give every EP layer this rank's slots of `new_plan`: kept weights copied, the others read by
    `read_experts({moe layer: [expert, ...]}) -> {moe layer: (gate_up [n,H,2I], down [n,I,H])}`.
    Returns how many expert slots were read from the source."""
    old_local = runtime.placement.local_experts
    wanted: dict[int, list[int]] = {}
    per_layer = []
    for moe_index, layer in enumerate(runtime.layers):
        new_ids = [int(e) for e in new_plan.slots[moe_index][new_rank]]
        have = {e: j for j, e in enumerate(old_local[moe_index])}
        missing = sorted({e for e in new_ids if e not in have})
        if missing:
            wanted[int(new_plan.moe_layers[moe_index])] = missing
        per_layer.append((layer, new_ids, have, missing))
    fetched = read_experts(wanted) if wanted else {}
    read = 0
    with torch.no_grad():
        for (layer, new_ids, have, missing), moe_layer in zip(per_layer, new_plan.moe_layers):
            up, down = fetched.get(int(moe_layer), (None, None))
            ups, downs = [], []
            for e in new_ids:
                if e in have:  # rows of a kept expert: float, or a narrow one's elements and scales
                    ups.append(layer.gate_up_proj[have[e]].clone())
                    downs.append(layer.down_proj[have[e]].clone())
                else:
                    k = missing.index(e)
                    ups.append(up[k])
                    downs.append(down[k])
                    read += 1
            # in the layer's own form: float Parameters, or QuantizedTensors in its format (expert_rows.py)
            layer.gate_up_proj = stack_experts(ups, layer.gate_up_proj)
            layer.down_proj = stack_experts(downs, layer.down_proj)
    return read


def new_plan_of(store: SignedStore, generation: int, rank: int, compute, timeout: float,
                cancelled=None) -> PlacementPlan:
    """Rank 0 computes the survivors' plan and publishes it (signed); the others read it and refuse
    one a rank of this launch did not write."""
    key = f"g{generation}/plan"
    if rank == 0:
        plan = compute()
        store.set(key, plan.to_json())
        return plan
    return plan_from_dict(json.loads(store.wait_get(key, timeout, cancelled)))


@dataclass
class ElasticOptions:
    store: SignedStore  # the launch's rendezvous store (rank 0 hosts it): outlives every process group
    backend: str
    read_experts: object  # {moe layer: [experts]} -> {moe layer: (gate_up, down)}
    max_slots: int  # a survivor's expert slots, at most
    lanes: int = 1  # process-group lanes (2 with --ep-overlap)
    is_alive: object = None  # rank 0: identity -> is that process still running (the ranks it started)
    grace_s: float = 1.5  # without is_alive: how long rank 0 waits for survivors to register
    cancelled: object = None  # () -> bool: the server is stopping (rank 0): give the regroup up


def expert_reader(model: str | None, dtype, device, moe_backend: str, seed: int, quantize_experts: str | None = None):
    """Reads given experts' weights from the model's source (checkpoint slices, or the preset's seed),
    as the ranks hold them: in `quantize_experts` (--quantize-experts) when set, else as the checkpoint
    holds them (an FP8 / MXFP4 checkpoint's experts narrow, as read)."""
    from locus.engine.checkpoint.loader import load
    from locus.engine.model.slices import moe_experts

    def read(wanted: dict[int, list[int]]) -> dict[int, tuple]:
        slices = {layer: wanted.get(layer, []) for layer in loaded_layers()}
        source = load(model, dtype, device, moe_backend, seed, expert_slices=slices,
                      quantize_experts=quantize_experts).model
        return {layer: (e.gate_up_proj.detach(), e.down_proj.detach()) for layer, e in moe_experts(source).items()
                if layer in wanted}

    def loaded_layers():
        from locus.engine.checkpoint.loader import config_of

        return list(config_of(model).moe_layers)

    return read


def leave_groups(worker, timeout: timedelta | None = None) -> timedelta:
    """Leave every old process group, for good: drop this rank's every reference to them and destroy
    them, so their connections close and a peer blocked in a collective or a point-to-point send with
    this rank fails at once instead of at the timeout (a send only completes once its peer posts the
    receive; a survivor that left never will). Nothing else may hold a group (no cache keyed by one).
    Returns the groups' timeout (`timeout` when this rank holds none: a failed regroup attempt)."""
    runtime = worker.runtime
    if runtime.groups is not None:
        timeout = runtime.groups.timeout
    runtime.drop_lanes()  # (what they counted stays with the runtime)
    runtime.groups, worker.control = None, None
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a broken group may refuse a clean teardown
            pass
    gc.collect()
    return timeout


def lost_peer(exc: BaseException) -> bool:
    """Whether `exc` says a peer is gone or hung (a collective, the store or a regroup's rendezvous
    failed), which a regroup may survive, as opposed to a fault of this rank's own (a bug, a placement
    that does not fit, a disagreement between the ranks), which no regroup can repair. torch reports a
    gloo failure as a bare RuntimeError naming gloo's source; NCCL's and the store's as DistError."""
    if isinstance(exc, (LocusError, PlacementDisagreement)):
        return False
    if isinstance(exc, (dist.DistError, RegroupRestart, TimeoutError, ConnectionError)):
        return True
    if type(exc) is RuntimeError:
        text = str(exc)
        return any(mark in text for mark in ("/gloo/", "NCCL", "Connection closed", "Connection reset", "Timed out",
                                             "timed out", "Socket Timeout", "Broken pipe"))
    return False


def regroup(worker) -> dict[int, int]:
    """After a failed collective, on every survivor: leave the old group, meet the survivors, join their
    new group, re-plan onto them and refill this rank's expert slots. A member lost inside this
    (it dies or hangs before the new group stands) restarts the rendezvous without it, as a new
    generation. Returns {old rank: new rank} of the ranks serving before."""
    serving = list(worker.members)  # identities, in the old ranks' order
    timeout = leave_groups(worker)
    excluded: set[int] = set()
    for attempt in range(len(serving) + 1):
        worker.generation += 1
        failure = None
        try:
            _join_survivors(worker, timeout, excluded)
            return {serving.index(identity): k for k, identity in enumerate(worker.members)}
        except Exception as exc:  # noqa: BLE001 - sorted below: a peer lost inside the regroup, or not
            if not lost_peer(exc):
                raise
            if isinstance(exc, RegroupRestart) and worker.identity == 0 and len(exc.args) > 1:
                excluded.update(m for m in exc.args[1] if worker.elastic.is_alive is None or worker.elastic.is_alive(m))
            failure = f"{type(exc).__name__}: {exc}"
            forget_frames(exc)
        # outside the handler: the failed attempt's frames (and any group it made) are gone
        log.warning("generation %d: the regroup failed (%s); restarting it without the lost rank(s)", worker.generation,
                    failure)
        leave_groups(worker, timeout)
    raise LocusError(f"the survivors could not regroup in {len(serving) + 1} attempts")


def _join_survivors(worker, timeout: timedelta, excluded: set[int]) -> None:
    """One attempt of regroup (generation `worker.generation`)."""
    from locus.engine.model.slices import expert_memory

    opts, runtime = worker.elastic, worker.runtime
    generation, seconds = worker.generation, timeout.total_seconds()
    current = runtime.placement
    members, top_epoch = rendezvous_members(opts.store, generation, worker.identity, worker.members, opts.grace_s,
                                            seconds, opts.is_alive, current.epoch, opts.cancelled, excluded)
    join_s = min(seconds, JOIN_TIMEOUT_S)
    ready_barrier(opts.store, generation, worker.identity, members, seconds, opts.is_alive, opts.cancelled)
    # Everyone is here: torch's rendezvous and the groups' take well under a second. A member that dies
    # inside them stalls the others for join_s, not --ep-timeout; the groups then get --ep-timeout back.
    join = timedelta(seconds=join_s)
    new_rank = join_group(opts.store, generation, members, worker.identity, opts.backend, join)
    placed = worker.members  # the identities the current placement's ranks are
    plan = new_plan_of(opts.store, generation, new_rank,
                       lambda: plan_onto(current.plan, [placed.index(i) for i in members], opts.max_slots),
                       seconds, opts.cancelled)
    topo = plan.topology
    groups = make_groups(topo.nodes, topo.gpus_per_node, opts.lanes, join, runtime.loop_nice)
    set_timeout(groups, timeout)
    read = refill_experts(runtime, plan, new_rank, opts.read_experts)
    device = current.start.device
    runtime.regroup(groups, plan, new_rank, top_epoch + 1, device)
    runtime.check_weights()
    if runtime.memory is not None:
        runtime.memory = expert_memory(worker.core.model)
        worker.expert_bytes = runtime.memory.held_bytes
    worker.control = ControlPlane(groups.control, new_rank, len(members))
    worker.rank, worker.world, worker.members = new_rank, len(members), members
    log.warning("generation %d: rank %d (was identity %d) of %d survivors %s, topology %s, %d expert slots read from "
                "the model", generation, new_rank, worker.identity, len(members), members, topo, read)
