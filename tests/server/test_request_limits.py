"""Issue 41's inputs that cost more than they should, and its 500s, each against a real server: the
request limits (body size, prompts per request, stop text), chat text parts that are not strings,
lone surrogates in `model` and in keys, and bodies nested 100,000 deep on every JSON endpoint. Issue
55: the logprob entries one scoring response may hold, and such a response built off the event loop."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from tests.server.server_process import rss_mb, running_server

pytestmark = pytest.mark.slow

JSON = {"content-type": "application/json"}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The server (--max-logprob-entries left at its default) and a client of it."""
    with running_server("--model", "tiny", "--max-request-body-bytes", "1MiB", "--max-prompts-per-request", "8",
                        "--max-stop-chars", "64", "--enable-trace-api",
                        "--trace-dir", str(tmp_path_factory.mktemp("traces"))) as proc:
        with httpx.Client(base_url=proc.base_url, timeout=60) as http:
            yield proc, http
        assert proc.poll() is None


@pytest.fixture(scope="module")
def server(served):
    return served[1]


def error_of(r: httpx.Response, status: int = 400, param: str | None = None) -> str:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, error
    return error["message"]


def test_a_body_over_the_limit_is_refused_before_it_is_read(server):
    """Finding 7: a 100 MB body cost +313 MB RSS and stalled the streams while it was parsed."""
    big = b'{"prompt": "' + b"a" * (2 << 20) + b'", "max_tokens": 1}'
    message = error_of(server.post("/v1/completions", content=big, headers=JSON))
    assert message == (f"the request body is {len(big)} bytes; this server accepts at most 1048576 "
                       "(--max-request-body-bytes)")
    assert server.post("/tokenize", json={"prompt": "still served"}).status_code == 200  # the same connection

    def chunked():  # no Content-Length: counted as it arrives
        yield b'{"prompt": "'
        for _ in range(4):
            yield b"a" * (512 << 10)
        yield b'", "max_tokens": 1}'

    message = error_of(server.post("/v1/chat/completions", content=chunked(), headers=JSON))
    assert message == "the request body is over 1048576 bytes, the most this server accepts (--max-request-body-bytes)"
    fits = b'{"prompt": "' + b"a" * 1000 + b'", "max_tokens": 1}'
    assert server.post("/v1/completions", content=fits, headers=JSON).status_code == 200


def test_prompts_per_request_are_bounded(server):
    """Finding 7: 20,000 prompts in one request made a bystander wait 7.8 s."""
    for prompt in (["x"] * 9, [[65, 66]] * 9):
        message = error_of(server.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1}), param="prompt")
        assert message == "9 prompts in one request; this server takes at most 8 (--max-prompts-per-request)"
    r = server.post("/v1/completions", json={"prompt": ["x"] * 8, "max_tokens": 1})
    assert r.status_code == 200 and len(r.json()["choices"]) == 8
    assert server.post("/v1/completions", json={"prompt": [65] * 20, "max_tokens": 1}).status_code == 200  # one prompt


def test_stop_text_is_bounded(server):
    """Finding 7: only the number of stop strings was capped; four of 256K characters each slowed
    every other request (quadratic matching, fixed apart)."""
    for stop in ("s" * 65, ["a" * 30, "b" * 35]):
        body = {"prompt": "x", "max_tokens": 1, "stop": stop}
        message = error_of(server.post("/v1/chat/completions" if isinstance(stop, str) else "/v1/completions",
                                       json={**body, "messages": [{"role": "user", "content": "x"}]}), param="stop")
        assert message == "the stop strings hold 65 characters; this server takes at most 64 in all (--max-stop-chars)"
    assert server.post("/v1/completions", json={"prompt": "x", "max_tokens": 1, "stop": ["a" * 32] * 2}).status_code == 200


# Issue 55, finding 1: a ~23 KB body that asked for ~100 MB of JSON (2 prompts x n 128 x 2,048 echoed
# tokens x 6 entries), which blocked the event loop for seconds and grew the RSS by hundreds of MB
SCORING = {"prompt": [[(7 * i + p) % 256 for i in range(2048)] for p in (0, 1)], "max_tokens": 0, "echo": True,
           "logprobs": 5, "n": 128}
DEFAULT_ENTRIES = 1 << 20  # --max-logprob-entries' default


def test_logprob_entries_are_bounded(server):
    """prompts x n x (echoed prompt + max_tokens) x (logprobs + 1), and vLLM's prompt_logprobs, before
    anything is queued; chat's entries each come with a generated token and are not counted."""
    message = error_of(server.post("/v1/completions", json=SCORING), param="logprobs")
    assert message == ("the response would hold 3145728 logprob entries (prompts x n x tokens x (logprobs + 1)); this "
                       f"server returns at most {DEFAULT_ENTRIES} in one response (--max-logprob-entries)")
    # vLLM's prompt_logprobs go on every choice; without max_tokens a choice may fill the context (4,096)
    for body, param, entries in (({"prompt": [65] * 2048, "max_tokens": 1, "n": 128, "prompt_logprobs": 4},
                                  "prompt_logprobs", 128 * 2048 * 5),
                                 ({"prompt": "ab", "max_tokens": None, "n": 128, "logprobs": 3}, "logprobs",
                                  128 * (4096 - 3) * 4)):
        assert f" {entries} logprob entries" in error_of(server.post("/v1/completions", json=body), param=param)
    within = {**SCORING, "prompt": SCORING["prompt"][0], "n": DEFAULT_ENTRIES // (2048 * 6)}
    r = server.post("/v1/completions", json=within)
    assert r.status_code == 200 and len(r.json()["choices"]) == 85
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "n": 128, "logprobs": True, "top_logprobs": 20}
    assert server.post("/v1/chat/completions", json=chat).status_code == 200


