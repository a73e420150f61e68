"""`locus serve --compile`: the compiled decode path behind the real HTTP server answers exactly what
the eager server answers (greedy, concurrent requests that share decode steps), and says at start-up
how long compiling took."""

from __future__ import annotations

import concurrent.futures

import httpx
import pytest

from tests.server.server_process import running_server

pytestmark = pytest.mark.slow  # starts a real `locus serve --compile` process

PROMPTS = ["The expert said", "Routing tokens", "a", "Many small ops make a slow step"]


def completions(base_url: str) -> list[list[str]]:
    body = {"max_tokens": 20, "temperature": 0, "ignore_eos": True, "logprobs": 1}
    with httpx.Client(base_url=base_url, timeout=120) as http, concurrent.futures.ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda p: http.post("/v1/completions", json={**body, "prompt": p}), PROMPTS))
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
    return [r.json()["choices"][0]["logprobs"]["tokens"] for r in replies]


def test_compiled_server_answers_what_the_eager_server_answers():
    # the server compiles its buckets before /health answers: minutes where the other test worker
    # shares the 2 cores, so a start-up limit that only a hung launch reaches
    with running_server("--model", "tiny", "--max-num-seqs", "4", "--compile", "--compile-buckets", "2,4",
                        "--log-level", "info", timeout=600) as proc:
        fast = completions(proc.base_url)
        proc.terminate()
        log = proc.communicate(timeout=30)[0]
    with running_server("--model", "tiny", "--max-num-seqs", "4") as proc:
        slow = completions(proc.base_url)
    assert fast == slow
    assert "compiled decode buckets [2, 4] in" in log
