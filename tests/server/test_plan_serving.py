"""`locus serve --plan`: a locality plan's grouper forms the server's micro-batches."""

from __future__ import annotations

import httpx

from locus.engine.engine_core import EngineCore
from locus.engine.checkpoint.presets import build_preset
from locus.engine.sampling import SamplingParams
from locus.engine.checkpoint.tokenizer import ByteTokenizer
from locus.routing.plan.caps import Caps
from locus.routing.planners.planner import PlanOptions, make_plan
from locus.routing.plan.topology import Topology
from locus.traces.reader import TraceReader
from tests.server.server_process import running_server


def test_serving_with_a_plan_made_from_an_engine_recorded_trace(tmp_path):
    model, tok = build_preset("tiny"), ByteTokenizer(ByteTokenizer.MIN_VOCAB)
    core = EngineCore(model, tok)
    core.start_recording(tmp_path / "trace", "tiny")
    for i in range(40):
        core.add_request(f"r{i}", list(range(5 + i % 30)), SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                         domain=("code", "math", "chat", "general")[i % 4])
    while core.has_unfinished():
        core.step()
    core.dump_recording()
    reader = TraceReader(tmp_path / "trace")
    result = make_plan("locality", reader, Topology(2, 2, 3), (0, len(reader.requests)),
                       PlanOptions(caps=Caps(expert=1.5, attention=1.5)))
    plan_path = tmp_path / "plan.json"
    result.plan.save(plan_path)
    with running_server("--model", "tiny", "--plan", str(plan_path)) as proc:
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 4, "temperature": 0, "domain": "code"}
        r = httpx.post(f"{proc.base_url}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
