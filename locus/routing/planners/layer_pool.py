"""Worker processes that place the MoE layers of one plan side by side (`locus plan --workers N`).

Within a round every layer is placed from its own node demand [N, E] and cap (locality.place_layer,
or sketch_layer for the domain layouts' comparison), independently of the others, and the cap search
that is most of a plan's time runs on one core per layer. A LayerPool forks its workers once per plan
(the fork start method, Linux) and every round's layers go through them.

The round's demand [L, N, E] is written into one anonymous shared memory map made before the workers
fork, so a task carries a layer index and its cap, and a worker reads the layer from the map: no copy
of the demand is pickled per task. Results come back in the order the layers were given, so the
caller settles caps and raises the unmeetable-cap error in the same order as in-process, and the
plan is byte-identical for any worker count (each layer is computed by the same code on the same
numbers). A LocusError raised in a worker reaches the caller as that LocusError; a worker that dies
(killed, out of memory) ends the plan with an error saying so, not a hang.

workers = 1 places in-process, with no pool and no map.
"""

from __future__ import annotations

import itertools
import mmap
import multiprocessing
import os
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Iterator

import numpy as np

from locus.errors import LocusError
from locus.routing.planners.locality import LayerPlacement, place_layer, sketch_layer

# Below this many (layer, rank, expert) cells a plan's placement takes a few seconds at most, which
# forking and feeding workers would not repay: the default (workers=None) places such plans in-process.
POOL_MIN_CELLS = 1 << 19

# Each pool's demand map, by pool id, set before its workers fork so that they inherit the view.
_SHARED: dict[int, np.ndarray] = {}
_NEXT_ID = itertools.count()


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity call on this platform
        return os.cpu_count() or 1


def pool_workers(requested: int | None, layers: int, ranks: int, experts: int) -> int:
    """The worker processes for a plan of `layers` MoE layers: `requested` (at least 1), else the CPUs this
    process may use, or 1 where the placement is small (POOL_MIN_CELLS); never more than the layers."""
    if requested is not None:
        if requested < 1:
            raise LocusError(f"--workers must be at least 1, got {requested}")
        wanted = requested
    elif layers * ranks * experts < POOL_MIN_CELLS:
        wanted = 1
    else:
        wanted = available_cpus()
    return max(1, min(wanted, layers))


class LayerPool:
    """Places the layers of demand arrays shaped `shape` [L, N, E] in `workers` processes; a context manager
    (the workers are stopped on leaving it, also on an error)."""

    def __init__(self, shape: tuple[int, int, int], workers: int):
        self.shape = tuple(int(s) for s in shape)
        self.workers = int(workers)
        self._id = next(_NEXT_ID)
        self._map: mmap.mmap | None = None
        self._demand: np.ndarray | None = None
        self._executor: ProcessPoolExecutor | None = None
        if self.workers > 1:
            if "fork" not in multiprocessing.get_all_start_methods():
                self.workers = 1  # the shared map reaches workers only through fork; place in-process
            else:
                self._map = mmap.mmap(-1, max(1, int(np.prod(self.shape)) * 8))  # MAP_SHARED | MAP_ANONYMOUS
                self._demand = np.frombuffer(self._map, dtype=np.float64).reshape(self.shape)

    def __enter__(self) -> LayerPool:
        return self

    def __exit__(self, exc_type, *_) -> None:
        self.close(abort=exc_type is not None)

    def close(self, abort: bool = False) -> None:
        """Stop the workers and release the map. `abort` (the plan ended on an error, such as a cap that cannot
        be met): the layers being placed are dropped at once instead of waited for."""
        if self._executor is not None:
            if abort:  # the executor has no public call for this before Python 3.14 (terminate_workers)
                for process in list(getattr(self._executor, "_processes", {}).values()):
                    process.terminate()
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None
        _SHARED.pop(self._id, None)
        self._demand = None
        if self._map is not None:
            self._map.close()
            self._map = None

    def place(self, demand: np.ndarray, layers, caps, gpus: int, slots_per_gpu: int, budget: str,
              top_k: int) -> Iterator[LayerPlacement]:
        """place_layer(demand[l], ..., caps[l], ...) for each l of `layers`, yielded in that order."""
        args = (gpus, slots_per_gpu, budget, top_k)
        tasks = [(int(l), float(caps[l])) for l in layers]
        if self.workers <= 1:
            for l, cap in tasks:
                yield place_layer(demand[l], gpus, slots_per_gpu, cap, budget, top_k)
            return
        yield from self._run(_place_task, demand, tasks, args)

    def sketch(self, demand: np.ndarray, cap: float, gpus: int, slots_per_gpu: int, budget: str,
               top_k: int) -> np.ndarray:
        """Slots [L, R, S]: sketch_layer of every layer of demand [L, N, E]."""
        L = demand.shape[0]
        if self.workers <= 1:
            return np.stack([sketch_layer(demand[l], gpus, slots_per_gpu, cap, budget, top_k) for l in range(L)])
        tasks = [(l, float(cap)) for l in range(L)]
        return np.stack(list(self._run(_sketch_task, demand, tasks, (gpus, slots_per_gpu, budget, top_k))))

    def _run(self, task, demand: np.ndarray, tasks: list[tuple[int, float]], args: tuple) -> Iterator:
        if demand.shape != self.shape:
            raise ValueError(f"demand shaped {demand.shape}, the pool's map {self.shape}")
        self._demand[...] = demand  # before any task of this call is submitted; the previous call's are done
        executor = self._start()
        futures: list[Future] = [executor.submit(task, self._id, l, cap, *args) for l, cap in tasks]
        try:
            for future in futures:
                try:
                    yield future.result()
                except BrokenProcessPool:  # every unfinished layer fails with it, so no one layer is named
                    raise LocusError(f"a planner worker process died while placing a round's layers ({self.workers} "
                                     f"workers; killed, or out of memory?); plan again, with --workers 1 to place "
                                     f"in this process") from None
        finally:
            for future in futures:  # an error or an early stop: the layers not started are dropped
                future.cancel()

    def _start(self) -> ProcessPoolExecutor:
        if self._executor is None:
            _SHARED[self._id] = self._demand  # inherited by the workers forked now
            self._executor = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("fork"))
        return self._executor


def _place_task(pool: int, layer: int, cap: float, gpus: int, slots_per_gpu: int, budget: str,
                top_k: int) -> LayerPlacement:
    return place_layer(_SHARED[pool][layer], gpus, slots_per_gpu, cap, budget, top_k)


def _sketch_task(pool: int, layer: int, cap: float, gpus: int, slots_per_gpu: int, budget: str,
                 top_k: int) -> np.ndarray:
    return sketch_layer(_SHARED[pool][layer], gpus, slots_per_gpu, cap, budget, top_k)
