"""Expert-parallel serving of a Qwen3-MoE or DeepSeek checkpoint through a live re-plan and through a
lost rank (issue 57, scope 3); tests/server/test_qwen3_ep_serving.py and test_deepseek_ep_serving.py run
them on the tiny presets (Llama-4's cases: test_expert_parallel_serving.py, test_elastic_serving.py).

- `serve_and_replan`: `locus serve --ep-ranks 2 --plan STALE --replan-api --record-trace`; while greedy
  streams decode, POST /ep/replan {"force": true} re-plans from the ranks' routing windows with the
  plan's own planner (EPLB) and the ranks move the changed experts layer by layer. Every stream's text
  equals one process's, the streams decode on through the move, and /ep/stats' bytes per placement
  epoch equal `locus replay --plan embedded --assign recorded` of the trace the server recorded.
- `serve_and_lose_a_rank`: `--ep-ranks 4 --gpus-per-node 2 --ep-elastic`; one rank is SIGKILLed while
  greedy streams decode on every rank; the three survivors regroup, re-plan onto themselves and resume
  the lost rank's requests from what they streamed: every stream ends `done` with one process's text,
  no token lost or repeated, and no process is left after SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np

from locus.cli import main
from locus.engine.checkpoint.presets import PRESETS
from locus.engine.frontend.llm import LLM
from locus.engine.sampling.sampler import SamplingParams
from locus.routing.plan.topology import Topology
from locus.routing.planners.baselines import eplb
from tests.server.server_process import running_server
from tests.server.test_elastic_serving import rank_of, sse_stream, wait_for_recoveries
from tests.server.test_expert_parallel_serving import alive, children_of

REPLAN_PROMPTS = [f"stream {i}: def f(x):" if i % 2 else f"Der Sinn {i} ist" for i in range(6)]
REPLAN_TOKENS = 48
ELASTIC_PROMPTS = [f"stream number {i} says" for i in range(8)]
ELASTIC_TOKENS = 64


def stale_plan(preset: str, path) -> None:
    """EPLB for a load the streams do not have (experts 0-3 hot), 10 slots a rank on 1x2: 4 replicas a
    layer, which the live window places elsewhere."""
    config = PRESETS[preset]
    loads = np.ones((len(config.moe_layers), config.num_local_experts))
    loads[:, :4] = 100
    eplb(loads, config.moe_layers, Topology(1, 2, 10), model="ck").save(path)


def stream(base: str, prompt: str, decoding: threading.Semaphore) -> str:
    body = {"prompt": prompt, "max_tokens": REPLAN_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True}
    chunks = []
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:]))
                decoding.release()
    assert all("error" not in c for c in chunks), chunks[-1]
    return "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))


def serve_and_replan(preset: str, tmp_path) -> None:
    """`locus serve --ep-ranks 2 --plan STALE --replan-api` of a `preset` checkpoint: a forced re-plan while
    greedy streams decode (the module docstring)."""
    ck, trace, plan = tmp_path / "ck", tmp_path / "trace", tmp_path / "plan.json"
    assert main(["init-model", "--preset", preset, "--out", str(ck)]) == 0
    stale_plan(preset, plan)
    want = [o.outputs[0].text for o in LLM(str(ck)).generate(
        REPLAN_PROMPTS, SamplingParams(temperature=0, max_tokens=REPLAN_TOKENS, ignore_eos=True))]
    with running_server("--model", str(ck), "--ep-ranks", "2", "--plan", str(plan), "--record-trace", str(trace),
                        "--replan-api", "--replan-window", "256", timeout=300) as proc:
        base = proc.base_url
        decoding = threading.Semaphore(0)
        with ThreadPoolExecutor(len(REPLAN_PROMPTS)) as pool:
            streams = [pool.submit(stream, base, p, decoding) for p in REPLAN_PROMPTS]
            for _ in range(4 * len(REPLAN_PROMPTS)):  # every stream is decoding: a few tokens each in the window
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
    # one epoch a switched MoE layer (a dense layer has none), the moved experts counted
    assert len(stats["epochs"]) == 1 + len(PRESETS[preset].moe_layers)
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


def serve_and_lose_a_rank(preset: str, tmp_path) -> None:
    """`locus serve --ep-ranks 4 --gpus-per-node 2 --ep-elastic` of a `preset` checkpoint: rank 2 SIGKILLed
    while greedy streams decode on every rank (the module docstring)."""
    ck = tmp_path / "ck"
    assert main(["init-model", "--preset", preset, "--out", str(ck)]) == 0
    want = [o.outputs[0].text for o in LLM(str(ck)).generate(
        ELASTIC_PROMPTS, SamplingParams(temperature=0, max_tokens=ELASTIC_TOKENS, ignore_eos=True))]
    with running_server("--model", str(ck), "--ep-ranks", "4", "--gpus-per-node", "2", "--ep-elastic",
                        "--ep-timeout", "20", timeout=300) as proc:
        base = proc.base_url
        ranks = {rank_of(pid): pid for pid in children_of(proc.pid)}
        assert sorted(ranks) == [1, 2, 3]
        started = [threading.Event() for _ in ELASTIC_PROMPTS]
        with ThreadPoolExecutor(len(ELASTIC_PROMPTS)) as pool:
            streams = [pool.submit(sse_stream, base, p, ELASTIC_TOKENS, started[i])
                       for i, p in enumerate(ELASTIC_PROMPTS)]
            assert all(event.wait(120) for event in started), "a stream did not start"
            os.kill(ranks[2], signal.SIGKILL)
            stats = wait_for_recoveries(base, 1)
            got = [s.result() for s in streams]
        assert [g["text"] for g in got] == want and {g["end"] for g in got} == {"done"}
        assert stats["recoveries"][0]["lost_ranks"] == [2] and stats["recoveries"][0]["readmitted"] >= 1
        after = httpx.get(f"{base}/ep/stats", timeout=10).json()
        assert after["ranks"] == 3 and [r["identity"] for r in after["per_rank"]] == [0, 1, 3]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    assert not any(alive(pid) for pid in ranks.values()) and children_of(proc.pid) == []
