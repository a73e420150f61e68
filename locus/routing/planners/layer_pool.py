"""Worker processes that place the MoE layers of one plan side by side (`locus plan --workers N`), and score
its requests' expected inter-node bytes node by node.

Within a round every layer is placed from its own node demand [N, E] and cap (locality.place_layer,
sketch_layer for the domain layouts' comparison, slot_search.enforce_cap for the node-aware
calibration's re-searches), independently of the others, and the cap search
that is most of a plan's time runs on one core per layer. A LayerPool forks its workers once per plan
(the fork start method, Linux) and every round's layers go through them.

The round's demand [L, N, E] is written into one anonymous shared memory map made before the workers
fork, so a task carries a layer index and its cap, and a worker reads the layer from the map: no copy
of the demand is pickled per task. Results come back in the order the layers were given, so the
caller settles caps and raises the unmeetable-cap error in the same order as in-process, and the
plan is byte-identical for any worker count (each layer is computed by the same code on the same
numbers). A LocusError raised in a worker reaches the caller as that LocusError; a worker that dies
(killed, out of memory) ends the plan with an error saying so, not a hang.

The expected-bytes scores that choose between layouts and rounds (summary.expected_bytes_per_token: each
node's requests against that node's columns of the cost model's route table) and the grouper's per-chunk
scores (simulation.run_grouper) are independent per node and per chunk too: the route table [L, E, N * N]
goes into a second shared map, the planning signatures are inherited at the fork, and a task names a
node or a chunk. Each figure is computed by the same code on the same numbers as in-process, bit for bit.

workers = 1 places and scores in-process, with no pool and no map.
"""

from __future__ import annotations

import dataclasses
import itertools
import mmap
import multiprocessing
import os
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Iterator, NamedTuple

import numpy as np

from locus.errors import LocusError
from locus.routing.grouping.node_cost import NodeCostModel
from locus.routing.grouping.signatures import RequestSignatures
from locus.routing.planners.locality import LayerPlacement, place_layer, sketch_layer
from locus.routing.planners.slot_search import enforce_cap

# Below this many (layer, rank, expert) cells (both presets at 4x8 and below) a plan's placement takes a
# few seconds, where forking the planner and feeding workers buys little: the default (workers=None)
# plans such plans in-process, as does any small test trace.
POOL_MIN_CELLS = 1 << 19


class Shared(NamedTuple):
    demand: np.ndarray  # [L, N, E] float64 over the pool's first map
    route: np.ndarray  # [L, E, N * N] float32 over its second
    signatures: RequestSignatures | None  # the plan's planning requests (read-only)


# Each pool's shared arrays, by pool id, set before its workers fork so that they inherit them.
_SHARED: dict[int, Shared] = {}
_NEXT_ID = itertools.count()


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity call on this platform
        return os.cpu_count() or 1


def pool_workers(requested: int | None, layers: int, ranks: int, experts: int) -> int:
    """The worker processes for a plan of `layers` MoE layers: `requested` (at least 1: PlanOptions checks
    it), else the CPUs this process may use, or 1 where the placement is small (POOL_MIN_CELLS); never more
    than the layers."""
    if requested is not None:
        wanted = requested
    elif layers * ranks * experts < POOL_MIN_CELLS:
        wanted = 1
    else:
        wanted = available_cpus()
    return max(1, min(wanted, layers))