def health_while(http: httpx.Client, send) -> tuple[httpx.Response, float]:
    """`send()`'s answer, and the longest /health took while it ran."""
    longest, done = [0.0], threading.Event()

    def poll() -> None:
        with httpx.Client(base_url=http.base_url, timeout=60) as other:
            while not done.is_set():
                started = time.monotonic()
                assert other.get("/health").status_code == 200
                longest[0] = max(longest[0], time.monotonic() - started)
                time.sleep(0.02)

    poller = threading.Thread(target=poll)
    poller.start()
    try:
        return send(), longest[0]
    finally:
        done.set()
        poller.join()


def test_a_scoring_response_is_built_off_the_event_loop(served):
    """Finding 1: a response within the limit (1,032,192 entries, ~28 MB) was built on the event loop:
    /health waited 3 s for it and each one left the RSS higher. Built choice by choice on one worker
    thread, /health answers at once and the RSS stays near its baseline."""
    proc, http = served
    body = {**SCORING, "n": 42}
    http.post("/v1/completions", json={**body, "n": 1}).raise_for_status()  # the engine's own scoring high-water mark
    baseline = rss_mb(proc.pid)
    for _ in range(3):
        r, longest = health_while(http, lambda: http.post("/v1/completions", json=body))
        assert longest < 1.5, f"/health took {longest:.2f} s while a scoring response was built"
        assert r.status_code == 200
        choices = r.json()["choices"]
        assert len(choices) == 84 and all(len(c["logprobs"]["tokens"]) == 2048 for c in choices)
    grown = rss_mb(proc.pid) - baseline
    assert grown < 100, f"the server's RSS grew {grown:.0f} MB over three scoring responses"


@pytest.mark.parametrize("part, got", [
    ({"type": "text", "text": {"type": "text", "text": "x"}}, "a JSON object"),
    ({"type": "text", "text": ["x"]}, "a JSON array"),
    ({"type": "text", "text": 5}, "a JSON number"),
    ({"type": "text", "text": None}, "a JSON null"),
    ({"type": "text"}, "missing"),
])
def test_a_text_part_whose_text_is_not_a_string_is_a_400(server, part, got):
    """Issue 41: a content part whose text was not a string (even nested) was a TypeError in the
    tokenizer's content join: a 500, on chat and on /tokenize."""
    messages = [{"role": "user", "content": [{"type": "text", "text": "fine"}, part]}]
    for path, body in (("/v1/chat/completions", {"messages": messages, "max_tokens": 1}), ("/tokenize", {"messages": messages})):
        message = error_of(server.post(path, json=body), param="messages[0].content[1].text")
        assert message == f"a text content part's text must be a string; it is {got}"


@pytest.mark.parametrize("path, raw, param", [
    ("/v1/completions", '{"model": "\\ud800", "prompt": "hi", "max_tokens": 1}', "model"),
    ("/v1/chat/completions", '{"model": "a\\udfffb", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}',
     "model"),
    ("/detokenize", '{"model": "\\ud800", "tokens": [65]}', "model"),
    ("/tokenize", '{"model": "\\ud800", "prompt": "x"}', "model"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 1, "x": {"\\ud800": "\\udc00"}}', "x.\\ud800"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 1, "x": {"\\ud800": 1}}', "x.\\ud800"),
    ("/v1/completions", '{"prompt": "hi", "max_tokens": 1, "x": [{"k": ["\\udc00"]}]}', "x.0.k.0"),
])
def test_a_lone_surrogate_in_model_or_in_a_key_is_a_400(server, path, raw, param):
    """Issue 41: a lone surrogate in `model` (/v1/completions, /detokenize) or in a nested extra key
    made the error message itself unencodable: a 500."""
    message = error_of(server.post(path, content=raw.encode(), headers=JSON), param=param)
    assert message == f"{param} contains a lone UTF-16 surrogate, which is not valid Unicode text"


DEEP = "[" * 100_000 + "]" * 100_000


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize",
                                  "/traces/start"])
@pytest.mark.parametrize("where", ["whole", "field"])
def test_a_body_nested_100k_deep_is_a_400_on_every_json_endpoint(server, path, where):
    raw = DEEP if where == "whole" else '{"prompt": "x", "max_tokens": 1, "path": "t", "tokens": [1], "x": ' + DEEP + "}"
    message = error_of(server.post(path, content=raw.encode(), headers=JSON))
    assert message == "malformed JSON body: it nests deeper than the parser allows (about 1000 levels)"
    assert server.get("/health").status_code == 200


def test_the_defaults_are_what_the_docs_say():
    from locus.cli import build_parser

    args = build_parser().parse_args(["serve"])
    assert (args.max_request_body_bytes, args.max_prompts_per_request, args.max_stop_chars) == ("32MiB", 1024, 4096)
    assert args.max_logprob_entries == DEFAULT_ENTRIES


def test_a_deep_or_undecodable_body_on_ep_replan_is_a_400():
    """Issue 41: POST /ep/replan parsed its body by hand and a 100k-deep one was a RecursionError (500)."""
    with running_server("--model", "tiny", "--ep-ranks", "2", "--replan-api") as proc:
        for raw in (DEEP.encode(), b"\xff\xfe{}", b'{"force": ' + b"9" * 5000 + b"}"):
            r = httpx.post(f"{proc.base_url}/ep/replan", content=raw, headers=JSON, timeout=60)
            assert r.status_code == 400, r.text
            assert r.json()["error"]["message"].startswith("malformed JSON body")
        assert httpx.get(f"{proc.base_url}/health").status_code == 200
