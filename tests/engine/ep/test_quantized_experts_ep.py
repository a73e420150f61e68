"""Narrow experts under expert parallelism on real gloo process groups: experts quantized at load
(`--quantize-experts`, each rank quantizing only its slots), or read narrow from an FP8 (Meta's FBGEMM
layout) or MXFP4 (gpt-oss layout) checkpoint, give the logits of one process holding the same narrow
experts; a live move carries a narrow expert's elements and scales and counts its narrow bytes; every
holder of an expert holds the same narrow weights (fingerprints)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from locus.engine.checkpoint.presets import PRESETS, build_preset
from locus.engine.checkpoint.quantize import quantize_model_experts
from locus.engine.checkpoint.weights import load_model, save_checkpoint
from locus.engine.ep.groups import make_groups
from locus.engine.ep.invariant import expert_fingerprint, held_fingerprints, share_fingerprints
from locus.engine.ep.layer import ExpertParallelMoE, apply_expert_parallel
from locus.engine.ep.placement_move import PlacementMove, align, move_bytes
from locus.engine.model.expert_rows import expert_nbytes
from locus.engine.model.forward_batch import ForwardBatch
from locus.engine.model.slices import expert_memory, moe_experts, slices_of
from locus.routing.plan.placement import PlacementPlan
from locus.routing.plan.topology import Topology
from locus.routing.planners.baselines import round_robin
from tests.engine.checkpoint.quantized_checkpoints import write_quantized
from tests.engine.ep.test_expert_parallel import end_rank, free_port, plan_for, prompt_of

pytestmark = pytest.mark.slow  # every test spawns 2-4 rank processes

FORMATS = ("fp8", "mxfp8", "mxfp4")
# what each run holds: tiny's experts quantized at load (slices, or the whole model then its slots),
# or read narrow from a checkpoint written in a published layout
SOURCES = (*[("preset", f) for f in FORMATS], ("whole", "mxfp8"), ("fbgemm_fp8", "fp8"), ("mxfp4", "mxfp4"))


def narrow_model(source: tuple[str, str], checkpoints: dict, expert_slices=None):
    """The model a run holds, on one rank (expert_slices) or in one process (None)."""
    kind, fmt = source
    if kind in ("preset", "whole"):
        model = build_preset("tiny", seed=0, expert_slices=expert_slices if kind == "preset" else None)
        quantize_model_experts(model, fmt)
        return model
    return load_model(checkpoints[kind], expert_slices=expert_slices)


def write_checkpoints(tmp: Path) -> dict[str, str]:
    """tiny's weights as an FBGEMM FP8 and a gpt-oss-style MXFP4 checkpoint."""
    source = save_checkpoint(build_preset("tiny", seed=0), tmp / "float")
    model = load_model(source)
    return {method: str(write_quantized(model, source, tmp / method, method)[0]) for method in ("fbgemm_fp8", "mxfp4")}


def reference_fingerprints(model) -> dict[tuple[int, int], int]:
    """{(MoE index, expert): fingerprint} of a model holding every expert."""
    out = {}
    for moe_index, experts in enumerate(moe_experts(model).values()):
        for e in range(model.config.num_local_experts):
            out[moe_index, e] = expert_fingerprint(experts.gate_up_proj[e], experts.down_proj[e])
    return out


def logits_of(model, runtime, rank: int) -> torch.Tensor:
    batch = ForwardBatch.single(prompt_of(rank))
    runtime.positions = batch.positions
    with torch.no_grad():
        return model.compute_logits(model(batch).hidden)


