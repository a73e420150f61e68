"""Starting an expert-parallel server: which rank this process is, the process group, the plan.

Two ways in, one code path:
- `torchrun --nnodes N --nproc-per-node G ... -m locus.cli serve ...`: every process reads RANK,
  WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT from the environment torchrun sets;
- `locus serve --ep-ranks N [--gpus-per-node G]`: this process becomes rank 0 and starts ranks
  1..N-1 as child processes of the same command, with the same environment torchrun would give.
Rank 0 serves HTTP; the other ranks run the engine loop only (locus/engine/ep/ranks/worker.py).
"""

from __future__ import annotations

import logging
import math
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from locus.engine.checkpoint.loader import LoadedModel, config_of, default_device, load
from locus.engine.ep.groups import make_groups, set_timeout
from locus.engine.ep.invariant import share_fingerprints
from locus.engine.ep.layer import apply_expert_parallel
from locus.engine.ep.ranks.rendezvous import (SECRET_ENV, SignedStore, launch_secret, local_address_towards, loopback_listener,
                                        new_secret, open_store, pin_transport_interface, set_current)
from locus.engine.ep.runtime import MODES, EPRuntime
from locus.engine.model.slices import expert_memory, slices_of
from locus.engine.model.config import ModelConfig
from locus.errors import LocusError
from locus.flags import check_range
from locus.kernels.formats import PAYLOAD_FORMATS
from locus.routing.plan.placement import PlacementPlan, PlanError, check_fit, load_plan
from locus.routing.plan.topology import Topology
from locus.routing.planners.baselines import round_robin

log = logging.getLogger("locus.engine")
SPAWNED = "LOCUS_EP_SPAWNED"  # set in the children `--ep-ranks` starts
PARENT_ENV = "LOCUS_EP_PARENT"  # in those children: rank 0's process id (follow_parent)
STARTUP_TIMEOUT_S = 300.0  # how long start-up waits for every rank (at least --ep-timeout)


@dataclass
class EPSetup:
    rank: int
    world: int
    gpus_per_node: int
    timeout_s: float
    plan_path: str | None
    mode: str = "exact"  # the MoE exchange's transport (runtime.MODES)
    max_tokens_per_rank: int = 256  # the fixed-capacity transport's bound (larger steps go exact)
    overlap: bool = False  # two micro-batches a step, on two lanes (runtime.py)
    replan_every: str | None = None  # live re-planning schedule (replan.ReplanSchedule), None: off
    replan_api: bool = False  # POST /ep/replan
    replan_window: int = 4096  # tokens of routing each rank keeps for a re-plan
    replan_layers_per_step: int = 1  # MoE layers a placement move switches per iteration
    elastic: bool = False  # survive a lost rank (elastic.py)
    max_slots: int | None = None  # a survivor's expert slots at most (default: every expert)
    loop_nice: int = 19  # gloo's event-loop threads' nice value (loop_priority.py); 0 leaves them
    is_alive: object = None  # rank 0 of --ep-ranks: rank -> is its process running (set once spawned)
    listener: object = None  # rank 0 of --ep-ranks: the store's listening socket, bound before the ranks start
    rendezvous: SignedStore | None = None  # the launch's store, once joined (load_rank)
    moves: bool = False  # move requests after their prefill when the plan's grouper says it pays (--ep-moves)
    dispatch_format: str = "model"  # how dispatched rows travel (payload.py): model, mxfp8, mxint8
    combine_format: str = "model"  # how the partial sums travel back
    plan: PlacementPlan | None = None  # the --plan as this process's CLI loaded (and checked) it; None: read plan_path

    @property
    def replanning(self) -> bool:
        return self.replan_every is not None or self.replan_api

    @property
    def nodes(self) -> int:
        return self.world // self.gpus_per_node


