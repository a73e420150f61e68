"""The engine driven by a locality plan's grouper: one micro-batch per node, same tokens as without."""

from __future__ import annotations

import httpx
import torch

from locus.engine.engine_core import EngineConfig, EngineCore
from locus.engine.plan_grouping import PlanGrouping
from locus.engine.presets import build_preset
from locus.engine.sampling import SamplingParams
from locus.engine.tokenizer import ByteTokenizer
from locus.routing.caps import Caps
from locus.routing.planner import PlanOptions, make_plan
from locus.routing.topology import Topology
from locus.traces.reader import TraceReader
from tests.server.server_process import running_server

DOMAINS = ("code", "math", "chat", "general")


def prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (int(k),), generator=g).tolist() for k in torch.randint(4, 60, (n,), generator=g)]


def run(core: EngineCore, batch: list[list[int]]) -> dict[str, list[int]]:
    for i, p in enumerate(batch):
        core.add_request(f"r{i}", p, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), domain=DOMAINS[i % 4])
    outs = {}
    while core.has_unfinished():
        for out in core.step():
            if out.finished:
                outs[out.request_id] = out.outputs[0].token_ids
    return outs


def test_plan_grouping_forms_node_micro_batches_without_changing_outputs(tmp_path):
    model, tok = build_preset("tiny"), ByteTokenizer(ByteTokenizer.MIN_VOCAB)
    recorder_core = EngineCore(model, tok)
    recorder_core.start_recording(tmp_path / "trace", "tiny")
    run(recorder_core, prompts(40, seed=1))
    recorder_core.dump_recording()
    reader = TraceReader(tmp_path / "trace")
    result = make_plan("locality", reader, Topology(2, 2, 3), (0, len(reader.requests)),
                       PlanOptions(caps=Caps(expert=1.5, attention=1.5)))
    plan_path = tmp_path / "plan.json"
    result.plan.save(plan_path)

    batch = prompts(12, seed=2)
    reference = run(EngineCore(model, tok), batch)
    policy = PlanGrouping.from_plan(result.plan, model.config.moe_layers)
    core = EngineCore(model, tok, EngineConfig(num_micro_batches=2), grouping=policy)
    core.routing.subscribe(policy.observe)
    assert run(core, batch) == reference
    assert any(len(nodes) == 1 for nodes in policy.last_nodes)  # micro-batches are per node

    with running_server("--model", "tiny", "--plan", str(plan_path)) as proc:
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 4, "temperature": 0, "domain": "code"}
        r = httpx.post(f"{proc.base_url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
