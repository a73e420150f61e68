"""Structured outputs and honest refusals through the official `openai` client on a real server: the
`tiny` preset's random weights still produce schema-valid JSON (the mask forces it), streamed too;
bad or conflicting constraints, image parts and tools get a 400; --chat-template replaces the format."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.server.server_process import running_server

pytestmark = pytest.mark.slow  # every test talks to a real `locus serve` process

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "sunny", "degrees"],
          "properties": {"city": {"enum": ["Paris", "Lima", "Oslo"]}, "sunny": {"type": "boolean"},
                         "degrees": {"type": "integer", "minimum": -50, "maximum": 50}}}
RESPONSE_FORMAT = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}}


def valid(text: str) -> bool:
    value = json.loads(text)
    return (set(value) == {"city", "sunny", "degrees"} and value["city"] in ("Paris", "Lima", "Oslo")
            and isinstance(value["sunny"], bool) and isinstance(value["degrees"], int) and -50 <= value["degrees"] <= 50)


@pytest.fixture(scope="module")
def server():
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
    with running_server("--model", "tiny", "--chat-template", template) as proc:
        yield proc


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_json_schema_chat_returns_valid_json(client):
    out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "weather?"}],
                                         response_format=RESPONSE_FORMAT, max_tokens=80, temperature=1.0, seed=5, n=2)
    assert [c.finish_reason for c in out.choices] == ["stop", "stop"]
    assert all(valid(c.message.content) for c in out.choices), [c.message.content for c in out.choices]


def test_json_schema_streams_valid_json(client):
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "and now?"}],
                                            response_format=RESPONSE_FORMAT, max_tokens=80, temperature=0.7, seed=9,
                                            stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert valid(text), text


def test_guided_choice_and_regex_on_completions(client):
    out = client.completions.create(model="tiny", prompt="pick", max_tokens=10, temperature=1.0, seed=1,
                                    extra_body={"guided_choice": ["red", "green", "blue"]})
    assert out.choices[0].text in ("red", "green", "blue")
    out = client.completions.create(model="tiny", prompt="code", max_tokens=10, temperature=1.0, seed=2,
                                    extra_body={"structured_outputs": {"regex": r"[A-Z]{2}\d{3}"}})
    assert len(out.choices[0].text) == 5 and out.choices[0].text[:2].isupper() and out.choices[0].text[2:].isdigit()


@pytest.mark.parametrize("body, param, needle", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format", "does not compile"),
    ({"response_format": {"type": "yaml"}}, "response_format", "json_object or json_schema"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex", "one output constraint"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "what is this?"},
                                                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA=="}}]}]},
     "messages[0].content", "text only"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools", "not supported"),
    ({"tool_choice": "auto"}, "tool_choice", "not supported"),
])
def test_refusals_are_400s_that_name_the_field(server, body, param, needle):
    request = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body}
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json=request, timeout=30)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and needle in error["message"], error
    assert httpx.get(f"{server.base_url}/health").status_code == 200


def test_the_chat_template_flag_replaces_the_format(server):
    r = httpx.post(f"{server.base_url}/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    text = httpx.post(f"{server.base_url}/detokenize", json={"tokens": r["tokens"]}).json()["prompt"]
    assert text == "[user] hi\n[assistant] "