def parity_worker(rank: int, world: int, case: str, mode: str, port: int, out: str, checkpoints: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        for source in SOURCES:
            plan = plan_for(case, PRESETS["tiny"].moe_layers)
            model = narrow_model(source, checkpoints, slices_of(plan, rank))
            groups = make_groups(plan.topology.nodes, plan.topology.gpus_per_node)
            runtime = apply_expert_parallel(model, plan, groups, mode)
            runtime.begin_step(capacity=64)
            table = share_fingerprints(runtime, groups.control, plan.num_experts)  # raises if two holders differ
            layers = [m for m in model.modules() if isinstance(m, ExpertParallelMoE)]
            torch.save({"logits": logits_of(model, runtime, rank), "fingerprints": table,
                        "held": [(type(m.gate_up_proj).__name__, getattr(m.gate_up_proj, "format", None),
                                  tuple(m.gate_up_proj.shape)) for m in layers],
                        "memory": expert_memory(model)}, f"{out}/rank{rank}-{'-'.join(source)}.pt")
    finally:
        dist.destroy_process_group()
    end_rank()


@pytest.mark.parametrize("case,mode", [("1x2", "exact"), ("2x2-replicas", "exact"), ("2x2-replicas", "fixed")])
def test_narrow_experts_under_expert_parallelism_give_one_process_logits(case, mode, tmp_path):
    checkpoints = write_checkpoints(tmp_path)
    plan = plan_for(case, PRESETS["tiny"].moe_layers)
    world = plan.topology.ranks
    mp.spawn(parity_worker, args=(world, case, mode, free_port(), str(tmp_path), checkpoints), nprocs=world, join=True)
    E = PRESETS["tiny"].num_local_experts
    for source in SOURCES:
        reference = narrow_model(source, checkpoints)
        prints = reference_fingerprints(reference)
        full_bytes = sum(expert_nbytes(w) * E for ex in moe_experts(reference).values()
                         for w in (ex.gate_up_proj, ex.down_proj))
        for rank in range(world):
            got = torch.load(tmp_path / f"rank{rank}-{'-'.join(source)}.pt", weights_only=False)
            with torch.no_grad():
                want = reference.compute_logits(reference(ForwardBatch.single(prompt_of(rank))).hidden)
            assert (got["logits"] - want).abs().max().item() < 1e-5, (source, rank)
            # every rank holds its slots narrow, in the source's format
            assert got["held"] == [("QuantizedTensor", source[1], (plan.topology.slots_per_gpu, 64, 128))] * 3
            # the gathered fingerprints are the one-process model's: each rank's slice (quantized on
            # the rank, or read from the checkpoint) holds the very narrow weights of the whole model
            assert {(i, e): int(got["fingerprints"][i, e]) for i in range(3) for e in range(E)} == prints, source
            # the expert memory a rank logs counts the narrow bytes (elements and scales)
            assert got["memory"].full_bytes == full_bytes < 49152 * E  # under a third of float32 experts
            assert got["memory"].held_bytes == full_bytes * plan.topology.slots_per_gpu // E


def moved(plan: PlacementPlan) -> PlacementPlan:
    """From round-robin 2x2 (ranks hold {0, 4} {1, 5} | {2, 6} {3, 7}) to {0, 2} {1, 4} | {5, 6} {3, 7}:
    expert 4 moves inside node 0, experts 2 and 5 between the nodes."""
    slots = np.array([[[0, 2], [1, 4], [5, 6], [3, 7]]] * len(plan.moe_layers))
    return PlacementPlan(plan.model, plan.num_experts, tuple(plan.moe_layers), plan.topology, slots)


def move_worker(rank: int, world: int, port: int, out: str, checkpoints: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        config = PRESETS["tiny"]
        old = round_robin(config.num_local_experts, config.moe_layers, Topology(2, 2, 2), model="tiny")
        target = align(old, moved(old))
        for source in (("preset", "fp8"), ("preset", "mxfp4"), ("fbgemm_fp8", "fp8")):
            model = narrow_model(source, checkpoints, slices_of(old, rank))
            groups = make_groups(2, 2)
            runtime = apply_expert_parallel(model, old, groups)
            runtime.fingerprints = share_fingerprints(runtime, groups.control, config.num_local_experts)
            move = PlacementMove(target, layers_per_step=2)
            runtime.state.begin_move(move)
            held = [id(m.gate_up_proj.data) for m in runtime.layers]
            while runtime.advance_move() is not None:  # the worker's per-iteration call, every rank alike
                pass
            assert runtime.weights_ok  # check_weights: every slot holds its expert's narrow weights
            assert [id(m.gate_up_proj.data) for m in runtime.layers] == held  # written in place
            runtime.begin_step(capacity=64)
            torch.save({"logits": logits_of(model, runtime, rank), "stats": move.stats,
                        "prints": held_fingerprints(runtime), "plan": runtime.placement.plan.slots.tolist()},
                       f"{out}/move{rank}-{'-'.join(source)}.pt")
    finally:
        dist.destroy_process_group()
    end_rank()


def test_a_live_move_carries_narrow_experts_and_counts_their_narrow_bytes(tmp_path):
    checkpoints = write_checkpoints(tmp_path)
    mp.spawn(move_worker, args=(4, free_port(), str(tmp_path), checkpoints), nprocs=4, join=True)
    config = PRESETS["tiny"]
    old = round_robin(config.num_local_experts, config.moe_layers, Topology(2, 2, 2), model="tiny")
    target = align(old, moved(old))
    for source in (("preset", "fp8"), ("preset", "mxfp4"), ("fbgemm_fp8", "fp8")):
        reference = narrow_model(source, checkpoints)
        prints = reference_fingerprints(reference)
        experts = moe_experts(reference)[1]
        narrow = expert_nbytes(experts.gate_up_proj) + expert_nbytes(experts.down_proj)
        assert narrow < (64 * 128 + 64 * 64) * 4 / 3  # an expert's fp8 / mxfp4 bytes, against float32's
        count, intra, inter = move_bytes(old, target, narrow)
        results = [torch.load(tmp_path / f"move{r}-{'-'.join(source)}.pt", weights_only=False) for r in range(4)]
        assert (count, intra, inter) == (3 * 3, 3 * narrow, 6 * narrow)  # 3 slots in each of 3 MoE layers
        assert sum(r["stats"].inter_node_bytes for r in results) == inter, source
        assert sum(r["stats"].intra_node_bytes for r in results) == intra, source
        assert sum(r["stats"].experts for r in results) == count
        for rank, r in enumerate(results):
            assert r["plan"] == target.slots.tolist()
            assert all(prints[key] == p for key, ps in r["prints"].items() for p in ps), source
            with torch.no_grad():
                want = reference.compute_logits(reference(ForwardBatch.single(prompt_of(rank))).hidden)
            assert (r["logits"] - want).abs().max().item() < 1e-5, (source, rank)


def test_a_live_replan_under_load_prices_and_moves_narrow_experts(tmp_path):
    """test_replan's forced re-plan mid-stream (`small` 2x2, 16 greedy streams), every rank holding fp8
    experts: the re-planner prices the move in fp8 bytes, the ranks send exactly those, and every
    stream's tokens are those of one engine holding the same fp8 experts."""
    from locus.engine.checkpoint.tokenizer import ByteTokenizer
    from locus.engine.core.engine_core import EngineConfig
    from locus.engine.frontend.llm import LLM
    from locus.engine.sampling.sampler import SamplingParams
    from locus.routing.plan.placement import plan_from_dict
    from tests.engine.ep.rebalance.test_replan import TOKENS, prompts, stale_plan, worker

    mp.spawn(worker, args=(4, free_port(), str(tmp_path), "fp8"), nprocs=4, join=True)
    got = torch.load(tmp_path / "rank0.pt", weights_only=False)
    decision = got["decision"]
    assert decision["applied"] and decision["moved_slots"] > 0

    config = PRESETS["small"]
    reference = build_preset("small", seed=0)
    quantize_model_experts(reference, "fp8")
    experts = moe_experts(reference)[config.moe_layers[0]]
    narrow = expert_nbytes(experts.gate_up_proj) + expert_nbytes(experts.down_proj)
    H, I = config.hidden_size, config.intermediate_size
    assert narrow == H * 2 * I + 2 * I * 4 + I * H + H * 4  # E4M3 elements and a float32 scale per column
    count, intra, inter = move_bytes(stale_plan(), plan_from_dict(got["final_plan"]), narrow)
    assert count == decision["moved_slots"] and decision["move_bytes"] == intra + inter > 0
    assert sum(m.intra_node_bytes + m.inter_node_bytes for m in got["moved"]) == intra + inter

    llm = LLM.from_model(reference, ByteTokenizer(config.vocab_size), EngineConfig(block_size=8, num_kv_blocks=256))
    want = llm.generate(prompts(), SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True))
    assert len(got["finals"]) == 16
    for i, out in enumerate(want):
        assert got["finals"][f"p{i}"] == out.outputs[0].token_ids, f"request {i}"
