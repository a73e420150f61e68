"""A served Qwen3-MoE checkpoint survives a lost rank (issue 57, scope 3): `locus serve --ep-ranks 4
--gpus-per-node 2 --ep-elastic` of a tiny-qwen3-moe checkpoint (a dense layer among its MoE ones); one
rank is SIGKILLed while greedy streams decode on every rank; the three survivors regroup, re-plan onto
themselves and resume the lost rank's requests from what they streamed: every stream ends `done` with
one process's text, no token lost or repeated (Llama-4's cases: tests/server/test_elastic_serving.py)."""

from __future__ import annotations

import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from locus.cli import main
from locus.engine.frontend.llm import LLM
from locus.engine.sampling.sampler import SamplingParams
from tests.server.server_process import running_server
from tests.server.test_elastic_serving import rank_of, sse_stream, wait_for_recoveries
from tests.server.test_expert_parallel_serving import alive, children_of

pytestmark = pytest.mark.slow  # a server of 4 rank processes, one of them killed

PROMPTS = [f"stream number {i} says" for i in range(8)]
TOKENS = 64


def test_a_lost_rank_of_a_qwen3_server_loses_no_stream_and_no_token(tmp_path):
    serve_and_lose_a_rank("tiny-qwen3-moe", tmp_path)


def serve_and_lose_a_rank(preset: str, tmp_path) -> None:
    """The test above on a checkpoint of `preset` (tests/server/test_deepseek_ep_serving.py runs it on
    tiny-deepseek-v3)."""
    ck = tmp_path / "ck"
    assert main(["init-model", "--preset", preset, "--out", str(ck)]) == 0
    want = [o.outputs[0].text for o in LLM(str(ck)).generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True))]
    with running_server("--model", str(ck), "--ep-ranks", "4", "--gpus-per-node", "2", "--ep-elastic",
                        "--ep-timeout", "20", timeout=300) as proc:
        base = proc.base_url
        ranks = {rank_of(pid): pid for pid in children_of(proc.pid)}
        assert sorted(ranks) == [1, 2, 3]
        started = [threading.Event() for _ in PROMPTS]
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            streams = [pool.submit(sse_stream, base, p, TOKENS, started[i]) for i, p in enumerate(PROMPTS)]
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
