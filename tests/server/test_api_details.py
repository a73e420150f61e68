"""API details real clients read (issue 53): `stop_reason` as vLLM sets it, and OpenAI's
`usage.prompt_tokens_details.cached_tokens` when the prefix cache served part of a prompt. A real
`locus serve` process, the official openai client and raw SSE."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from locus.engine.checkpoint.tokenizer import ByteTokenizer
from locus.server import openapi
from tests.server.server_process import running_server

pytestmark = pytest.mark.slow  # every test talks to a real `locus serve` process

MODEL = "tiny"
BLOCK = 16
EOS, A = ByteTokenizer.EOS, ord("a")


@pytest.fixture(scope="module")
def server():
    with running_server("--model", MODEL, "--num-kv-blocks", "256", "--block-size", str(BLOCK)) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def post(server, path: str, body: dict) -> dict:
    r = httpx.post(f"{server.base_url}{path}", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def stream(server, path: str, body: dict) -> list[dict]:
    """The chunks of a streamed request, as JSON (the `[DONE]` line dropped)."""
    with httpx.stream("POST", f"{server.base_url}{path}", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


# (extra request fields, finish_reason, stop_reason): a logit_bias of 100 makes the token certain
ENDINGS = [
    pytest.param({"logit_bias": {str(EOS): 100}}, "stop", None, id="eos-null"),
    pytest.param({"logit_bias": {str(A): 100}, "stop_token_ids": [A]}, "stop", A, id="stop-token-id"),
    pytest.param({"logit_bias": {str(A): 100}, "stop": ["a"]}, "stop", "a", id="stop-string"),
    pytest.param({"logit_bias": {str(A): 100}}, "length", None, id="length-null"),
    # the tokenizer's end-of-text asked for as a stop token, with ignore_eos: vLLM reports its id
    pytest.param({"logit_bias": {str(EOS): 100}, "stop_token_ids": [EOS], "ignore_eos": True}, "stop", EOS,
                 id="eos-as-stop-token-id"),
]


@pytest.mark.parametrize("extra, finish, stop_reason", ENDINGS)
def test_stop_reason_is_what_vllm_reports(server, extra, finish, stop_reason):
    completion = {"model": MODEL, "prompt": "stop here", "max_tokens": 3, "temperature": 0, **extra}
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "stop here"}], "max_tokens": 3,
            "temperature": 0, **extra}
    for path, body in (("/v1/completions", completion), ("/v1/chat/completions", chat)):
        whole = post(server, path, body)["choices"][0]
        assert (whole["finish_reason"], whole["stop_reason"]) == (finish, stop_reason), path
        last = [c["choices"][0] for c in stream(server, path, body) if c["choices"]][-1]
        assert (last["finish_reason"], last["stop_reason"]) == (finish, stop_reason), f"{path} streamed"


def cached(usage: dict) -> int | None:
    details = usage.get("prompt_tokens_details")
    return None if details is None else details["cached_tokens"]


# the OpenAPI document's models of a whole response and of a chunk (they forbid undocumented fields)
DOCUMENTED = {"/v1/completions": (openapi.CompletionResponse, openapi.CompletionChunk),
              "/v1/chat/completions": (openapi.ChatCompletionResponse, openapi.ChatCompletionChunk)}


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_repeated_prompt_reports_its_cached_tokens_whole_and_streamed(server, path):
    text = f"{path} " + "a long shared prefix of many blocks " * 6
    if path == "/v1/completions":
        body = {"model": MODEL, "prompt": text, "max_tokens": 2, "temperature": 0}
    else:
        body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 2, "temperature": 0}
    whole_model, chunk_model = DOCUMENTED[path]
    first = post(server, path, body)["usage"]
    assert "prompt_tokens_details" not in first  # nothing cached yet: the field is left out
    prompt_tokens = first["prompt_tokens"]
    # every full block but the one holding the last prompt token (its logits must be computed)
    expected = (prompt_tokens - 1) // BLOCK * BLOCK
    assert expected >= 4 * BLOCK
    response = post(server, path, body)
    whole_model.model_validate(response)
    second = response["usage"]
    assert cached(second) == expected and second["prompt_tokens"] == prompt_tokens
    chunks = stream(server, path, {**body, "stream_options": {"include_usage": True}})
    chunk_model.model_validate(chunks[-1])
    assert chunks[-1]["choices"] == [] and cached(chunks[-1]["usage"]) == expected
    # n choices share one prompt: counted once, as prompt_tokens is
    both = post(server, path, {**body, "n": 2, "temperature": 1.0, "seed": 1})["usage"]
    assert cached(both) == expected and both["prompt_tokens"] == prompt_tokens


def test_the_openai_client_reads_cached_tokens(client):
    prompt = "the openai client's prompt, long enough to fill several KV blocks of sixteen tokens"
    for _ in range(2):
        whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert whole.usage.prompt_tokens_details.cached_tokens == (whole.usage.prompt_tokens - 1) // BLOCK * BLOCK > 0
    messages = [{"role": "user", "content": prompt}]
    for _ in range(2):
        chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0)
    chat_cached = chat.usage.prompt_tokens_details.cached_tokens
    assert chat_cached % BLOCK == 0 and chat_cached > 0
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == chat_cached
