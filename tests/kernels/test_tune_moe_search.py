"""The tuner's pruned search (bench/tune_moe.py): the space's rules, its seeds, one-step neighbours,
and coordinate descent on a synthetic cost, without timing anything."""

from __future__ import annotations

import math
import sys
import time
from dataclasses import fields
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from tune_moe import SHAPES, VALUES, Point, Space, tune_point  # noqa: E402

from locus.kernels.moe_configs import MoeConfig  # noqa: E402

SPACE = Space(torch.bfloat16, 227 * 1024)
SCOUT, MAVERICK = SHAPES["llama4-scout"], SHAPES["llama4-maverick"]


@pytest.mark.parametrize("name", list(SHAPES))
@pytest.mark.parametrize("T", [1, 2, 4, 8, 64, 256, 2048, 16384])
def test_seeds_and_neighbours_stay_in_the_space(name, T):
    point = Point(name, SHAPES[name], T)
    seeds = SPACE.seeds(point)
    assert seeds and all(SPACE.allowed(c, point) for c in seeds)
    for c in SPACE.neighbours(seeds[0], point):
        assert SPACE.allowed(c, point)
        changed = [f.name for f in fields(MoeConfig) if getattr(c, f.name) != getattr(seeds[0], f.name)]
        assert len(changed) == 1
        vals = VALUES[changed[0]]
        assert abs(vals.index(getattr(c, changed[0])) - vals.index(getattr(seeds[0], changed[0]))) == 1


def test_regimes_and_split_pruning():
    one_token = Point("llama4-scout", SCOUT, 1)
    assert one_token.regime == "sparse" and max(c.split_k for c in SPACE.seeds(one_token)) == 4
    busy = Point("llama4-maverick", MAVERICK, 256)  # ~110 experts x 80 tiles: the grid is full
    assert busy.regime == "decode" and not SPACE.allowed(MoeConfig(16, 64, 128, 1, 4, 3, split_k=2), busy)
    prefill = Point("llama4-scout", SCOUT, 4096)
    assert prefill.regime == "prefill" and all(c.split_k == 1 for c in SPACE.seeds(prefill))
    assert any(c.block_m == 128 and c.num_warps == 8 for c in SPACE.seeds(prefill))


def test_rules_prune_what_cannot_fit():
    point = Point("llama4-scout", SCOUT, 8192)
    assert not SPACE.allowed(MoeConfig(128, 256, 128, 8, 8, 5), point)  # shared memory
    assert not SPACE.allowed(MoeConfig(128, 256, 64, 8, 4, 2), point)  # registers for two accumulators
    assert not SPACE.allowed(MoeConfig(128, 64, 64, 8, 4, 3), Point("llama4-scout", SCOUT, 16))  # rows
    assert not SPACE.allowed(MoeConfig(16, 64, 256, 1, 4, 2, split_k=16), Point("llama4-scout", SCOUT, 1))  # 1 step


def test_seeds_for_large_shapes_fit_a_tiny_one():
    tiny = Point("tiny", SHAPES["tiny"], 1)
    fitted = SPACE.fit(MoeConfig(128, 256, 256, 16, 8, 5, split_k=8), tiny)
    assert fitted is not None and SPACE.allowed(fitted, tiny)
    assert fitted.block_n <= 64 and fitted.block_k <= 64 and fitted.block_m == 16


class FakeBench:
    """Times nothing: a config's "seconds" is its distance from a known optimum."""

    dtype, device, compile_workers = torch.bfloat16, torch.device("cpu"), 4

    def __init__(self, best: MoeConfig, broken: set[MoeConfig] = frozenset()):
        self.best, self.broken, self.measured, self.compiled = best, broken, [], []

    def precompile(self, configs):
        self.compiled.append(list(configs))

    def measure(self, point, config, batches):
        self.measured.append(config)
        if config in self.broken:
            return None
        cost = sum(abs(math.log2(getattr(config, n)) - math.log2(getattr(self.best, n)))
                   for n in ("block_n", "block_k", "split_k", "num_stages"))
        return 1e-4 * (1 + cost), True


def test_coordinate_descent_walks_to_the_optimum():
    point = Point("llama4-scout", SCOUT, 1)
    best = MoeConfig(16, 128, 64, 1, 4, 4, split_k=8)
    bench = FakeBench(best, broken={SPACE.seeds(point)[0]})  # the first seed fails to run
    result = tune_point(bench, SPACE, point, [], time.monotonic() + 60)
    assert result.config == best and result.seconds == pytest.approx(1e-4)
    assert result.failed >= 1 and len(set(bench.measured)) == len(bench.measured)  # none timed twice
    assert all(1 <= len(batch) <= 4 for batch in bench.compiled)  # compiled in batches of the workers


def test_descent_stops_at_the_deadline_with_a_measured_config():
    point = Point("llama4-maverick", MAVERICK, 2)
    bench = FakeBench(MoeConfig(16, 256, 32, 1, 4, 2, split_k=16))
    result = tune_point(bench, SPACE, point, [], time.monotonic() - 1)  # already late
    assert len(bench.measured) == 1 and result.seconds is not None
