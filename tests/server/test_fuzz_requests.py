"""Property-based fuzz of request bodies against a real server: whatever the body, the answer is a
200 or a 4xx OpenAI error object (never a 5xx, never a dropped connection), a stream is well formed,
and the server stays healthy. Seeded (derandomized) and bounded, so CI sees the same bodies each run.

Values mix the valid (small, so each request is quick) with the hostile: integers past 2**63, NaN
and infinities, wrong types, nested junk, and text with lone surrogates and line separators."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.server.server_process import running_server

HUGE = st.one_of(st.integers(min_value=-(2**70), max_value=2**70),
                 st.sampled_from([2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64, 2**64 + 5, -(2**63) - 1, -1, 0]))
# any code point, lone surrogates included, with the troublesome ones made common
CHAR = st.one_of(st.characters(blacklist_categories=()),
                 st.sampled_from(["\ud800", "\udfff", "\u2028", "\u2029", "\x85", "\x00", "\n", "\u00e9", "\U0001f600"]))
TEXT = st.text(alphabet=CHAR, max_size=12)
JUNK = st.one_of(st.none(), st.booleans(), HUGE, HUGE, HUGE, st.floats(), TEXT, st.lists(HUGE, max_size=3),
                 st.lists(TEXT, max_size=3), st.dictionaries(TEXT, st.integers(), max_size=2))

# Valid values, small enough that every request is quick.
COMMON = {
    "model": st.just("tiny"),
    "n": st.integers(1, 3),
    "temperature": st.floats(0, 2),
    "top_p": st.floats(0.01, 1),
    "top_k": st.integers(-1, 261),
    "min_p": st.floats(0, 1),
    "seed": HUGE,
    "stop": st.one_of(TEXT, st.lists(TEXT, max_size=4)),
    "stop_token_ids": st.lists(st.integers(0, 260), max_size=3),
    "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.1, 2),
    "min_tokens": st.integers(0, 6),
    "ignore_eos": st.booleans(),
    "stream": st.booleans(),
    "skip_special_tokens": st.booleans(),
    "include_stop_str_in_output": st.booleans(),
    "domain": TEXT,
    "user": TEXT,
}
PROMPT = st.one_of(TEXT.filter(bool), st.lists(TEXT, min_size=1, max_size=3), st.lists(st.integers(0, 260), min_size=1, max_size=6),
                   st.lists(st.lists(st.integers(0, 260), min_size=1, max_size=4), min_size=1, max_size=2))
CONTENT = st.one_of(TEXT, st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}), max_size=2))
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]), "content": CONTENT})


def bodies(required: dict, optional: dict) -> st.SearchStrategy:
    """A valid body, or one with a single field (required or optional) turned hostile: a body
    with many bad fields would only ever test the first check it meets."""
    valid = st.fixed_dictionaries(required, optional=optional)
    names = sorted({*required, *optional, "stream_options", "extra_field"})

    def spoil(body: dict) -> st.SearchStrategy:
        return st.one_of(st.just(body), st.tuples(st.sampled_from(names), JUNK).map(lambda kv: {**body, kv[0]: kv[1]}))

    return valid.flatmap(spoil)


COMPLETION = bodies({"prompt": PROMPT, "max_tokens": st.integers(1, 6)},
                    {**COMMON, "logprobs": st.integers(0, 5), "echo": st.just(False), "best_of": st.just(1)})
# chat always bounds max_tokens: its default is "up to the context", too long for a fuzz loop
CHAT = bodies({"messages": st.lists(MESSAGE, min_size=1, max_size=3), "max_tokens": st.integers(1, 6)},
              {**COMMON, "logprobs": st.booleans(), "top_logprobs": st.integers(0, 5)})
TOKENIZE = bodies({}, {"prompt": TEXT, "messages": st.lists(MESSAGE, max_size=2), "add_special_tokens": st.booleans()})

# Structured outputs: small random schemas (with the keywords the constraint refuses mixed in),
# regexes and grammars from a tiny alphabet of pieces, choice lists; valid, unsatisfiable, or broken.
SCALAR = st.one_of(
    st.fixed_dictionaries({"type": st.just("string")}, optional={"maxLength": st.integers(0, 8), "minLength": st.integers(0, 4),
                                                                 "pattern": st.sampled_from(["^[a-c]+$", "[0-9]{2}", "(", ""])}),
    st.fixed_dictionaries({"type": st.sampled_from(["integer", "number"])},
                          optional={"minimum": st.integers(-5, 5), "maximum": st.integers(-5, 5), "multipleOf": st.just(3)}),
    st.fixed_dictionaries({"enum": st.lists(st.one_of(TEXT, st.integers(0, 9)), max_size=3)}),
    st.just({"type": "boolean"}), st.just({"not": {"type": "null"}}), st.just({"$ref": "#/nowhere"}))
SCHEMA = st.recursive(SCALAR, lambda inner: st.one_of(
    st.fixed_dictionaries({"type": st.just("object"), "properties": st.dictionaries(st.sampled_from(["a", "b", "not"]), inner, max_size=2)},
                          optional={"required": st.lists(st.sampled_from(["a", "b", "c"]), max_size=2),
                                    "additionalProperties": st.booleans()}),
    st.fixed_dictionaries({"type": st.just("array"), "items": inner}, optional={"maxItems": st.integers(0, 3),
                                                                             "minItems": st.integers(0, 5)}),
    st.fixed_dictionaries({"anyOf": st.lists(inner, min_size=1, max_size=2)})), max_leaves=4)
REGEX = st.lists(st.sampled_from(["a", "b|c", "[0-9]", "+", "*", "?", "(", ")", "{2}", "[^\\x00-\\U0010FFFF]", "\\d", "."]),
                 min_size=1, max_size=5).map("".join)
GRAMMAR = st.sampled_from(['root ::= "a" | "b"', 'root ::= root "a"', 'root ::= x', 'root ::= [0-9]+', 'root ::= "x" root?', ""])
STRUCTURED = st.one_of(
    st.fixed_dictionaries({"guided_json": SCHEMA}), st.fixed_dictionaries({"guided_regex": REGEX}),
    st.fixed_dictionaries({"guided_grammar": GRAMMAR}), st.fixed_dictionaries({"guided_choice": st.lists(TEXT, max_size=3)}),
    st.fixed_dictionaries({"response_format": st.one_of(st.just({"type": "json_object"}), SCHEMA.map(
        lambda s: {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}))}))
CONSTRAINED = st.tuples(st.fixed_dictionaries({"prompt": TEXT.filter(bool), "max_tokens": st.integers(1, 12)},
                                              optional={"temperature": st.floats(0, 2), "n": st.integers(1, 2),
                                                        "stream": st.booleans(), "min_tokens": st.integers(0, 6)}),
                        STRUCTURED).map(lambda parts: {**parts[0], **parts[1]})


@pytest.fixture(scope="module")
def server():
    # a 64-token context bounds every generation, whatever max_tokens a spoiled body leaves out
    with running_server("--model", "tiny", "--num-kv-blocks", "256", "--max-model-len", "64") as proc:
        with httpx.Client(base_url=proc.base_url, timeout=60) as http:
            yield http
        assert proc.poll() is None, "the server died during the fuzz run"


def check(http: httpx.Client, path: str, body) -> None:
    raw = json.dumps(body, allow_nan=True)  # NaN/Infinity literals too: not JSON, must still be a 400
    with http.stream("POST", path, content=raw, headers={"content-type": "application/json"}) as r:
        payload = r.read().decode()
    assert r.status_code == 200 or 400 <= r.status_code < 500, f"{r.status_code} for {raw[:500]}: {payload[:500]}"
    if r.status_code != 200:
        error = json.loads(payload)["error"]
        assert set(error) == {"message", "type", "param", "code"}
        return
    if r.headers["content-type"].startswith("text/event-stream"):
        frames = [line for line in payload.split("\n") if line]
        assert frames[-1] == "data: [DONE]" or '"error"' in frames[-1], payload[-500:]
        for frame in frames[:-1]:
            json.loads(frame.removeprefix("data: "))
    else:
        json.loads(payload)


FUZZ = settings(max_examples=200, derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


@FUZZ
@given(body=COMPLETION)
@example(body={"prompt": "hi", "max_tokens": 2, "top_k": 2**63, "temperature": 1})  # killed the engine once
@example(body={"prompt": "\ud800", "max_tokens": 2})  # was a 500
def test_fuzzed_completion_bodies(server, body):
    check(server, "/v1/completions", body)


@FUZZ
@given(body=CHAT)
def test_fuzzed_chat_bodies(server, body):
    check(server, "/v1/chat/completions", body)


@settings(FUZZ, max_examples=60)
@given(body=TOKENIZE)
def test_fuzzed_tokenize_bodies(server, body):
    check(server, "/tokenize", body)


@settings(FUZZ, max_examples=120)
@given(body=CONSTRAINED)
@example(body={"prompt": "x", "max_tokens": 4, "guided_regex": "[^\\x00-\\U0010FFFF]"})  # killed the engine once
@example(body={"prompt": "x", "max_tokens": 4, "min_tokens": 5, "guided_regex": "a"})  # dead-ends after one token
def test_fuzzed_structured_output_bodies(server, body):
    """Never a 5xx, never a dead server, and every request answered within its time bound (the
    grammar budget): the client's own timeout below would fail the test otherwise."""
    check(server, "/v1/completions", body)


def test_the_server_is_healthy_after_the_fuzz(server):
    assert server.get("/health").json() == {"status": "ok"}
