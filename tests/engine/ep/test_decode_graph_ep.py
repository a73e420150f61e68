"""The decode graphs under expert parallelism: two gloo ranks, each running its own requests through
decode graphs whose exchange is the opaque `locus::ep_routed_experts` op. Compiled: greedy tokens
equal the single-process eager model's, and the padding rows of a bucket are never exchanged (the
exchange counts exactly the real tokens). Static buffers, every bucket: each step's logits within
1e-5 of the eager runner's on the same rank and KV state, in the fixed-capacity exchange."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from locus.engine.runner.decode_graph import DecodeGraphs
from locus.engine.core.engine_core import EngineConfig, EngineCore
from locus.engine.ep.layer import apply_expert_parallel
from locus.engine.model.generate import generate_tokens
from locus.engine.checkpoint.presets import PRESETS, build_preset
from locus.engine.sampling.sampler import SamplingParams
from locus.engine.checkpoint.tokenizer import ByteTokenizer
from locus.engine.ep.ranks.control import ControlPlane
from locus.engine.ep.groups import make_groups
from locus.engine.ep.ranks.worker import RankWorker
from locus.routing.planners.baselines import round_robin
from locus.routing.plan.topology import Topology
from tests.engine.ep.test_expert_parallel import end_rank, run_until_done

pytestmark = pytest.mark.slow  # spawns 2 rank processes that compile

NEW_TOKENS = 12


def prompts_of(rank: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(200 + rank)
    return [torch.randint(0, 256, (4 + 9 * i + rank,), generator=g).tolist() for i in range(2 + rank)]


def tiny_on_two_ranks(rank: int, world: int, port: int, mode: str = "exact"):
    """This rank of a 1x2 gloo group over the tiny preset, experts dealt round-robin: (model, plan, groups, runtime)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    model = build_preset("tiny", seed=0)
    E = model.config.num_local_experts
    plan = round_robin(E, model.config.moe_layers, Topology(1, 2, E // 2), model="tiny")
    groups = make_groups(1, 2)
    return model, plan, groups, apply_expert_parallel(model, plan, groups, mode=mode)


def spawn_two(worker, tmp_path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(worker, args=(2, port, str(tmp_path)), nprocs=2, join=True, start_method="spawn")


def worker(rank: int, world: int, port: int, out: str) -> None:
    try:
        model, plan, groups, ctx = tiny_on_two_ranks(rank, world, port)
        # rank 0 runs 2 sequences, rank 1 three: both pad to the bucket of 4
        core = EngineCore(model, ByteTokenizer(ByteTokenizer.MIN_VOCAB),
                          EngineConfig(block_size=16, num_kv_blocks=32, max_num_seqs=4, compile_decode=True,
                                       compile_buckets=(4,)))
        core.lockstep = ctx
        before = ctx.counters().token_layers  # the warm-up exchanged padding only: nothing
        prompts = prompts_of(rank)
        for i, prompt in enumerate(prompts):
            core.add_request(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True))
        final = {o.request_id: o.outputs[0].token_ids
                 for o in run_until_done(RankWorker(core, ctx, ControlPlane(groups.control, rank, world)))}
        computed = sum(len(p) + NEW_TOKENS - 1 for p in prompts)  # the last sampled token is never fed back
        torch.save({"tokens": [final[str(i)] for i in range(len(prompts))], "before": before,
                    "token_layers": ctx.counters().token_layers, "expected": computed * len(plan.moe_layers),
                    "compiled_steps": core.graphs.steps}, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()
    end_rank()


def test_compiled_decode_under_expert_parallelism_keeps_tokens_and_bytes(tmp_path):
    spawn_two(worker, tmp_path)
    model = build_preset("tiny", seed=0)
    assert PRESETS["tiny"].num_local_experts % 2 == 0
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert got["before"] == 0
        assert got["compiled_steps"] >= NEW_TOKENS - 2
        assert got["token_layers"] == got["expected"]
        for prompt, tokens in zip(prompts_of(rank), got["tokens"]):
            assert tokens == generate_tokens(model, prompt, NEW_TOKENS)


class TwoPasses:
    """The engine's lockstep, running every step's forward twice, in the same order on every rank: the
    eager runner, then the decode graphs (a step the graphs do not take runs an idle exchange
    instead), so that each rank compares the two on the same KV state while the exchanges pair up."""

    def __init__(self, runtime, runner, checked: list):
        self.runtime, self.runner, self.checked = runtime, runner, checked
        self.eager = type(runner)(runner.model, runner.cache)

    def run_forwards(self, micro_batches, forward):
        if not micro_batches:
            self.runtime.idle()
            self.runtime.idle()
            return []
        (items,) = micro_batches
        eager = self.eager.run(items)
        if not self.runner.can_run_compiled(items):
            self.runtime.idle()
            return [eager]
        fast = forward(items)
        diff = float((fast.logits.float() - eager.logits).abs().max())
        self.checked.append((len(items), diff, torch.equal(fast.argmax, eager.logits.argmax(-1))))
        return [fast]


def static_worker(rank: int, world: int, port: int, out: str) -> None:
    try:
        model, plan, groups, ctx = tiny_on_two_ranks(rank, world, port, mode="fixed")
        core = EngineCore(model, ByteTokenizer(ByteTokenizer.MIN_VOCAB),
                          EngineConfig(block_size=16, num_kv_blocks=48, max_num_seqs=4))
        assert core.graphs is None  # CPU without --compile: eager; the test adds uncompiled graphs
        graphs = DecodeGraphs(model, core.cache, [1, 2, 4], max_blocks=8, compile=False)
        graphs.warm_up()  # every rank warms the same buckets in the same order: the exchanges pair up
        core.graphs = core.runner.graphs = graphs
        checked: list = []
        core.lockstep = TwoPasses(ctx, core.runner, checked)
        prompts = prompts_of(rank) + prompts_of(rank + 2)[:1]
        for i, prompt in enumerate(prompts):  # staggered lengths: the batch shrinks through the buckets
            core.add_request(str(i), prompt, SamplingParams(temperature=0.0, max_tokens=3 + 3 * i, ignore_eos=True))
        final = {o.request_id: o.outputs[0].token_ids
                 for o in run_until_done(RankWorker(core, ctx, ControlPlane(groups.control, rank, world)))}
        torch.save({"prompts": prompts, "tokens": [final[str(i)] for i in range(len(prompts))], "checked": checked,
                    "transport": ctx.lanes[0].transport.name}, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()
    end_rank()


def test_static_decode_buffers_under_expert_parallelism_match_eager_in_every_bucket(tmp_path):
    spawn_two(static_worker, tmp_path)
    model = build_preset("tiny", seed=0)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        assert got["transport"] == "fixed"
        sizes = {n for n, _, _ in got["checked"]}
        assert {1, 2} <= sizes and max(sizes) in (3, 4)  # buckets 1, 2 and 4
        assert all(diff <= 1e-5 and same for _, diff, same in got["checked"])
        for prompt, tokens, i in zip(got["prompts"], got["tokens"], range(10)):
            assert tokens == generate_tokens(model, prompt, 3 + 3 * i)