def setup_from(ep_ranks: int, gpus_per_node: int | None, timeout_s: float, plan_path: str | None,
               mode: str = "exact", max_tokens_per_rank: int = 256, overlap: bool = False,
               replan_every: str | None = None, replan_api: bool = False, replan_window: int = 4096,
               replan_layers_per_step: int = 1, elastic: bool = False, max_slots: int | None = None,
               loop_nice: int = 19, dispatch_format: str = "model", combine_format: str = "model") -> EPSetup | None:
    """The setup the launcher's environment (torchrun, or our own spawn) or the flags describe;
    None for a single-process server."""
    from locus.engine.ep.rebalance.replan import ReplanSchedule

    ReplanSchedule.parse(replan_every)  # a bad schedule fails here, before any process starts
    # `locus serve` checked these flags already (locus.server.cli.SERVE_FLAGS); other callers get the same words
    check_range("--replan-window", replan_window, 1)
    check_range("--replan-layers-per-step", replan_layers_per_step, 1)
    if mode not in MODES:
        raise LocusError(f"--ep-exchange {mode!r}: choose one of {', '.join(MODES)}")
    check_range("--ep-max-tokens-per-rank", max_tokens_per_rank, 1)
    check_range("--ep-timeout", timeout_s, 0, positive=True, unit="seconds")
    check_range("--ep-loop-nice", loop_nice, 0, 19)  # below 0 needs privileges a server should not ask for
    for flag, fmt in (("--ep-dispatch-format", dispatch_format), ("--ep-combine-format", combine_format)):
        if fmt not in PAYLOAD_FORMATS:
            raise LocusError(f"{flag} {fmt!r}: choose one of {', '.join(PAYLOAD_FORMATS)}")
    options = dict(mode=mode, max_tokens_per_rank=max_tokens_per_rank, overlap=overlap, replan_every=replan_every,
                   replan_api=replan_api, replan_window=replan_window, replan_layers_per_step=replan_layers_per_step,
                   elastic=elastic, max_slots=max_slots, loop_nice=loop_nice, dispatch_format=dispatch_format,
                   combine_format=combine_format)
    check_range("--ep-max-slots", max_slots, 1)
    env = os.environ
    if "WORLD_SIZE" in env and int(env["WORLD_SIZE"]) > 1:
        world, local = int(env["WORLD_SIZE"]), int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"]))
        if world % local:
            raise LocusError(f"WORLD_SIZE {world} is not a multiple of LOCAL_WORLD_SIZE {local}")
        if elastic and SPAWNED not in env:
            raise LocusError("--ep-elastic needs the ranks --ep-ranks starts: a torchrun agent stops (or restarts) all "
                             "of its workers when one fails; use torchrun's own --max-restarts there")
        return EPSetup(int(env["RANK"]), world, local, timeout_s, plan_path, **options)
    if ep_ranks <= 1:
        return None
    g = gpus_per_node or ep_ranks
    if ep_ranks % g:
        raise LocusError(f"--ep-ranks {ep_ranks} is not a multiple of --gpus-per-node {g}")
    return EPSetup(0, ep_ranks, g, timeout_s, plan_path, **options)


def spawn_local_ranks(setup: EPSetup) -> list[subprocess.Popen]:
    """Rank 0 of `--ep-ranks`: start ranks 1..N-1 as this command's children (torchrun's env), with the
    launch's secret; the store's socket is bound (to 127.0.0.1) before any of them starts."""
    setup.listener = loopback_listener()
    port = setup.listener.getsockname()[1]
    base = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(setup.world),
            "LOCAL_WORLD_SIZE": str(setup.gpus_per_node), SPAWNED: "1", SECRET_ENV: new_secret()}
    os.environ.update({**base, "RANK": "0", "LOCAL_RANK": "0"})
    children = []
    setup.is_alive = lambda rank: rank == 0 or children[rank - 1].poll() is None
    for rank in range(1, setup.world):
        env = {**os.environ, **base, "RANK": str(rank), "LOCAL_RANK": str(rank % setup.gpus_per_node),
               PARENT_ENV: str(os.getpid())}
        children.append(subprocess.Popen([sys.executable, *_this_command(), *sys.argv[1:]], env=env,
                                         stdin=subprocess.DEVNULL))
    return children


def watch_start(children: list[subprocess.Popen], done: Callable[[], bool], on_exit: Callable[[], None]) -> None:
    """Rank 0 of `--ep-ranks`: a launch is whole or nothing. Until `done()` (serving, or stopping),
    a rank that exits calls `on_exit` (the server stops, and ends the other ranks), since the rest
    of the launch would otherwise wait for it in the rendezvous for up to STARTUP_TIMEOUT_S."""
    if not children:  # under torchrun the agent watches its workers
        return

    def watch() -> None:
        while not done():
            if any(child.poll() is not None for child in children):
                on_exit()
                return
            time.sleep(0.2)

    threading.Thread(target=watch, name="locus-ep-start", daemon=True).start()


def exited_ranks(children: list[subprocess.Popen]) -> str | None:
    """The ranks rank 0 started that have exited, with their status ("rank 1 (status 1)"), or None."""
    gone = [f"rank {rank} (status {child.returncode})" for rank, child in enumerate(children, 1)
            if child.poll() is not None]
    return ", ".join(gone) or None


def follow_parent(rank: int) -> None:
    """A rank `--ep-ranks` started: never outlive rank 0, however it ended (killed at start-up, say,
    before it could tell this rank to stop, which would leave this one waiting in the rendezvous).
    The parent's id comes from the environment: it may be gone already when this runs."""
    parent = int(os.environ[PARENT_ENV])

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        log.error("rank %d stops: rank 0 (process %d) is gone", rank, parent)
        logging.shutdown()
        os._exit(1)

    threading.Thread(target=watch, name="locus-ep-parent", daemon=True).start()


