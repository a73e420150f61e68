"""`locus serve --plan`: a locality plan's grouper forms the server's micro-batches."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from locus.engine.core.engine_core import EngineCore
from locus.engine.checkpoint.presets import build_preset
from locus.engine.sampling.sampler import SamplingParams
from locus.engine.checkpoint.tokenizer import ByteTokenizer
from locus.routing.plan.caps import Caps
from locus.routing.plan.placement import PlacementPlan
from locus.routing.planners.planner import PlanOptions, make_plan
from locus.routing.plan.topology import Topology
from locus.traces.reader import TraceReader
from tests.server.server_process import running_server

pytestmark = pytest.mark.slow  # starts a real `locus serve` process


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


def serve_with_plan(plan, *extra: str):
    import subprocess
    import sys

    from tests.server.server_process import free_port

    return subprocess.run([sys.executable, "-m", "locus.cli", *extra, "serve", "--model", "tiny", "--plan", str(plan),
                           "--port", str(free_port()), "--log-level", "warning"],
                          capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_a_bad_plan_file_stops_serve_in_one_line(tmp_path):
    """Issue 41: `serve --plan BADFILE` logged the load's traceback before its one-line error. A file
    that is no plan now fails before the model loads; one that does not fit the model, as it loads."""
    bad = tmp_path / "plan.json"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)))
    done = serve_with_plan(bad)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr == f"locus: error: {bad}: not UTF-8 text (byte 0: invalid start byte)\n"
    other = tmp_path / "other.json"
    PlacementPlan("m", 4, (1,), Topology(1, 1, 4), np.arange(4)[None, None]).save(other)  # the tiny model has 8 experts
    done = serve_with_plan(other)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert f"locus: error: the model failed to load: {other}: plan is for 4 experts, the model has 8\n" in done.stderr
    debug = serve_with_plan(other, "--debug")
    assert debug.returncode == 1 and "Traceback (most recent call last)" in debug.stderr
