"""--ep-elastic with real processes: SIGKILL of a rank mid-stream, then of a second one; the survivors
regroup, re-plan onto themselves, resume the lost ranks' requests from what they streamed, and every
stream completes with the single-process engine's greedy tokens. SIGTERM then drains and exits 0 with
no process left. Without --ep-elastic, a lost rank still ends the server (test_expert_parallel_serving)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from locus.engine.llm import LLM
from locus.engine.sampling import SamplingParams
from tests.server.server_process import running_server
from tests.server.test_expert_parallel_serving import alive, children_of

pytestmark = pytest.mark.slow  # a server of 4 rank processes, two of them killed

PROMPTS = [f"stream number {i} says" for i in range(8)]
TOKENS = 120


def rank_of(pid: int) -> int:
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return int(next(v for v in environ if v.startswith(b"RANK=")).split(b"=", 1)[1])


def wait_for_recoveries(base: str, count: int, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = httpx.get(f"{base}/ep/stats", timeout=10).json()
        if len(stats["recoveries"]) >= count:
            return stats
        assert time.monotonic() < deadline, "the survivors did not regroup"
        time.sleep(0.1)


def test_two_lost_ranks_lose_no_stream_and_no_token():
    want = [o.outputs[0].text for o in LLM("tiny").generate(PROMPTS, SamplingParams(temperature=0, max_tokens=TOKENS,
                                                                                     ignore_eos=True))]
    with running_server("--model", "tiny", "--ep-ranks", "4", "--gpus-per-node", "2", "--ep-elastic",
                        "--ep-timeout", "20") as proc:
        base = proc.base_url
        ranks = {rank_of(pid): pid for pid in children_of(proc.pid)}
        assert sorted(ranks) == [1, 2, 3]
        gaps: dict[int, float] = {}
        decoding = [threading.Event() for _ in PROMPTS]

        def stream(i: int) -> str:
            body = {"prompt": PROMPTS[i], "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True, "stream": True}
            text, last, worst = "", time.monotonic(), 0.0
            with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    assert "error" not in chunk, chunk
                    now = time.monotonic()
                    worst, last = max(worst, now - last), now
                    decoding[i].set()
                    text += "".join(c["text"] for c in chunk["choices"])
            gaps[i] = worst
            return text

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            streams = [pool.submit(stream, i) for i in range(len(PROMPTS))]
            for event in decoding:  # every stream is decoding, on every rank (balanced assignment)
                assert event.wait(60), "a stream did not start"
            os.kill(ranks[2], signal.SIGKILL)
            first = wait_for_recoveries(base, 1)
            assert httpx.get(f"{base}/health").status_code == 200
            time.sleep(0.5)
            os.kill(ranks[3], signal.SIGKILL)
            second = wait_for_recoveries(base, 2)
            got = [s.result() for s in streams]
        assert got == want
        assert first["recoveries"][0]["lost_ranks"] == [2] and first["recoveries"][0]["readmitted"] >= 1
        assert second["ranks"] == 2 and second["recoveries"][1]["survivors"] == 2
        assert second["topology"]["nodes"] * second["topology"]["gpus_per_node"] == 2
        assert max(gaps.values()) < 10, gaps  # the stall a client saw, kill to first token after
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    assert not any(alive(pid) for pid in ranks.values())
    assert children_of(proc.pid) == []


def test_elastic_without_room_for_the_survivors_is_refused_at_start():
    """Issue 27, acceptance 4: refused clearly, before serving, not at the first loss."""
    import pytest

    with pytest.raises(RuntimeError) as info:
        with running_server("--model", "tiny", "--ep-ranks", "4", "--gpus-per-node", "2", "--ep-elastic",
                            "--ep-max-slots", "2", timeout=60):
            pass
    assert "--ep-max-slots 2" in str(info.value) and "need 3 expert slots" in str(info.value)