def _this_command() -> list[str]:
    """How this process was started, for its sibling ranks: `-m locus.cli` when it was that module
    (run as a script, its folder would shadow top-level modules), else the same script (the `locus`
    entry point, or a wrapper such as a test's fault-injecting one)."""
    script = sys.argv[0]
    cli = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "cli.py")
    if not script or not os.path.isfile(script) or os.path.abspath(script) == cli:
        return ["-m", "locus.cli"]
    return [script]


def load_rank(setup: EPSetup, model: str | None, dtype: str | None = None, device: str | None = None,
              moe_backend: str = "auto", seed: int = 0, quantize_experts: str | None = None) -> tuple[LoadedModel, EPRuntime]:
    """This rank's model, holding only its slots' experts (read as slices: the others are never
    loaded; `quantize_experts`: held in that narrow format, each rank quantizing its own), joined to
    the process group, with the plan applied. Logs the expert memory held."""
    config = config_of(model)
    plan = plan_for(setup, config)
    try:  # before any weight: a plan for another model says what does not fit, from every rank alike
        check_fit(plan, num_experts=config.num_local_experts, moe_layers=list(config.moe_layers))
    except PlanError as exc:
        where = setup.plan_path or "the placement plan"
        raise LocusError(f"{where} does not fit the model {model or 'tiny'}: {exc}") from None
    if setup.elastic:  # refuse now what a loss would refuse later: survivors must be able to hold every expert
        from locus.engine.ep.ranks.elastic import survivor_slots

        E = config.num_local_experts
        try:
            survivor_slots(E, plan.topology.slots_per_gpu, setup.world - 1, setup.max_slots or E)
        except LocusError as exc:
            raise LocusError(f"--ep-elastic: after losing one of {setup.world} ranks, {exc}") from None
    device = device or default_device()
    backend = "nccl" if str(device).startswith("cuda") else "gloo"
    timeout = timedelta(seconds=setup.timeout_s)
    # Start-up (every rank connecting, loading its weights, making the groups) may take longer than a
    # collective may while serving: it waits up to STARTUP_TIMEOUT_S, then the groups get --ep-timeout.
    startup = timedelta(seconds=max(setup.timeout_s, STARTUP_TIMEOUT_S))
    join_launch(setup, backend, startup)
    loaded = load(model, dtype, device, moe_backend, seed, expert_slices=slices_of(plan, setup.rank),
                  quantize_experts=quantize_experts)
    topo = plan.topology
    groups = make_groups(topo.nodes, topo.gpus_per_node, 2 if setup.overlap else 1, startup, setup.loop_nice)
    runtime = apply_expert_parallel(loaded.model, plan, groups, setup.mode, setup.max_tokens_per_rank,
                                    dispatch_format=setup.dispatch_format, combine_format=setup.combine_format)
    runtime.fingerprints = share_fingerprints(runtime, groups.control, config.num_local_experts)
    set_timeout(groups, timeout)
    setup.rendezvous.store.set_timeout(timeout)
    runtime.memory = expert_memory(loaded.model)
    log.info("rank %d of %d (node %d, local %d): %s", setup.rank, setup.world, groups.node, groups.local,
             runtime.memory.describe())
    return loaded, runtime


def join_launch(setup: EPSetup, backend: str, timeout: timedelta) -> SignedStore:
    """Open the launch's store on the launch's address (rendezvous.py), put the transports' sockets on
    the same interface, and join the process group; the store is kept as `setup.rendezvous`."""
    pin_transport_interface(local_address_towards(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])))
    store = open_store(setup.rank, setup.world, timeout, setup.listener)
    setup.listener = None
    setup.rendezvous = SignedStore(store, launch_secret())
    set_current(setup.rendezvous)
    dist.init_process_group(backend, store=setup.rendezvous.process_group_store(0), rank=setup.rank,
                            world_size=setup.world, timeout=timeout)
    return setup.rendezvous


def plan_for(setup: EPSetup, config: ModelConfig) -> PlacementPlan:
    """The --plan (its topology must be the launch's), or round-robin over the launch's topology."""
    if setup.plan_path is None:
        slots = math.ceil(config.num_local_experts / setup.world)
        return round_robin(config.num_local_experts, config.moe_layers, Topology(setup.nodes, setup.gpus_per_node, slots))
    plan = setup.plan if setup.plan is not None else load_plan(setup.plan_path)  # the file is checked once
    topo = plan.topology
    if (topo.nodes, topo.gpus_per_node) != (setup.nodes, setup.gpus_per_node):
        raise LocusError(f"{setup.plan_path}: the plan is for {topo.nodes}x{topo.gpus_per_node} ranks, but this launch "
                         f"has {setup.nodes}x{setup.gpus_per_node} (WORLD_SIZE / LOCAL_WORLD_SIZE, or --ep-ranks / --gpus-per-node)")
    return plan


def rank_trace_path(path: str, rank: int) -> str:
    """Where rank `rank` records its own requests under `--record-trace PATH` (rank 0 merges them)."""
    return f"{path.rstrip('/')}.rank{rank}"

