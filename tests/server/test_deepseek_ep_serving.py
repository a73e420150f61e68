"""A DeepSeek-V3 checkpoint served by expert-parallel ranks through a live re-plan and a lost rank (issue
57, scope 3). The re-plan:
`locus serve --ep-ranks 2 --plan STALE --replan-api` of a tiny-deepseek-v3 checkpoint; while greedy
streams decode, POST /ep/replan {"force": true} re-plans from the ranks' routing windows with the
plan's own planner (EPLB) and the ranks move the changed experts layer by layer. Every stream's text
equals one process's, and /ep/stats' bytes per placement epoch equal `locus replay --plan embedded
--assign recorded` of the trace the server recorded (as Llama-4's test_expert_parallel_serving does).
The lost rank: tests/server/test_qwen3_elastic_serving.py's case on a tiny-deepseek-v3 checkpoint."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from locus.cli import main
from locus.engine.checkpoint.presets import PRESETS
from locus.engine.frontend.llm import LLM
from locus.engine.sampling.sampler import SamplingParams
from locus.routing.plan.topology import Topology
from locus.routing.planners.baselines import eplb
from tests.server.server_process import running_server
from tests.server.test_qwen3_elastic_serving import serve_and_lose_a_rank

pytestmark = pytest.mark.slow  # servers of 2 and 4 rank processes

PROMPTS = [f"stream {i}: def f(x):" if i % 2 else f"Der Sinn {i} ist" for i in range(6)]
TOKENS = 48


def stale_plan(path) -> None:
    """EPLB for a load the streams do not have (experts 0-3 hot), 10 slots a rank on 1x2: 4 replicas a
    layer, which the live window places elsewhere."""
    config = PRESETS["tiny-deepseek-v3"]
    loads = np.ones((len(config.moe_layers), config.num_local_experts))
    loads[:, :4] = 100
    eplb(loads, config.moe_layers, Topology(1, 2, 10), model="dsv3-ck").save(path)


def stream(base: str, prompt: str, decoding: threading.Semaphore) -> str:
    body = {"prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True, "stream": True}
    chunks = []
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
                decoding.release()
    assert all("error" not in c for c in chunks), chunks[-1]
    return "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))


def test_a_forced_replan_mid_serve_on_deepseek_v3_keeps_every_stream_and_the_bytes_replay(tmp_path):
    ck, trace, plan = tmp_path / "dsv3-ck", tmp_path / "trace", tmp_path / "plan.json"
    assert main(["init-model", "--preset", "tiny-deepseek-v3", "--out", str(ck)]) == 0
    stale_plan(plan)
    want = [o.outputs[0].text for o in LLM(str(ck)).generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True))]
    with running_server("--model", str(ck), "--ep-ranks", "2", "--plan", str(plan), "--record-trace", str(trace),
                        "--replan-api", "--replan-window", "256", timeout=300) as proc:
        base = proc.base_url
        decoding = threading.Semaphore(0)
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            streams = [pool.submit(stream, base, p, decoding) for p in PROMPTS]
            for _ in range(4 * len(PROMPTS)):  # every stream is decoding: a few tokens each in the window
                assert decoding.acquire(timeout=120)
            decision = httpx.post(f"{base}/ep/replan", json={"force": True}, timeout=300).json()
            got = [s.result() for s in streams]
        deadline = time.monotonic() + 60
        while (stats := httpx.get(f"{base}/ep/stats").json())["replan"]["state"] != "idle":
            assert time.monotonic() < deadline
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    assert decision["applied"] and decision["moved_slots"] > 0 and decision["planner"] == "eplb", decision
    assert got == want
    # one epoch a switched MoE layer (layers 1, 2, 3: layer 0 is dense), the moved experts counted
    assert len(stats["epochs"]) == 1 + len(PRESETS["tiny-deepseek-v3"].moe_layers)
    assert stats["replan"]["moved"]["experts"] == decision["moved_slots"]
    assert sum(e["tokens"] for e in stats["epochs"][1:]) > 0  # the streams decoded on through the move
    out = tmp_path / "replay.json"
    done = subprocess.run([sys.executable, "-m", "locus.cli", "replay", str(trace), "--plan", "embedded",
                           "--assign", "recorded", "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    replayed = json.loads(out.read_text())
    assert [(e["epoch"], e["inter_node_bytes"], e["intra_node_bytes"], e["tokens"]) for e in replayed["epochs"]] == [
        (e["epoch"], e["inter_node_bytes"], e["intra_node_bytes"], e["tokens"]) for e in stats["epochs"] if e["tokens"]]
    assert sum(e["intra_node_bytes"] for e in replayed["epochs"]) > 0


def test_a_lost_rank_of_a_deepseek_v3_server_loses_no_stream_and_no_token(tmp_path):
    serve_and_lose_a_rank("tiny-deepseek-v3", tmp_path)
