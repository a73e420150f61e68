"""The engine driven by a plan's grouper: each request runs in the micro-batch of the node the
grouper chose for it, and the tokens are those of an engine without grouping."""

from __future__ import annotations

import numpy as np
import torch

import pytest

from locus.engine.core.engine_core import EngineConfig, EngineCore
from locus.engine.policies.grouping import FirstComeGrouping
from locus.engine.policies.plan_grouping import PlanGrouping
from locus.engine.checkpoint.presets import build_preset
from locus.engine.sampling.sampler import SamplingParams
from locus.engine.checkpoint.tokenizer import ByteTokenizer
from locus.routing.plan.caps import Caps
from locus.routing.plan.grouping_spec import GroupingSpec
from locus.routing.plan.placement import PlacementPlan
from locus.routing.plan.topology import Topology

TOPOLOGY = Topology(2, 2, 2)  # 2 nodes x 2 GPUs, 2 slots each: node n holds the tiny preset's experts 4n..4n+3


def domain_plan(model_config) -> PlacementPlan:
    """A plan whose grouping sends "code" to node 0 and "math" to node 1."""
    L, E = len(model_config.moe_layers), model_config.num_local_experts
    spec = GroupingSpec(domain_nodes={"code": [1.0, 0.0], "math": [0.0, 1.0]}, caps=Caps(attention=4.0),
                        expected_decode_tokens=10.0, kv_bytes_per_token=1, bytes_per_send=1,
                        top_k=model_config.num_experts_per_tok, expert_prior=np.full((L, E), 1.0 / E), prior_tokens=0.0)
    slots = np.tile(np.arange(E).reshape(TOPOLOGY.ranks, -1)[None], (L, 1, 1))
    return PlacementPlan("tiny", E, tuple(model_config.moe_layers), TOPOLOGY, slots, grouping=spec.to_dict())


def prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (int(k),), generator=g).tolist() for k in torch.randint(4, 60, (n,), generator=g)]


def run(core: EngineCore, batch: list[list[int]], domains: list[str]) -> dict[str, list[int]]:
    for i, (p, d) in enumerate(zip(batch, domains)):
        core.add_request(f"r{i}-{d}", p, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), domain=d)
    outs = {}
    while core.has_unfinished():
        for out in core.step():
            if out.finished:
                outs[out.request_id] = out.outputs[0].token_ids
    return outs


def record_micro_batches(core: EngineCore) -> list[list[list[str]]]:
    """Per step, the domains of the requests in each micro-batch, in micro-batch order."""
    steps: list[list[list[str]]] = []
    grouping = core.scheduler.grouping
    real = grouping.group

    def group(items, k):
        groups = real(items, k)
        steps.append([[i.seq.request.domain for i in g] for g in groups])
        return groups

    grouping.group = group
    return steps


@pytest.mark.slow  # runs 12 prompts through two engines
def test_each_request_runs_in_the_micro_batch_of_the_node_its_grouper_chose():
    model, tok = build_preset("tiny"), ByteTokenizer(ByteTokenizer.MIN_VOCAB)
    batch = prompts(12, seed=2)
    domains = ["code", "math"] * 6  # arrival order alternates, so first-come batches would mix them
    reference = run(EngineCore(model, tok), batch, domains)

    policy = PlanGrouping.from_plan(domain_plan(model.config), model.config.moe_layers)
    core = EngineCore(model, tok, EngineConfig(num_micro_batches=2), grouping=policy)
    core.routing.subscribe(policy.observe)
    steps = record_micro_batches(core)
    assert run(core, batch, domains) == reference  # grouping changes where, never what
    assert steps and all(len(s) == 2 for s in steps[:3])  # both nodes busy while both domains run
    for step in steps:
        for micro_batch in step:
            assert len(set(micro_batch)) == 1, f"a micro-batch mixes domains: {step}"
    first = steps[0]
    assert first[0][0] == "code" and first[1][0] == "math"  # micro-batch i is node i
    # the ranks it kept say the same: code on node 0's ranks, math on node 1's
    assert policy.last_nodes == [[0], [1]] or len(policy.last_nodes) == 1
    assert all(TOPOLOGY.node_of(r) == n for ranks, (n,) in zip(policy.last_ranks, policy.last_nodes) for r in ranks)


@pytest.mark.slow  # runs 12 prompts on two micro-batches
def test_first_come_grouping_would_fail_the_same_check():
    """The check above is about the grouper's decision: first-come micro-batches mix the domains."""
    model, tok = build_preset("tiny"), ByteTokenizer(ByteTokenizer.MIN_VOCAB)
    core = EngineCore(model, tok, EngineConfig(num_micro_batches=2), grouping=FirstComeGrouping())
    steps = record_micro_batches(core)
    run(core, prompts(12, seed=2), ["code", "math"] * 6)
    assert any(len(set(mb)) > 1 for step in steps for mb in step)
