"""Layers placed in worker processes (layer_pool.py): the same plan for any worker count, a worker's error
reaching the caller, a killed worker ending the plan with an error instead of a hang."""

import multiprocessing
import os
import signal
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import pytest

from locus.errors import LocusError
from locus.routing.plan.caps import Caps
from locus.routing.plan.topology import Topology
from locus.routing.planners import layer_pool
from locus.routing.planners.layer_pool import LayerPool, available_cpus, pool_workers
from locus.routing.planners.locality import place_layer
from locus.routing.planners.planner import PlanOptions, make_plan
from locus.traces.reader import TraceReader

from tests.routing.planners.planner_fixtures import synth_trace


@pytest.fixture(scope="module")
def reader(tmp_path_factory):
    return TraceReader(synth_trace(tmp_path_factory.mktemp("pool") / "t", requests=240, seed=5, experts=32,
                                   top_k=2, layers=(1, 3, 5, 7, 9)))


class CountingExecutor(ProcessPoolExecutor):
    submitted: list[str] = []  # the task functions, in submission order

    def submit(self, fn, *args, **kwargs):
        CountingExecutor.submitted.append(fn.__name__)
        return super().submit(fn, *args, **kwargs)


def figures(result) -> dict:
    summary = result.summary.to_dict()
    summary.pop("plan_seconds")
    provenance = {k: v for k, v in result.plan.provenance.items() if k not in ("created", "plan_seconds")}
    return {"summary": summary, "grouping": result.plan.grouping, "provenance": provenance,
            "ranks": result.assignment.ranks.tolist(),
            "decode": None if result.assignment.decode_ranks is None else result.assignment.decode_ranks.tolist()}


@pytest.mark.parametrize("topology, cap, auto, budget", [
    (Topology(4, 2, 5), 1.05, True, "top"),  # auto: caps settled from what each layer's search reached
    (Topology(4, 2, 5), 1.25, False, "top"),
    (Topology(2, 4, 5), 1.10, True, "marginal"),
    (Topology(8, 2, 3), 1.05, True, "marginal"),  # the node-aware calibration re-searches layers
])
def test_plans_are_the_same_for_any_worker_count(reader, monkeypatch, topology, cap, auto, budget):
    monkeypatch.setattr(layer_pool, "ProcessPoolExecutor", CountingExecutor)
    plans = {}
    for workers in (1, 2):
        CountingExecutor.submitted = []
        options = PlanOptions(caps=Caps(expert=cap), expert_cap_auto=auto, replica_budget=budget, workers=workers)
        plans[workers] = make_plan("locality", reader, topology, (0, 200), options)
        # workers=1 places and scores in this process; 2 sends the workers every layer of both rounds, the
        # layouts' sketches, each node's expected-bytes scores and the grouper's chunks
        if workers == 1:
            assert CountingExecutor.submitted == []
        else:
            tasks = CountingExecutor.submitted
            assert tasks.count("_place_task") >= 2 * len(reader.meta.moe_layers)
            assert {"_sketch_task", "_bytes_on_task", "_chunk_bytes_task"} <= set(tasks)
            assert ("_enforce_task" in tasks) == (topology.nodes == 8)
    np.testing.assert_array_equal(plans[1].plan.slots, plans[2].plan.slots)
    assert figures(plans[1]) == figures(plans[2])


def demand_for(layers=4, nodes=4, experts=16, seed=0) -> np.ndarray:
    return np.random.default_rng(seed).gamma(0.5, 100.0, (layers, nodes, experts))


def test_layers_come_back_in_the_order_given():
    demand = demand_for()
    caps = np.full(4, 1.10)
    order = [2, 0, 3, 1]
    with LayerPool(demand.shape, 2) as pool:
        got = list(pool.place(demand, order, caps, 2, 3, "top", 2))
        again = list(pool.place(demand[::-1].copy(), order, caps, 2, 3, "top", 2))  # the next round's demand
    for l, placed in zip(order, got):
        np.testing.assert_array_equal(placed.slots, place_layer(demand[l], 2, 3, 1.10, "top", 2).slots)
    for l, placed in zip(order, again):
        np.testing.assert_array_equal(placed.slots, place_layer(demand[::-1][l], 2, 3, 1.10, "top", 2).slots)