class LayerPool:
    """Places the layers of demand arrays shaped `shape` [L, N, E] in `workers` processes, and scores
    `signatures` (the plan's planning requests) under cost models of L layers, E experts and N nodes; a
    context manager (the workers are stopped on leaving it, also on an error)."""

    def __init__(self, shape: tuple[int, int, int], workers: int, signatures: RequestSignatures | None = None):
        self.shape = tuple(int(s) for s in shape)
        self.workers = int(workers)
        self.signatures = signatures
        self._id = next(_NEXT_ID)
        self._maps: list[mmap.mmap] = []
        self._shared: Shared | None = None
        self._executor: ProcessPoolExecutor | None = None
        if self.workers > 1 and "fork" not in multiprocessing.get_all_start_methods():
            self.workers = 1  # the shared maps reach workers only through fork: work in-process
        if self.workers > 1:
            L, N, E = self.shape
            demand = self._array((L, N, E), np.float64)
            self._shared = Shared(demand, self._array((L, E, N * N), np.float32), signatures)

    def _array(self, shape: tuple[int, ...], dtype) -> np.ndarray:
        size = int(np.prod(shape)) * np.dtype(dtype).itemsize
        self._maps.append(mmap.mmap(-1, max(1, size)))  # MAP_SHARED | MAP_ANONYMOUS: seen by forked workers
        return np.frombuffer(self._maps[-1], dtype=dtype, count=int(np.prod(shape))).reshape(shape)

    def __enter__(self) -> LayerPool:
        return self

    def __exit__(self, exc_type, *_) -> None:
        self.close(abort=exc_type is not None)

    def close(self, abort: bool = False) -> None:
        """Stop the workers and release the maps. `abort` (the plan ended on an error, such as a cap that
        cannot be met): the layers being placed are dropped at once instead of waited for."""
        if self._executor is not None:
            if abort:  # the executor has no public call for this before Python 3.14 (terminate_workers)
                for process in list(getattr(self._executor, "_processes", {}).values()):
                    process.terminate()
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None
        _SHARED.pop(self._id, None)
        self._shared = None
        for m in self._maps:
            m.close()
        self._maps = []

    def place(self, demand: np.ndarray, layers, caps, gpus: int, slots_per_gpu: int, budget: str,
              top_k: int) -> Iterator[LayerPlacement]:
        """place_layer(demand[l], ..., caps[l], ...) for each l of `layers`, yielded in that order."""
        tasks = [(int(l), float(caps[l])) for l in layers]
        if self.workers <= 1:
            for l, cap in tasks:
                yield place_layer(demand[l], gpus, slots_per_gpu, cap, budget, top_k)
            return
        self._write_demand(demand)
        yield from self._run(_place_task, [(l, cap, gpus, slots_per_gpu, budget, top_k) for l, cap in tasks])

    def sketch(self, demand: np.ndarray, cap: float, gpus: int, slots_per_gpu: int, budget: str,
               top_k: int) -> np.ndarray:
        """Slots [L, R, S]: sketch_layer of every layer of demand [L, N, E]."""
        L = demand.shape[0]
        if self.workers <= 1:
            return np.stack([sketch_layer(demand[l], gpus, slots_per_gpu, cap, budget, top_k) for l in range(L)])
        self._write_demand(demand)
        tasks = [(l, float(cap), gpus, slots_per_gpu, budget, top_k) for l in range(L)]
        return np.stack(list(self._run(_sketch_task, tasks)))

    def enforce(self, demand: np.ndarray, searches: list[tuple[int, np.ndarray, float, np.ndarray]],
                gpus: int) -> Iterator[np.ndarray]:
        """enforce_cap(demand[l], slots, gpus, target, pull=pull) for each (l, slots, target, pull) of
        `searches` (the node-aware calibration's re-searches), yielded in that order."""
        if self.workers <= 1:
            for l, slots, target, pull in searches:
                yield enforce_cap(demand[l], slots, gpus, target, pull=pull)
            return
        self._write_demand(demand)
        yield from self._run(_enforce_task, [(l, slots, target, pull, gpus) for l, slots, target, pull in searches])

    def bytes_on(self, cost: NodeCostModel, signatures: RequestSignatures, phase: str,
                 node: np.ndarray) -> np.ndarray:
        """cost.expected_bytes_on(signatures.<phase>, node), [R] (phase "prefill" or "decode"): each node's
        requests scored in a worker when `signatures` are the pool's."""
        counts = getattr(signatures, phase)
        node = np.asarray(node)
        if not self._shares(cost, signatures):
            return cost.expected_bytes_on(counts, node)
        nodes = np.unique(node)
        rows = [np.flatnonzero(node == n) for n in nodes]
        fields = self._write_route(cost)
        out = np.empty(len(node), dtype=np.float64)
        results = self._run(_bytes_on_task, [(fields, phase, r, int(n)) for n, r in zip(nodes, rows)])
        for r, values in zip(rows, results):
            out[r] = values
        return out

    def chunk_bytes(self, cost: NodeCostModel, signatures: RequestSignatures,
                    bounds: list[tuple[int, int]]) -> Iterator[np.ndarray]:
        """cost.expected_bytes(signatures.prefill[lo:hi]) for each (lo, hi) of `bounds`, in that order."""
        if not self._shares(cost, signatures):
            for lo, hi in bounds:
                yield cost.expected_bytes(signatures.prefill[lo:hi])
            return
        fields = self._write_route(cost)
        yield from self._run(_chunk_bytes_task, [(fields, lo, hi) for lo, hi in bounds])

    def _shares(self, cost: NodeCostModel, signatures: RequestSignatures) -> bool:
        return (self.workers > 1 and signatures is self.signatures
                and cost.route.shape == self._shared.route.shape)

    def _write_demand(self, demand: np.ndarray) -> None:
        if demand.shape != self.shape:
            raise ValueError(f"demand shaped {demand.shape}, the pool's map {self.shape}")
        self._shared.demand[...] = demand  # the previous call's tasks are all done: calls run one at a time

    def _write_route(self, cost: NodeCostModel) -> NodeCostModel:
        """The cost model's route into the shared map; the model without it, for the tasks."""
        self._shared.route[...] = cost.route
        return dataclasses.replace(cost, route=np.empty((0,), np.float32))

    def _run(self, task, tasks: list[tuple]) -> Iterator:
        executor = self._start()
        futures: list[Future] = [executor.submit(task, self._id, *args) for args in tasks]
        try:
            for future in futures:
                try:
                    yield future.result()
                except BrokenProcessPool:  # every unfinished task fails with it, so no one task is named
                    raise LocusError(f"a planner worker process died ({self.workers} workers placing layers and "
                                     f"scoring requests; killed, or out of memory?); plan again, with --workers 1 "
                                     f"to plan in this process") from None
        finally:
            for future in futures:  # an error or an early stop: the tasks not started are dropped
                future.cancel()

    def _start(self) -> ProcessPoolExecutor:
        if self._executor is None:
            _SHARED[self._id] = self._shared  # inherited by the workers forked now
            self._executor = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("fork"))
        return self._executor


