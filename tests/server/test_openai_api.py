"""A real `locus serve` process driven by the official openai client and raw HTTP."""

from __future__ import annotations

import asyncio
import json
import re
import signal

import httpx
import openai
import pytest

from tests.server.server_process import running_server

pytestmark = pytest.mark.slow  # every test talks to a real `locus serve` process

MODEL = "tiny"


@pytest.fixture(scope="module")
def server():
    with running_server("--model", MODEL, "--num-kv-blocks", "512", "--block-size", "16") as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_models_health_tokenize_detokenize(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(f"{server.base_url}/health").json() == {"status": "ok"}
    toks = httpx.post(f"{server.base_url}/tokenize", json={"prompt": "hello"}).json()
    assert toks["count"] == len(toks["tokens"]) == 6  # BOS + 5 bytes
    assert httpx.post(f"{server.base_url}/detokenize", json={"tokens": toks["tokens"]}).json()["prompt"] == "hello"


def test_completion_usage_matches_the_tokenizer(server, client):
    r = client.completions.create(model=MODEL, prompt="The expert", max_tokens=7, temperature=0)
    count = httpx.post(f"{server.base_url}/tokenize", json={"prompt": "The expert"}).json()["count"]
    assert r.usage.prompt_tokens == count and r.usage.completion_tokens == 7 and r.usage.total_tokens == count + 7
    assert r.choices[0].finish_reason == "length"


def test_streamed_completion_concatenates_to_the_greedy_result(client):
    full = client.completions.create(model=MODEL, prompt="stream test", max_tokens=20, temperature=0)
    chunks = list(client.completions.create(model=MODEL, prompt="stream test", max_tokens=20, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert chunks[-1].usage.completion_tokens == 20 and chunks[-1].choices == []


def test_streamed_logprobs_and_text_offsets_continue_across_chunks(client):
    args = dict(model=MODEL, prompt="offsets", max_tokens=10, temperature=0, logprobs=2)
    full = client.completions.create(**args).choices[0].logprobs
    chunks = [c.choices[0].logprobs for c in client.completions.create(**args, stream=True) if c.choices]
    assert [t for lp in chunks for t in lp.tokens] == full.tokens
    assert [v for lp in chunks for v in lp.token_logprobs] == pytest.approx(full.token_logprobs)
    assert [o for lp in chunks for o in lp.text_offset] == full.text_offset


def test_chat_streaming_and_non_streaming_agree(server, client):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=16, temperature=0)
    assert full.choices[0].message.role == "assistant"
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"
    count = httpx.post(f"{server.base_url}/tokenize", json={"messages": messages}).json()["count"]
    assert full.usage.prompt_tokens == count


def test_n_seed_and_stop(client):
    r = client.completions.create(model=MODEL, prompt="abc", max_tokens=12, temperature=1.0, n=2, seed=42)
    assert [c.index for c in r.choices] == [0, 1] and r.usage.completion_tokens == 24
    again = client.completions.create(model=MODEL, prompt="abc", max_tokens=12, temperature=1.0, n=2, seed=42)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]
    greedy = client.completions.create(model=MODEL, prompt="abc", max_tokens=16, temperature=0).choices[0].text
    clean = [ch for ch in greedy if ch != "\ufffd"]
    if len(clean) >= 3:
        stop = clean[2]
        stopped = client.completions.create(model=MODEL, prompt="abc", max_tokens=16, temperature=0, stop=[stop])
        assert stopped.choices[0].finish_reason == "stop" and stop not in stopped.choices[0].text
        assert greedy.startswith(stopped.choices[0].text)


def test_logprobs_completion_and_chat(client):
    r = client.completions.create(model=MODEL, prompt="abc", max_tokens=5, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 5 and all(len(t) == 3 for t in lp.top_logprobs)
    assert all(v <= 0 for v in lp.token_logprobs)
    # greedy: the chosen token is the most likely one
    assert all(max(top.values()) == pytest.approx(chosen, abs=1e-5) for top, chosen in zip(lp.top_logprobs, lp.token_logprobs))
    c = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                       temperature=0, logprobs=True, top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 for t in content)


@pytest.mark.parametrize("body,status,param", [
    ('{"model": "tiny", "prompt": ', 400, None),  # malformed JSON
    ({"model": "tiny", "prompt": "x", "max_tokens": "many"}, 400, "max_tokens"),  # wrong type
    ({"model": "tiny", "prompt": "x", "temperature": -1}, 400, "temperature"),
    ({"model": "tiny", "prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"model": "tiny", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "tiny", "prompt": "a" * 1_000_000}, 400, "prompt"),  # a 1-million-token prompt
    ({"model": "nope", "prompt": "x"}, 404, "model"),
    ({"model": "tiny", "prompt": "x", "n": 0}, 400, "n"),
    ({"model": "tiny", "prompt": []}, 400, "prompt"),
])
def test_bad_completion_requests(server, body, status, param):
    kwargs = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, str) else {"json": body}
    r = httpx.post(f"{server.base_url}/v1/completions", timeout=60, **kwargs)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert "Traceback" not in r.text
    if param is not None:
        assert err["param"] == param
    if status == 400 and param == "prompt" and isinstance(body, dict) and len(body["prompt"]) > 1000:
        assert re.search(r"context limit is \d+", err["message"])


@pytest.mark.parametrize("body,status,param", [
    ({"model": "tiny", "messages": []}, 400, "messages"),
    ({"model": "tiny"}, 400, "messages"),
    ({"model": "nope", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
    ({"model": "tiny", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 3}, 400, "top_logprobs"),
])
def test_bad_chat_requests(server, body, status, param):
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == status, r.text
    assert r.json()["error"]["param"] == param


def test_server_still_serves_after_bad_requests(client):
    assert client.completions.create(model=MODEL, prompt="ok", max_tokens=2, temperature=0).usage.completion_tokens == 2


def metric(text: str, name: str) -> float:
    m = re.search(rf"^{name}\{{[^}}]*\}} ([0-9.e+-]+)$", text, re.M)
    assert m, f"{name} missing from /metrics"
    return float(m.group(1))


def finished_count(text: str, reason: str) -> float:
    m = re.search(rf'^locus_request_success_total\{{[^}}]*finished_reason="{reason}"[^}}]*\}} ([0-9.e+-]+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def test_64_streams_half_disconnected_leave_nothing_running(server):
    before = httpx.get(f"{server.base_url}/metrics").text

    async def scenario():
        limits = httpx.Limits(max_connections=80)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120, limits=limits) as http:
            async def one(i: int):
                body = {"model": MODEL, "prompt": f"stream {i}", "max_tokens": 400 if i % 2 else 24,
                        "temperature": 0, "stream": True, "ignore_eos": True}
                events = 0
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line.startswith("data: "):
                            events += 1
                            if i % 2 and events == 3:
                                return "disconnected"  # leaving the block closes the connection mid-stream
                            if line == "data: [DONE]":
                                return "done"
                return "ended"
            return await asyncio.gather(*(one(i) for i in range(64)))

    results = asyncio.run(scenario())
    assert results.count("done") == 32 and results.count("disconnected") == 32
    text = ""
    for _ in range(100):
        text = httpx.get(f"{server.base_url}/metrics").text
        if metric(text, "locus_num_requests_running") == 0 and \
                metric(text, "locus_kv_cache_free_blocks") == metric(text, "locus_kv_cache_total_blocks"):
            break
        asyncio.run(asyncio.sleep(0.1))
    assert metric(text, "locus_num_requests_running") == 0
    assert metric(text, "locus_num_requests_waiting") == 0
    assert metric(text, "locus_kv_cache_free_blocks") == metric(text, "locus_kv_cache_total_blocks") == 512
    assert metric(text, "locus_generation_tokens_total") < 32 * 400  # the aborted streams stopped early
    # every request is counted once by how it ended, aborted ones too
    assert finished_count(text, "abort") - finished_count(before, "abort") == 32
    assert finished_count(text, "length") - finished_count(before, "length") == 32
    assert 'locus_expert_tokens_total{expert="0",layer="0"' in text
    assert "locus_time_to_first_token_seconds_bucket" in text


def test_a_non_streamed_request_whose_client_leaves_is_aborted(server):
    before = metric(httpx.get(f"{server.base_url}/metrics").text, "locus_generation_tokens_total")
    body = {"model": MODEL, "prompt": "leave early", "max_tokens": 3000, "temperature": 0, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.5))
    text = ""
    for _ in range(100):
        text = httpx.get(f"{server.base_url}/metrics").text
        if metric(text, "locus_num_requests_running") == 0:
            break
        asyncio.run(asyncio.sleep(0.05))
    assert metric(text, "locus_num_requests_running") == 0
    assert metric(text, "locus_kv_cache_free_blocks") == metric(text, "locus_kv_cache_total_blocks")
    generated = metric(text, "locus_generation_tokens_total") - before
    assert 0 < generated < 3000  # it was running, and stopped early


def test_sigterm_drains_and_exits_zero():
    with running_server("--model", MODEL) as proc:
        async def long_stream():
            async with httpx.AsyncClient(base_url=proc.base_url, timeout=60) as http:
                body = {"model": MODEL, "prompt": "x", "max_tokens": 60, "temperature": 0, "stream": True, "ignore_eos": True}
                async with http.stream("POST", "/v1/completions", json=body) as r:
                    lines = [line async for line in r.aiter_lines() if line.startswith("data: ")]
                    return lines

        async def scenario():
            task = asyncio.create_task(long_stream())
            await asyncio.sleep(0.3)
            proc.send_signal(signal.SIGTERM)
            return await task

        lines = asyncio.run(scenario())
        assert lines[-1] == "data: [DONE]"  # the in-flight request finished
        assert sum(len(json.loads(l[6:])["choices"]) for l in lines[:-1]) >= 1
        assert proc.wait(30) == 0


def test_queue_full_gets_503_with_retry_after():
    with running_server("--model", MODEL, "--max-waiting", "1", "--max-num-seqs", "1") as proc:
        async def scenario():
            async with httpx.AsyncClient(base_url=proc.base_url, timeout=180) as http:
                body = {"model": MODEL, "prompt": "x", "max_tokens": 40, "temperature": 0, "ignore_eos": True}
                return await asyncio.gather(*(http.post("/v1/completions", json=body) for _ in range(8)))

        responses = asyncio.run(scenario())
        codes = [r.status_code for r in responses]
        assert 503 in codes and 200 in codes
        rejected = [r for r in responses if r.status_code == 503]
        assert rejected and rejected[0].headers.get("retry-after") == "1"
        assert rejected[0].json()["error"]["type"] == "service_unavailable"


def test_a_model_that_cannot_load_ends_the_server_with_a_clear_error(tmp_path):
    import subprocess
    import sys

    from tests.server.server_process import free_port

    (tmp_path / "config.json").write_text('{"model_type": "llama4_vision_model"}')
    r = subprocess.run([sys.executable, "-m", "locus.cli", "serve", "--model", str(tmp_path), "--port", str(free_port()),
                        "--log-level", "critical"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1
    assert "failed to load" in r.stderr and "vision-only" in r.stderr


def test_prompt_logprobs_as_vllm_returns_them(server, client):
    ids = httpx.post(f"{server.base_url}/tokenize", json={"prompt": "score me"}).json()["tokens"]
    r = client.completions.create(model=MODEL, prompt="score me", max_tokens=2, n=2, extra_body={"prompt_logprobs": 2})
    for choice in r.choices:
        scored = choice.model_extra["prompt_logprobs"]
        assert len(scored) == len(ids) and scored[0] is None
        for token_id, entry in zip(ids[1:], scored[1:]):
            own = entry[str(token_id)]
            assert own["logprob"] <= 0 and own["rank"] >= 1 and isinstance(own["decoded_token"], str)
            assert {v["rank"] for k, v in entry.items() if k != str(token_id)} <= {1, 2}
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=1,
                                          extra_body={"prompt_logprobs": 0})
    assert chat.model_extra["prompt_logprobs"][0] is None and len(chat.model_extra["prompt_logprobs"]) > 3
    streamed = httpx.post(f"{server.base_url}/v1/completions",
                          json={"prompt": "x", "max_tokens": 1, "stream": True, "prompt_logprobs": 1})
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "prompt_logprobs"


# ---------------------------------------------------------------- issue 44: fidelity for real clients

@pytest.mark.parametrize("path, body, param", [
    ("/detokenize", {"tokens": [False]}, "tokens"),  # was a 200: false taken as token 0
    ("/detokenize", {"tokens": [72.0]}, "tokens"),  # was a 200: taken as 72
    ("/detokenize", {"tokens": [72, True]}, "tokens"),
    ("/v1/completions", {"prompt": [72, False], "max_tokens": 1}, "prompt"),
    ("/v1/completions", {"prompt": [72.0], "max_tokens": 1}, "prompt"),
    ("/v1/completions", {"prompt": [[72], [1.0]], "max_tokens": 1}, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 1, "stop_token_ids": [True]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "max_tokens": True}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2.0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "2"}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 1, "n": True}, "n"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 1, "stream": 1}, "stream"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 1, "logit_bias": {"65": True}}, "logit_bias"),
    ("/tokenize", {"messages": []}, "messages"),  # was a 200, where chat completions refused it
    ("/v1/chat/completions", {"messages": [], "max_tokens": 1}, "messages"),
])
def test_booleans_floats_and_strings_are_not_token_ids_nor_counts(server, path, body, param):
    r = httpx.post(f"{server.base_url}{path}", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith(param), r.text


def test_tokenize_and_chat_agree_on_what_messages_are(server):
    for path in ("/tokenize", "/v1/chat/completions"):
        r = httpx.post(f"{server.base_url}{path}", json={"messages": [], "max_tokens": 1} if "chat" in path else {"messages": []})
        assert r.json()["error"]["message"] == "messages: List should have at least 1 item after validation, not 0"


def test_a_405_names_the_allowed_methods(server):
    for method, path, allow in (("GET", "/v1/completions", "POST"), ("DELETE", "/tokenize", "POST"),
                                ("POST", "/health", "GET"), ("PUT", "/v1/models", "GET")):
        r = httpx.request(method, f"{server.base_url}{path}")
        assert r.status_code == 405 and r.headers["allow"] == allow
        assert r.json()["error"]["code"] == 405


@pytest.mark.parametrize("body, param, needle", [
    ({"functions": [{"name": "f", "parameters": {}}]}, "functions", "function calling"),
    ({"function_call": "auto"}, "function_call", "function calling"),
    ({"use_beam_search": True}, "use_beam_search", "beam search"),
    ({"allowed_token_ids": [1, 2]}, "allowed_token_ids", "whitelist"),
    ({"audio": {"voice": "x"}}, "audio", "text only"),
    ({"temperature_typo": 0.5}, "temperature_typo", "unknown field"),
])
def test_fields_asked_of_what_the_server_does_not_do_are_refused(server, body, param, needle):
    r = httpx.post(f"{server.base_url}/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param and needle in r.json()["error"]["message"], r.text
    # the values that ask for nothing are accepted
    ok = {"functions": [], "function_call": "none", "use_beam_search": False, "parallel_tool_calls": True,
          "user": "u", "metadata": {"k": "v"}, "modalities": ["text"], "store": False}
    r = httpx.post(f"{server.base_url}/v1/chat/completions",
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **ok})
    assert r.status_code == 200, r.text


def byte_token_ids(tokens: list[str]) -> list[int]:
    """The byte tokenizer's ids of logprobs' token strings (a lone byte of a multi-byte character is
    written `token_id:N`)."""
    from locus.engine.checkpoint.tokenizer import ByteTokenizer

    return [int(t[9:]) if t.startswith("token_id:") else ByteTokenizer.SPECIALS.get(t, None) or ord(t) for t in tokens]


def test_logit_bias_changes_greedy_output_as_specified(server, client):
    args = dict(model=MODEL, prompt="bias me", max_tokens=6, temperature=0, logprobs=0)
    plain = client.completions.create(**args).choices[0]
    plain_ids = byte_token_ids(plain.logprobs.tokens)
    banned = client.completions.create(**args, logit_bias={str(t): -100 for t in plain_ids}).choices[0]
    assert banned.text != plain.text and not set(byte_token_ids(banned.logprobs.tokens)) & set(plain_ids)
    assert banned.logprobs.token_logprobs[0] < 0  # logprobs stay the model's own
    # only the first token banned: the output's first token is the model's second choice there
    second = client.completions.create(**{**args, "max_tokens": 1, "logprobs": 2}).choices[0].logprobs.top_logprobs[0]
    runner_up = sorted(second.items(), key=lambda kv: -kv[1])[1][0]
    one = client.completions.create(**{**args, "max_tokens": 1}, logit_bias={str(plain_ids[0]): -100}).choices[0]
    assert one.logprobs.tokens == [runner_up]
    forced = client.completions.create(**{**args, "max_tokens": 3}, logit_bias={"65": 100})
    assert forced.choices[0].text == "AAA"
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=3,
                                          temperature=0, logit_bias={"66": 100})
    assert chat.choices[0].message.content == "BBB"
    too_many = httpx.post(f"{server.base_url}/v1/completions",
                          json={"prompt": "x", "logit_bias": {str(i): 1 for i in range(1025)}})
    assert too_many.status_code == 400 and "--max-logit-bias" in too_many.json()["error"]["message"]
    outside = httpx.post(f"{server.base_url}/v1/completions", json={"prompt": "x", "logit_bias": {"100000": 1}})
    assert outside.status_code == 400 and "outside the vocabulary" in outside.json()["error"]["message"]


