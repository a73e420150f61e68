"""Qwen3-MoE under expert parallelism on real gloo process groups (1x2): each rank holds half the
experts, its tokens' rows travel by all-to-all with their softmax weights (applied on the expert
output at the remote rank), and the logits equal the single-process model's."""

from __future__ import annotations

import pytest
import torch

from locus.engine.checkpoint.presets import PRESETS, build_preset
from locus.engine.ep.groups import make_groups
from locus.engine.ep.layer import ExpertParallelMoE, apply_expert_parallel
from locus.engine.model.forward_batch import ForwardBatch
from locus.routing.planners.baselines import round_robin
from locus.routing.plan.topology import Topology
from tests.engine.ep.rank_cases import failures, run_cases

pytestmark = pytest.mark.slow  # spawns 2 rank processes

PRESET = "tiny-qwen3-moe"


def prompt_of(rank: int) -> list[int]:
    g = torch.Generator().manual_seed(200 + rank)
    return torch.randint(0, 256, (9 + 6 * rank,), generator=g).tolist()


def worker(rank: int, world: int, out: str) -> None:
    model = build_preset(PRESET, seed=0)
    E = model.config.num_local_experts
    plan = round_robin(E, model.config.moe_layers, Topology(1, 2, E // 2), model=PRESET)
    ctx = apply_expert_parallel(model, plan, make_groups(1, 2), "exact")
    ctx.begin_step(capacity=64)
    held = [tuple(m.gate_up_proj.shape) for m in model.modules() if isinstance(m, ExpertParallelMoE)]
    batch = ForwardBatch.single(prompt_of(rank))
    ctx.positions = batch.positions
    with torch.no_grad():
        fwd = model(batch, record_routing=True)
        logits = model.compute_logits(fwd.hidden)
    torch.save({"logits": logits, "held": held, "routing": {k: v.ids for k, v in fwd.routing.items()}},
               f"{out}/rank{rank}.pt")


def test_qwen3_logits_on_1x2_equal_one_process(tmp_path):
    (folder,) = run_cases(worker, [(2, ())], tmp_path)
    assert not failures(folder), failures(folder)
    reference = build_preset(PRESET, seed=0)
    config = PRESETS[PRESET]
    for rank in range(2):
        got = torch.load(folder / f"rank{rank}.pt", weights_only=False)
        with torch.no_grad():
            fwd = reference(ForwardBatch.single(prompt_of(rank)), record_routing=True)
            want = reference.compute_logits(fwd.hidden)
        # each rank holds half the experts of each MoE layer (layer 2 is dense: no EP form)
        assert got["held"] == [(config.num_local_experts // 2, config.hidden_size, 2 * config.intermediate_size)] * 3
        assert all(torch.equal(got["routing"][layer], fwd.routing[layer].ids) for layer in config.moe_layers)
        assert (got["logits"] - want).abs().max().item() < 1e-5 and want.std() > 0.1
