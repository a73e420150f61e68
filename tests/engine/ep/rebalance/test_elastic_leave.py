"""A rank that leaves its process groups after a failure (elastic.leave_groups) really lets go of them:
after real exact-mode steps on 2x1, no reference to any old group survives on the leaving rank, and
its peer, blocked in a point-to-point send to it (the exact transport's rows are such sends, and a
send only completes once the peer posts its receive), fails at once instead of at the groups' 60 s
timeout. A group kept alive by anything (a cache keyed by group, say) left that peer hanging until
the timeout, and the elastic rendezvous counted it as lost. What the lanes counted stays with the
leaving rank (less a step that failed half-way, which runs again after the regroup)."""

from __future__ import annotations

import gc
import time
import weakref
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from locus.engine.checkpoint.tokenizer import ByteTokenizer
from locus.engine.checkpoint.presets import build_preset
from locus.engine.core.engine_core import EngineConfig, EngineCore
from locus.engine.ep.ranks.control import ControlPlane
from locus.engine.ep.ranks.elastic import leave_groups
from locus.engine.ep.groups import make_groups
from locus.engine.ep.layer import apply_expert_parallel
from locus.engine.ep.ranks.worker import RankWorker
from locus.engine.sampling.sampler import SamplingParams
from locus.routing.planners.baselines import round_robin
from locus.routing.plan.topology import Topology
from tests.engine.ep.test_expert_parallel import end_rank, free_port

pytestmark = pytest.mark.slow  # spawns rank processes

TIMEOUT = timedelta(seconds=60)


def worker(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=TIMEOUT)
    model = build_preset("tiny", seed=0)
    config = model.config
    plan = round_robin(config.num_local_experts, config.moe_layers, Topology(2, 1, 4), model="tiny")
    groups = make_groups(2, 1, timeout=TIMEOUT)
    runtime = apply_expert_parallel(model, plan, groups, "exact", max_tokens_per_rank=256)
    core = EngineCore(model, ByteTokenizer(config.vocab_size), EngineConfig(block_size=8, num_kv_blocks=32))
    core.lockstep = runtime
    rank_worker = RankWorker(core, runtime, ControlPlane(groups.control, rank, 2))
    core.add_request(f"r{rank}", list(range(12)), SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    steps = 0
    while rank_worker.iterate().stepped:
        steps += 1
    assert steps >= 4
    inter = groups.lanes[0].inter  # the tier the exact transport's rows went over
    if rank == 0:
        # what the steps counted, and a step that fails half-way: it has counted a row when the peer is lost
        counted, by_epoch = runtime.counters(), runtime.counters_by_epoch()
        assert counted.inter_node > 0 and counted.token_layers > 0
        runtime.begin_step(capacity=64)
        runtime.lanes[0].counters.inter_node_dispatch += 1000
        runtime.lanes[0].tally.add("expert_pairs", torch.tensor(7))
        # the EP groups (torch itself may keep the default group it was launched with, which carries no
        # EP traffic)
        held = [weakref.ref(g) for g in groups.all()]
        del groups, inter, runtime
        leave_groups(rank_worker)
        gc.collect()
        alive = sum(ref() is not None for ref in held)
        assert alive == 0, f"{alive} of {len(held)} old process groups are still referenced after leaving"
        # issue 55, item 2: the steps' counts outlive the lanes (they used to go with them, and rank 0's
        # counters restarted at zero after a regroup); the half-run step counts nothing (it runs again)
        assert rank_worker.runtime.counters() == counted
        assert rank_worker.runtime.counters_by_epoch() == by_epoch
        time.sleep(1)  # the peer's send is waiting on a closed connection by now, not on a live one
    else:
        started = time.monotonic()
        try:
            dist.isend(torch.ones(4), group=inter, group_dst=0).wait()
            raise AssertionError("a send to a rank that left its groups completed")
        except RuntimeError:
            waited = time.monotonic() - started
        assert waited < TIMEOUT.total_seconds() / 3, f"the send to a rank that left failed only after {waited:.1f} s"
        torch.save({"waited": waited}, f"{out}/rank1.pt")
    end_rank()


def test_a_rank_that_leaves_lets_go_of_every_group(tmp_path):
    mp.spawn(worker, args=(free_port(), str(tmp_path)), nprocs=2, join=True)
    assert (tmp_path / "rank1.pt").exists()
