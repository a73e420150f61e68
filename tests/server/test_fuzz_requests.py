"""Property-based fuzz of request bodies against a real server: whatever the body, the answer is a
200 or a 4xx OpenAI error object (never a 5xx, never a dropped connection), a stream is well formed,
and the server stays healthy. Seeded (derandomized) and bounded, so CI sees the same bodies each run.

Values mix the valid (small, so each request is quick) with the hostile: integers past 2**63, NaN
and infinities, wrong types, nested junk, and text with lone surrogates and line separators. Issue 41
added: a lone surrogate anywhere in a valid body (any value, any key, `model`), bodies nested up to
150,000 deep on every POST endpoint, stop strings up to 300,000 characters, and bodies around the
server's size limit with and without Content-Length; every request is answered within TIME_BOUND."""

from __future__ import annotations

import json
import time

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from tests.server.server_process import running_server

pytestmark = pytest.mark.slow  # every test talks to a real `locus serve` process

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


BODY_LIMIT = 1 << 20  # the fuzz server's --max-request-body-bytes: bodies around it stay quick to send
TIME_BOUND = 30.0  # seconds any one request may take (a 64-token context, a 2-core machine shared with others)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # a 64-token context bounds every generation, whatever max_tokens a spoiled body leaves out
    with running_server("--model", "tiny", "--num-kv-blocks", "256", "--max-model-len", "64",
                        "--max-request-body-bytes", str(BODY_LIMIT), "--enable-trace-api",
                        "--trace-dir", str(tmp_path_factory.mktemp("traces"))) as proc:
        with httpx.Client(base_url=proc.base_url, timeout=60) as http:
            yield http
        assert proc.poll() is None, "the server died during the fuzz run"


def check(http: httpx.Client, path: str, body, raw: bytes | None = None) -> None:
    """POST `body` (or `raw` bytes, or a generator of chunks: no Content-Length): a 200 or a 4xx error
    object, a well-formed stream, within TIME_BOUND."""
    if raw is None:
        raw = json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")  # NaN/Infinity too: must be 400s
    started = time.monotonic()
    with http.stream("POST", path, content=raw, headers={"content-type": "application/json"}) as r:
        payload = r.read().decode()
    elapsed = time.monotonic() - started
    shown = raw[:300] if isinstance(raw, bytes) else b"<chunked>"
    assert elapsed < TIME_BOUND, f"{elapsed:.1f} s for {shown}"
    assert r.status_code == 200 or 400 <= r.status_code < 500, f"{r.status_code} for {shown}: {payload[:500]}"
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


# ---------------------------------------------------------------- issue 41's shapes

SURROGATE = st.sampled_from(["\ud800", "x\udfffy", "\udc00\ud800"])


@st.composite
def surrogate_anywhere(draw, bodies):
    """A valid body with a lone surrogate put at one random place: a value replaced, a text extended,
    or a key added, at any depth (the top level, a message, a nested extra object)."""
    body = draw(bodies)
    containers = [body]
    stack = [body]
    while stack:
        item = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        for child in children:
            if isinstance(child, (dict, list)):
                containers.append(child)
                stack.append(child)
    target = draw(st.sampled_from(containers))
    bad = draw(SURROGATE)
    if isinstance(target, dict) and (not target or draw(st.booleans())):
        target[draw(st.sampled_from([bad, "model", "user", "x"]))] = draw(st.one_of(st.just(bad), st.integers(), JUNK))
    elif isinstance(target, dict):
        key = draw(st.sampled_from(sorted(target)))
        target[key] = (target[key] + bad) if isinstance(target[key], str) else bad
    elif target:
        target[draw(st.integers(0, len(target) - 1))] = bad
    else:
        target.append(bad)
    return body


ANY_BODY = st.one_of(COMPLETION, CHAT, TOKENIZE)
ENDPOINTS = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/traces/start", "/traces/stop",
             "/traces/dump", "/ep/replan"]


@settings(FUZZ, max_examples=120)
@given(body=surrogate_anywhere(ANY_BODY), path=st.sampled_from(ENDPOINTS[:4]))
@example(body={"model": "\ud800", "prompt": "hi", "max_tokens": 2}, path="/v1/completions")  # was a 500
@example(body={"model": "\ud800", "tokens": [65]}, path="/detokenize")  # was a 500
@example(body={"prompt": "hi", "max_tokens": 2, "x": {"\ud800": "\udc00"}}, path="/v1/completions")  # was a 500
def test_a_lone_surrogate_anywhere(server, body, path):
    check(server, path, body)


@settings(FUZZ, max_examples=60)
@given(path=st.sampled_from(ENDPOINTS), depth=st.integers(100, 150_000), opener=st.sampled_from(["[", '{"a": ']),
       inside=st.booleans())
@example(path="/ep/replan", depth=100_000, opener="[", inside=False)
def test_a_deep_body_on_every_json_endpoint(server, path, depth, opener, inside):
    closer = "]" if opener == "[" else "}"
    deep = opener * depth + "1" + closer * depth
    raw = ('{"prompt": "x", "max_tokens": 1, "messages": [], "tokens": [1], "extra": ' + deep + "}") if inside else deep
    check(server, path, None, raw.encode())


@settings(FUZZ, max_examples=40)
@given(stops=st.lists(st.tuples(CHAR, st.integers(1, 300_000)), min_size=1, max_size=4),
       body=st.fixed_dictionaries({"prompt": TEXT.filter(bool), "max_tokens": st.integers(1, 6)},
                                  optional={"n": st.integers(1, 8), "stream": st.booleans(),
                                            "include_stop_str_in_output": st.booleans()}))
def test_huge_stop_strings(server, stops, body):
    check(server, "/v1/completions", {**body, "stop": [c * n for c, n in stops]})


@settings(FUZZ, max_examples=20)
@given(size=st.integers(BODY_LIMIT // 2, 2 * BODY_LIMIT), chunked=st.booleans(), path=st.sampled_from(ENDPOINTS[:4]))
def test_big_bodies(server, size, chunked, path):
    head, tail = b'{"prompt": "', b'", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}], "tokens": [1]}'
    raw = head + b"a" * max(0, size - len(head) - len(tail)) + tail

    def chunks():
        for i in range(0, len(raw), 64 << 10):
            yield raw[i:i + (64 << 10)]

    check(server, path, None, chunks() if chunked else raw)


def test_the_server_is_healthy_after_the_fuzz(server):
    assert server.get("/health").json() == {"status": "ok"}
