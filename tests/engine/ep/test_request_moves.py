"""Requests moved between expert-parallel ranks after their prefill (driver.move -> MoveOut/MoveIn in
one iteration, the KV rows and sampler state point to point; docs/planner.md): on real gloo process
groups, every request moved once (within a node and across nodes, to and from rank 0) generates the
single-process engine's greedy tokens, and the migration bytes the ranks count are, to the byte, what
the replay of the trace they recorded says (the dispatch bytes too, each row on the rank it ran on)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from locus.engine.checkpoint.presets import PRESETS, build_preset
from tests.engine.ep.test_expert_parallel import end_rank, engine_prompts, free_port, plan_for, top_logprobs

pytestmark = pytest.mark.slow  # four rank processes

WORLD = 4


def rank_main(rank: int, port: int, out: str) -> None:
    from locus.engine.checkpoint.tokenizer import ByteTokenizer
    from locus.engine.core.engine_core import EngineConfig, EngineCore
    from locus.engine.ep.ranks.control import ControlPlane
    from locus.engine.ep.ranks.driver import EPDriver
    from locus.engine.ep.groups import make_groups
    from locus.engine.ep.layer import apply_expert_parallel
    from locus.engine.model.slices import slices_of
    from locus.engine.ep.ranks.worker import RankWorker

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    config = PRESETS["tiny"]
    plan = plan_for("2x2-replicas", config.moe_layers)
    model = build_preset("tiny", seed=0, expert_slices=slices_of(plan, rank))
    groups = make_groups(2, 2)
    ctx = apply_expert_parallel(model, plan, groups, "exact")
    core = EngineCore(model, ByteTokenizer(config.vocab_size),
                      EngineConfig(block_size=8, num_kv_blocks=128, max_num_batched_tokens=32))
    core.lockstep = ctx
    core.start_recording(f"{out}/trace{rank}", "tiny")
    worker = RankWorker(core, ctx, ControlPlane(groups.control, rank, WORLD))
    if rank != 0:
        worker.serve()
        end_rank()
    move_each_request_once(EPDriver(worker), core, WORLD, out)
    end_rank()


def move_each_request_once(driver, core, world: int, out: str) -> None:
    """Rank 0: greedy-decode the engine prompts, moving each request to the next rank once its prefill
    has run; saves the tokens, top logprobs, moves, counters, admissions and whether every rank's
    KV pool is free again to OUT/rank0.pt (also the new families' moves test)."""
    from locus.engine.sampling.sampler import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
    for i, prompt in enumerate(engine_prompts()):
        driver.add(f"p{i}", core.validate(prompt, params), None)
    moved, tokens, logprobs = set(), {}, {}
    while driver.has_unfinished():
        for output in driver.step():
            c = output.outputs[0]
            tokens.setdefault(output.request_id, []).extend(c.delta_token_ids)
            logprobs.setdefault(output.request_id, []).extend(top_logprobs(lp) for lp in c.delta_logprobs)
            if not output.finished and output.request_id not in moved:  # its prefill has run: move it once
                moved.add(output.request_id)
                driver.move(output.request_id, (driver.rank_of(output.request_id) + 1) % world)
    core.dump_recording()
    driver.stop()
    torch.save({"tokens": tokens, "logprobs": logprobs, "moved": driver.moved_requests,
                "counters": [r.counters for r in driver.ranks], "admissions": driver.admissions.records,
                "free": [s.num_free_blocks == s.num_blocks for s in (r.stats for r in driver.ranks)]},
               f"{out}/rank0.pt")

def test_requests_moved_after_prefill_keep_their_tokens_and_the_replay_counts_their_bytes(tmp_path):
    from locus.engine.checkpoint.tokenizer import ByteTokenizer
    from locus.engine.core.engine_core import EngineConfig
    from locus.engine.frontend.llm import LLM
    from locus.engine.sampling.sampler import SamplingParams
    from locus.routing.replay.assignment import assign_recorded
    from locus.routing.replay.simulator import replay
    from locus.traces.merge import merge_traces
    from locus.traces.reader import TraceReader

    mp.spawn(rank_main, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    saved = torch.load(tmp_path / "rank0.pt", weights_only=False)
    config = PRESETS["tiny"]
    llm = LLM.from_model(build_preset("tiny", seed=0), ByteTokenizer(config.vocab_size),
                         EngineConfig(block_size=8, num_kv_blocks=256))
    want = llm.generate(engine_prompts(), SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5))
    assert saved["moved"] == 16
    for i, out in enumerate(want):
        assert saved["tokens"][f"p{i}"] == out.outputs[0].token_ids
        expected = [top_logprobs(lp) for lp in out.outputs[0].logprobs]
        got = saved["logprobs"][f"p{i}"]
        assert [[t for t, _ in step] for step in got] == [[t for t, _ in step] for step in expected]
        assert np.allclose([[v for _, v in s] for s in got], [[v for _, v in s] for s in expected], atol=1e-5)
    assert all(saved["free"])  # every rank's KV pool is whole again: nothing leaked on either side

    counters = saved["counters"]
    assert sum(c.migrations for c in counters) == 16
    plan = plan_for("2x2-replicas", config.moe_layers)
    merge_traces([tmp_path / f"trace{r}" for r in range(WORLD)], tmp_path / "trace", ranks=list(range(WORLD)),
                 admissions=saved["admissions"])
    reader = TraceReader(tmp_path / "trace")
    records = reader.requests
    assert len(records) == 16 and all(r.decode_rank == (r.rank + 1) % WORLD for r in records)
    assert all(r.prompt_tokens <= r.moved_tokens < r.tokens for r in records)
    kv = reader.meta.kv_bytes_per_token
    assert kv == 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * 4
    assignment = assign_recorded(records, WORLD, kv_bytes_per_token=kv, gpus_per_node=2)
    report = replay(reader, plan, plan.topology, assignment)
    assert report.migrations == 16
    assert report.migrated_kv_bytes == sum(c.migration_inter_node for c in counters) > 0
    intra = sum(r.moved_tokens * kv for r in records if r.rank // 2 == r.decode_rank // 2)
    assert intra == sum(c.migration_intra_node for c in counters) > 0
    assert report.inter_node_bytes == sum(c.inter_node for c in counters)
    assert report.intra_node_bytes == sum(c.intra_node for c in counters)
