"""DeepSeek-V3 / V2 under expert parallelism on real gloo process groups (1x2, and 2x2 with replicas; the
exact and the fixed transport): each rank holds its slots' routed experts, the router (V3's biased,
group-limited sigmoid; V2's greedy softmax) and the shared experts run where the token is, the weights
apply on the expert output where the expert sits; the logits equal the single-process model's and the
bytes each rank counts are the dispatch rule's."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from locus.engine.checkpoint.presets import PRESETS, build_preset
from locus.engine.ep.groups import make_groups
from locus.engine.ep.layer import ExpertParallelMoE, apply_expert_parallel
from locus.engine.model.forward_batch import ForwardBatch
from locus.routing.planners.baselines import round_robin
from locus.routing.plan.topology import Topology
from tests.engine.ep.rank_cases import failures, run_cases
from tests.engine.ep.test_expert_parallel import expected_bytes_per_rank

pytestmark = pytest.mark.slow  # spawns rank processes

PRESETS_UNDER_TEST = ("tiny-deepseek-v2-lite", "tiny-deepseek-v3")
TOPOLOGIES = {"1x2": Topology(1, 2, 8), "2x2-replicas": Topology(2, 2, 6)}  # 16 experts: 16 and 24 slots
CASES = [(preset, case, mode) for preset in PRESETS_UNDER_TEST for case in sorted(TOPOLOGIES)
         for mode in ("exact", "fixed")]


def prompt_of(rank: int) -> list[int]:
    g = torch.Generator().manual_seed(300 + rank)
    return torch.randint(0, 256, (11 + 5 * rank,), generator=g).tolist()


def plan_for(preset: str, case: str):
    config = PRESETS[preset]
    return round_robin(config.num_local_experts, config.moe_layers, TOPOLOGIES[case], model=preset)


def worker(rank: int, world: int, preset: str, case: str, mode: str, out: str) -> None:
    model = build_preset(preset, seed=0)
    plan = plan_for(preset, case)
    ctx = apply_expert_parallel(model, plan, make_groups(plan.topology.nodes, plan.topology.gpus_per_node), mode)
    ctx.begin_step(capacity=64)  # at least every rank's token count (the fixed transport's block size)
    held = [tuple(m.gate_up_proj.shape) for m in model.modules() if isinstance(m, ExpertParallelMoE)]
    batch = ForwardBatch.single(prompt_of(rank))
    ctx.positions = batch.positions
    with torch.no_grad():
        fwd = model(batch, record_routing=True)
        logits = model.compute_logits(fwd.hidden)
    routing = np.stack([fwd.routing[layer].ids.numpy() for layer in plan.moe_layers], axis=1)  # [T, L, K]
    torch.save({"logits": logits, "held": held, "routing": routing, "positions": batch.positions,
                "bytes": dataclasses.replace(ctx.counters())}, f"{out}/rank{rank}.pt")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folders = run_cases(worker, [(TOPOLOGIES[case].ranks, (preset, case, mode)) for preset, case, mode in CASES],
                        tmp_path_factory.mktemp("deepseek-ep"))
    return dict(zip(CASES, folders))


@pytest.mark.parametrize("preset,case,mode", CASES)
def test_deepseek_logits_equal_one_process_and_bytes_follow_the_dispatch_rule(runs, preset, case, mode):
    folder = runs[preset, case, mode]
    assert not failures(folder), failures(folder)
    config, plan = PRESETS[preset], plan_for(preset, case)
    reference = build_preset(preset, seed=0)
    results = [torch.load(folder / f"rank{r}.pt", weights_only=False) for r in range(plan.topology.ranks)]
    for rank, got in enumerate(results):
        with torch.no_grad():
            fwd = reference(ForwardBatch.single(prompt_of(rank)), record_routing=True)
            want = reference.compute_logits(fwd.hidden)
        # each rank holds its slots' experts of each MoE layer (layer 0 is dense: no EP form)
        slots = plan.topology.slots_per_gpu
        assert got["held"] == [(slots, config.hidden_size, 2 * config.intermediate_size)] * len(config.moe_layers)
        assert np.array_equal(got["routing"], np.stack([fwd.routing[l].ids.numpy() for l in config.moe_layers], 1))
        assert (got["logits"] - want).abs().max().item() < 1e-5 and want.std() > 0.1
    row_bytes = 2 * config.hidden_size * 4  # one float32 row dispatched and combined back
    assert [(r["bytes"].inter_node, r["bytes"].intra_node) for r in results] == \
        expected_bytes_per_rank(plan, results, row_bytes)
    assert sum(r["bytes"].intra_node for r in results) > 0
    assert (sum(r["bytes"].inter_node for r in results) > 0) == (plan.topology.nodes > 1)