def test_echo_through_the_openai_client(server, client):
    scored = client.completions.create(model=MODEL, prompt="score this", max_tokens=0, echo=True, logprobs=1)
    choice = scored.choices[0]
    count = httpx.post(f"{server.base_url}/tokenize", json={"prompt": "score this"}).json()["count"]
    assert choice.text == "score this" and len(choice.logprobs.tokens) == count and scored.usage.completion_tokens == 0
    assert choice.logprobs.token_logprobs[0] is None and all(v < 0 for v in choice.logprobs.token_logprobs[1:])
    generated = client.completions.create(model=MODEL, prompt=[[104, 105], [106]], max_tokens=2, echo=True,
                                          temperature=0, logprobs=1)
    assert [len(c.logprobs.tokens) for c in generated.choices] == [4, 3]
    assert generated.choices[0].text.startswith("hi")
    # the prompt's logprobs are the same whether the request generates or not
    again = client.completions.create(model=MODEL, prompt=[104, 105], max_tokens=0, echo=True, logprobs=1)
    assert again.choices[0].logprobs.token_logprobs == pytest.approx(generated.choices[0].logprobs.token_logprobs[:2])
    streamed = list(client.completions.create(model=MODEL, prompt="abc", max_tokens=3, echo=True, temperature=0,
                                              stream=True))
    whole = client.completions.create(model=MODEL, prompt="abc", max_tokens=3, echo=True, temperature=0)
    assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text
    assert whole.choices[0].text.startswith("abc")


def test_tokenizer_info_answers_lm_evals_remote_tokenizer(server):
    info = httpx.get(f"{server.base_url}/tokenizer_info").json()
    assert info["eos_token"] == "<|eot|>" and info["tokenizer_class"] == "ByteTokenizer" and info["chat_template"]
    eos = httpx.post(f"{server.base_url}/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False}).json()
    assert eos["tokens"] == [257]
    strs = httpx.post(f"{server.base_url}/tokenize", json={"prompt": "hi", "return_token_strs": True}).json()
    assert strs["token_strs"] == ["<|begin_of_text|>", "h", "i"]
