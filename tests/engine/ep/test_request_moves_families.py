"""Requests of Qwen3-MoE and DeepSeek-V3 moved between expert-parallel ranks after their prefill (2x2 with
replicas, on real gloo process groups; Llama-4's case: tests/engine/ep/test_request_moves.py): every
request, moved once, generates one engine's greedy tokens and top-5 logprobs, and the migration bytes
the ranks count are, to the byte, the replay's of the trace they recorded with its own
`kv_bytes_per_token`: for DeepSeek the latent and rotated key per layer and token, what its cache
holds (a DeepSeek request could not move before: its cache rows are not K and V heads)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from locus.engine.checkpoint.presets import PRESETS, build_preset
from tests.engine.ep.rank_cases import failures, run_cases
from tests.engine.ep.test_expert_parallel import plan_for, reference_generation, top_logprobs
from tests.engine.ep.test_request_moves import move_each_request_once

pytestmark = pytest.mark.slow  # four rank processes (once for both presets)

WORLD = 4
PRESETS_UNDER_TEST = ("tiny-deepseek-v3", "tiny-qwen3-moe")


def worker(rank: int, world: int, preset: str, out: str) -> None:
    from locus.engine.checkpoint.tokenizer import ByteTokenizer
    from locus.engine.core.engine_core import EngineConfig, EngineCore
    from locus.engine.ep.groups import make_groups
    from locus.engine.ep.layer import apply_expert_parallel
    from locus.engine.ep.ranks.control import ControlPlane
    from locus.engine.ep.ranks.driver import EPDriver
    from locus.engine.ep.ranks.worker import RankWorker
    from locus.engine.model.slices import slices_of

    config = PRESETS[preset]
    plan = plan_for("2x2-replicas", config.moe_layers, preset)
    model = build_preset(preset, seed=0, expert_slices=slices_of(plan, rank))
    groups = make_groups(2, 2)
    ctx = apply_expert_parallel(model, plan, groups, "exact")
    core = EngineCore(model, ByteTokenizer(config.vocab_size),
                      EngineConfig(block_size=8, num_kv_blocks=128, max_num_batched_tokens=32))
    core.lockstep = ctx
    core.start_recording(f"{out}/trace{rank}", preset)
    rank_worker = RankWorker(core, ctx, ControlPlane(groups.control, rank, world))
    if rank != 0:
        rank_worker.serve()
        return
    move_each_request_once(EPDriver(rank_worker), core, world, out)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    folders = run_cases(worker, [(WORLD, (p,)) for p in PRESETS_UNDER_TEST], tmp_path_factory.mktemp("moves"))
    return dict(zip(PRESETS_UNDER_TEST, folders))


@pytest.mark.parametrize("preset", PRESETS_UNDER_TEST)
def test_moved_requests_of_the_new_families_keep_their_tokens_and_replay_their_kv_bytes(runs, preset):
    from locus.routing.replay.assignment import assign_recorded
    from locus.routing.replay.simulator import replay
    from locus.traces.merge import merge_traces
    from locus.traces.reader import TraceReader

    folder = runs[preset]
    assert not failures(folder), failures(folder)
    saved = torch.load(folder / "rank0.pt", weights_only=False)
    assert saved["moved"] == 16
    for i, out in enumerate(reference_generation(preset, "model")):
        assert saved["tokens"][f"p{i}"] == out.outputs[0].token_ids
        expected = [top_logprobs(lp) for lp in out.outputs[0].logprobs]
        got = saved["logprobs"][f"p{i}"]
        assert [[t for t, _ in step] for step in got] == [[t for t, _ in step] for step in expected]
        assert np.allclose([[v for _, v in s] for s in got], [[v for _, v in s] for s in expected], atol=1e-5)
    assert all(saved["free"])  # every rank's KV pool is whole again

    config, counters = PRESETS[preset], saved["counters"]
    plan = plan_for("2x2-replicas", config.moe_layers, preset)
    merge_traces([folder / f"trace{r}" for r in range(WORLD)], folder / "trace", ranks=list(range(WORLD)),
                 admissions=saved["admissions"])
    reader = TraceReader(folder / "trace")
    records = reader.requests
    assert len(records) == 16 and all(r.decode_rank == (r.rank + 1) % WORLD for r in records)
    kv = reader.meta.kv_bytes_per_token
    per_layer = config.kv_lora_rank + config.qk_rope_head_dim if preset.startswith("tiny-deepseek") \
        else 2 * config.num_key_value_heads * config.head_dim
    assert kv == config.num_hidden_layers * per_layer * 4
    assignment = assign_recorded(records, WORLD, kv_bytes_per_token=kv, gpus_per_node=2)
    report = replay(reader, plan, plan.topology, assignment)
    assert report.migrations == sum(c.migrations for c in counters) == 16
    assert report.migrated_kv_bytes == sum(c.migration_inter_node for c in counters) > 0
    intra = sum(r.moved_tokens * kv for r in records if r.rank // 2 == r.decode_rank // 2)
    assert intra == sum(c.migration_intra_node for c in counters) > 0
    assert report.inter_node_bytes == sum(c.inter_node for c in counters)
    assert report.intra_node_bytes == sum(c.intra_node for c in counters)