def refuse_layer_two(demand, gpus, slots_per_gpu, cap, budget, top_k):
    if demand.sum() == pytest.approx(float(demand_for()[2].sum())):
        raise LocusError("layer two refused")
    return place_layer(demand, gpus, slots_per_gpu, cap, budget, top_k)


@pytest.mark.parametrize("workers", [1, 2])
def test_a_worker_error_reaches_the_caller_as_in_process(monkeypatch, workers):
    monkeypatch.setattr(layer_pool, "place_layer", refuse_layer_two)  # inherited by the forked workers
    demand = demand_for()
    with LayerPool(demand.shape, workers) as pool:
        placed = pool.place(demand, range(4), np.full(4, 1.10), 2, 3, "top", 2)
        next(placed), next(placed)
        with pytest.raises(LocusError, match="^layer two refused$"):
            next(placed)


def die_on_layer_one(demand, gpus, slots_per_gpu, cap, budget, top_k):
    if demand.sum() == pytest.approx(float(demand_for()[1].sum())):
        os.kill(os.getpid(), signal.SIGKILL)
    return place_layer(demand, gpus, slots_per_gpu, cap, budget, top_k)


def test_a_killed_worker_is_a_clear_error_not_a_hang(monkeypatch):
    monkeypatch.setattr(layer_pool, "place_layer", die_on_layer_one)

    def hung(*_):
        raise AssertionError("the pool hung on a killed worker")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(120)
    try:
        demand = demand_for()
        with LayerPool(demand.shape, 2) as pool:
            with pytest.raises(LocusError, match="a planner worker process died"):
                list(pool.place(demand, range(4), np.full(4, 1.10), 2, 3, "top", 2))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_worker_count(reader):
    assert pool_workers(1, 58, 256, 256) == 1
    assert pool_workers(3, 58, 256, 256) == 3
    assert pool_workers(8, 4, 256, 256) == 4  # never more than the layers
    assert pool_workers(None, 58, 256, 256) == min(available_cpus(), 58)
    assert pool_workers(None, 3, 8, 32) == 1  # a small plan stays in-process
    assert available_cpus() == len(os.sched_getaffinity(0))
    with pytest.raises(LocusError, match="--workers must be at least 1, got 0"):
        PlanOptions(workers=0)  # the one check, for the CLI and API callers alike


def test_an_unmeetable_cap_stops_the_pool_after_the_first_layers(tmp_path, monkeypatch):
    # DeepSeek-V3's shape at 8 x 8 with no spare slot and a cap nothing reaches (test_layer_caps.py has it at
    # 32 x 8 in this process): the error, and the workers are stopped then, not after all 58 layers.
    reader = TraceReader(synth_trace(tmp_path / "t", requests=60, seed=1, experts=256, top_k=8,
                                     layers=tuple(range(58))))
    placed = multiprocessing.get_context("fork").Value("i", 0)  # shared with the forked workers
    place = layer_pool.place_layer

    def counting(*args):
        with placed.get_lock():
            placed.value += 1
        return place(*args)

    monkeypatch.setattr(layer_pool, "place_layer", counting)
    with pytest.raises(LocusError) as err:
        make_plan("locality", reader, Topology(8, 8, 4), (0, 60), PlanOptions(caps=Caps(expert=1.02), workers=2))
    text = str(err.value)
    assert "MoE layer 0: the expert-load cap 1.020 cannot be met with 4 slots per GPU" in text
    assert "EPLB misses it on 57 more layers too" in text
    assert 1 <= placed.value < 58  # the workers were stopped when layer 0 settled the error
