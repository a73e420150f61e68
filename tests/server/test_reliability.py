"""No request and no load pattern may kill or wedge the server (issue 19's findings, one test each
where it needs a real server: bad parameters, overload of streams, lone surrogates, oversized
prompts, the drain deadline, and a dead engine)."""

from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import pytest

from tests.server.faulty_serve import FAULT
from tests.server.server_process import running_server

pytestmark = pytest.mark.slow  # every test talks to a real `locus serve` process


@pytest.fixture(scope="module")
def server():
    with running_server("--model", "tiny", "--num-kv-blocks", "256") as proc:
        yield proc


def assert_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


def test_out_of_range_top_k_is_refused_and_the_engine_lives_on(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        for top_k in (2**63, 2**64 + 5, 262, -2):  # the tiny model's vocabulary is 261 tokens
            body = {"prompt": "hi", "max_tokens": 3, "top_k": top_k, "temperature": 1}
            assert_error(http.post("/v1/completions", json=body), 400, "top_k")
        ok = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "top_k": 261, "temperature": 1})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
        assert http.get("/health").status_code == 200


def test_lone_surrogates_get_a_400_naming_the_field_on_a_kept_alive_connection(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        cases = [("/v1/completions", '{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
                 ("/v1/completions", '{"prompt": ["ok", "\\udfff"], "max_tokens": 2}', "prompt.1"),
                 ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "x\\ud800"}], "max_tokens": 2}',
                  "messages.0.content"),
                 ("/v1/completions", '{"prompt": "hi", "max_tokens": 2, "stop": ["\\ud83d"]}', "stop.0"),
                 ("/tokenize", '{"prompt": "\\ud800"}', "prompt")]
        for path, raw, param in cases:
            r = http.post(path, content=raw.encode(), headers={"content-type": "application/json"})
            assert_error(r, 400, param)
            assert r.headers.get("connection") != "close"
        # a surrogate *pair* is an ordinary character
        r = http.post("/tokenize", content=b'{"prompt": "\\ud83d\\ude00"}', headers={"content-type": "application/json"})
        assert r.status_code == 200 and r.json()["count"] == 1 + 4  # BOS + the emoji's 4 UTF-8 bytes


def test_a_prompt_far_beyond_the_context_is_refused_without_tokenizing(server):
    huge = "x" * (16 << 20)
    with httpx.Client(base_url=server.base_url, timeout=60) as http:
        error = assert_error(http.post("/v1/completions", json={"prompt": huge, "max_tokens": 1}), 400, "prompt")
        assert "characters" in error["message"] and "4096" in error["message"]
        chat = {"messages": [{"role": "user", "content": huge}], "max_tokens": 1}
        assert_error(http.post("/v1/chat/completions", json=chat), 400, "messages")
        assert http.get("/health").status_code == 200


async def _stream_or_refusal(client: httpx.AsyncClient, i: int) -> tuple[int, dict, list[str]]:
    body = {"prompt": f"request {i}", "max_tokens": 300, "ignore_eos": True, "temperature": 0, "stream": True}
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return r.status_code, dict(r.headers), [(await r.aread()).decode()]
        return 200, dict(r.headers), [line async for line in r.aiter_lines() if line]


def test_overloaded_streams_get_503_and_retry_after_before_any_sse_byte():
    with running_server("--model", "tiny", "--max-num-seqs", "1", "--max-waiting", "2") as proc:
        async def burst():
            async with httpx.AsyncClient(base_url=proc.base_url, timeout=120) as client:
                return await asyncio.gather(*(_stream_or_refusal(client, i) for i in range(12)))

        results = asyncio.run(burst())
    accepted = [r for r in results if r[0] == 200]
    refused = [r for r in results if r[0] != 200]
    # one running and two waiting at most: the 300-token streams all overlap, so no more than 3 fit
    assert 1 <= len(accepted) <= 3 and len(refused) >= 9
    for status, headers, lines in accepted:
        assert lines[-1] == "data: [DONE]" and not any('"error"' in line for line in lines)
    for status, headers, (body,) in refused:
        assert status == 503 and headers.get("retry-after") == "1"
        assert headers["content-type"].startswith("application/json")
        assert json.loads(body)["error"]["type"] == "service_unavailable"


def test_streams_still_open_at_the_drain_deadline_end_with_an_error_frame():
    with running_server("--model", "tiny", "--graceful-timeout", "2", "--log-level", "info") as proc:
        with httpx.Client(base_url=proc.base_url, timeout=60) as http:
            body = {"prompt": "long", "max_tokens": 3000, "ignore_eos": True, "temperature": 0, "stream": True}
            with http.stream("POST", "/v1/completions", json=body) as r:
                lines = r.iter_lines()
                assert next(line for line in lines if line).startswith("data: {")
                proc.send_signal(signal.SIGTERM)
                rest = [line for line in lines if line]
        assert proc.wait(30) == 0
        log = proc.stdout.read()
    last = json.loads(rest[-1].removeprefix("data: "))
    assert last["error"]["type"] == "service_unavailable" and "shut down" in last["error"]["message"]
    assert "Traceback" not in log and "CancelledError" not in log


def test_a_dead_engine_fails_requests_in_flight_and_the_process_exits_non_zero():
    with running_server("--model", "tiny", module="tests.server.faulty_serve") as proc:
        with httpx.Client(base_url=proc.base_url, timeout=60) as http:
            body = {"prompt": "innocent", "max_tokens": 3000, "ignore_eos": True, "temperature": 0, "stream": True}
            with http.stream("POST", "/v1/completions", json=body) as r:
                lines = r.iter_lines()
                assert next(line for line in lines if line).startswith("data: {")
                fatal = http.post("/v1/completions", json={"prompt": FAULT.decode(), "max_tokens": 2})
                rest = [line for line in lines if line]
            assert_error(fatal, 503)
        started = time.monotonic()
        code = proc.wait(30)
        log = proc.stdout.read()
    assert code != 0 and time.monotonic() - started < 15
    assert json.loads(rest[-1].removeprefix("data: "))["error"]["type"] == "service_unavailable"
    assert "RuntimeError: injected fault in the engine step" in log and "Traceback" in log
