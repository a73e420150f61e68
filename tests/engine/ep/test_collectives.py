"""How many collectives an expert-parallel step issues, counted where they are issued (every
torch.distributed call wrapped in the worker processes): per MoE layer and forward on 2x2, 2 tiers x
(dispatch, combine) = 4 in the fixed-capacity mode and at most 6 in the exact mode (each tier's
count exchange, always, then the rows and the combine, point-to-point batches that a rank with
nothing to exchange in the tier skips); on the control plane at most 2 per iteration (headers,
then the announced messages as one batch of point-to-point operations, which is one call here:
its sends and receives are not torch.distributed calls of their own), wherever a step runs."""

from __future__ import annotations

import collections

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from locus.engine.checkpoint.presets import PRESETS, build_preset
from locus.engine.checkpoint.tokenizer import ByteTokenizer
from locus.engine.core.engine_core import EngineConfig, EngineCore
from locus.engine.ep.ranks.control import ControlPlane
from locus.engine.ep.groups import make_groups
from locus.engine.ep.layer import apply_expert_parallel
from locus.engine.ep.ranks.worker import RankWorker
from locus.engine.sampling.sampler import SamplingParams
from locus.routing.planners.baselines import round_robin
from locus.routing.plan.topology import Topology
from tests.engine.ep.test_expert_parallel import end_rank, free_port

pytestmark = pytest.mark.slow  # spawns 4 rank processes

COUNTED = ("all_to_all_single", "all_to_all", "all_gather_single", "all_gather_into_tensor", "all_gather",
           "all_reduce", "broadcast", "gather", "scatter", "reduce", "barrier", "broadcast_object_list",
           "gather_object", "all_gather_object", "send", "recv", "isend", "irecv", "batch_isend_irecv")


def count_collectives(control_group) -> collections.Counter:
    """Wrap every torch.distributed collective; count calls on the control group and on the others."""
    counts = collections.Counter()
    for name in COUNTED:
        original = getattr(dist, name)

        def counted(*args, _original=original, **kwargs):
            group = kwargs.get("group")
            if args and isinstance(args[0], list) and args[0] and isinstance(args[0][0], dist.P2POp):
                group = args[0][0].group  # batch_isend_irecv: the group is in its operations
            plane = "control" if group is control_group else "exchange"
            counts[plane] += 1
            counts[f"{plane}:{_original.__name__}"] += 1
            return _original(*args, **kwargs)

        setattr(dist, name, counted)
    return counts


def worker(rank: int, world: int, port: int, mode: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        model = build_preset("tiny", seed=0)
        config = model.config
        plan = round_robin(config.num_local_experts, config.moe_layers, Topology(2, 2, 2), model="tiny")
        groups = make_groups(2, 2)
        runtime = apply_expert_parallel(model, plan, groups, mode, max_tokens_per_rank=1024)
        core = EngineCore(model, ByteTokenizer(config.vocab_size), EngineConfig(block_size=8, num_kv_blocks=64))
        core.lockstep = runtime
        rank_worker = RankWorker(core, runtime, ControlPlane(groups.control, rank, world))
        for i in range(rank + 1):  # uneven: rank 0 finishes first and idles while the others decode
            core.add_request(f"r{rank}-{i}", list(range(10 + 5 * i)), SamplingParams(temperature=0, max_tokens=6 + 3 * i, ignore_eos=True))
        counts = count_collectives(groups.control)
        iterations = steps = 0
        while True:
            it = rank_worker.iterate()
            iterations += 1
            if not it.stepped:
                break
            steps += 1
        torch.save({"counts": dict(counts), "iterations": iterations, "steps": steps,
                    "layers": len(config.moe_layers)}, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()
    end_rank()


@pytest.mark.parametrize("mode,per_layer", [("fixed", 4), ("exact", 6)])
def test_collectives_per_layer_and_per_step(mode, per_layer, tmp_path):
    assert PRESETS["tiny"].num_local_experts == 8
    mp.spawn(worker, args=(4, free_port(), mode, str(tmp_path)), nprocs=4, join=True)
    for rank in range(4):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        steps, layers = got["steps"], got["layers"]
        assert steps >= 12  # rank 3's longest request: prefill + 14 decode steps
        counts = got["counts"]
        if mode == "fixed":
            assert counts["exchange"] == per_layer * layers * steps  # one forward a step, idle or not
        else:
            # every forward, idle or not, both tiers' counts; the rows and the combine are point-to-point
            # batches that a rank with nothing to exchange in a tier skips: at most 2 more a tier
            assert counts["exchange:all_to_all_single"] == 2 * layers * steps
            assert 0 < counts["exchange:batch_isend_irecv"] <= 4 * layers * steps
            assert counts["exchange"] <= per_layer * layers * steps
        assert counts["control"] <= 2 * got["iterations"]