def _place_task(pool: int, layer: int, cap: float, gpus: int, slots_per_gpu: int, budget: str,
                top_k: int) -> LayerPlacement:
    return place_layer(_SHARED[pool].demand[layer], gpus, slots_per_gpu, cap, budget, top_k)


def _sketch_task(pool: int, layer: int, cap: float, gpus: int, slots_per_gpu: int, budget: str,
                 top_k: int) -> np.ndarray:
    return sketch_layer(_SHARED[pool].demand[layer], gpus, slots_per_gpu, cap, budget, top_k)


def _enforce_task(pool: int, layer: int, slots: np.ndarray, target: float, pull: np.ndarray,
                  gpus: int) -> np.ndarray:
    return enforce_cap(_SHARED[pool].demand[layer], slots, gpus, target, pull=pull)


def _bytes_on_task(pool: int, fields: NodeCostModel, phase: str, rows: np.ndarray, n: int) -> np.ndarray:
    shared = _SHARED[pool]
    cost = dataclasses.replace(fields, route=shared.route)
    return cost.bytes_on_node(getattr(shared.signatures, phase), rows, n)


def _chunk_bytes_task(pool: int, fields: NodeCostModel, lo: int, hi: int) -> np.ndarray:
    shared = _SHARED[pool]
    return dataclasses.replace(fields, route=shared.route).expected_bytes(shared.signatures.prefill[lo:hi])
