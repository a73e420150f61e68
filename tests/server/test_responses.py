"""SSE frames: the templated frame of a plain text delta is byte for byte the frame the generic
renderer writes, for completions and chat, whatever the text holds."""

from __future__ import annotations

import json

import pytest

from locus.engine.core.outputs import CompletionOutput, RequestOutput
from locus.engine.requests.sequence import RequestMetrics
from locus.engine.checkpoint.tokenizer import ByteTokenizer
from locus.server import responses

TEXTS = ["", "a", 'quote " and backslash \\', "line\nbreak\ttab\x01\x1f", "h\u00e9llo \u2028 \U0001f600", "\x00", "</script>"]


@pytest.mark.parametrize("fmt_class", [responses.CompletionFormat, responses.ChatFormat])
@pytest.mark.parametrize("text", TEXTS)
def test_templated_text_frame_equals_the_generic_frame(fmt_class, text):
    fmt = fmt_class('model "x"', ByteTokenizer(ByteTokenizer.MIN_VOCAB))
    choice = CompletionOutput(index=1, text=text, token_ids=[5], delta_text=text, delta_token_ids=[5])
    generic = responses.sse(fmt._chunk("cmpl-1", [fmt.delta_choice(3, choice)]))
    assert fmt._text_frame("cmpl-1", 3, text) == generic
    body = json.loads(generic[len("data: "):])
    delta = body["choices"][0]
    assert (delta.get("text") if "text" in delta else delta["delta"]["content"]) == text


def test_stream_chunk_uses_the_template_only_for_plain_deltas():
    fmt = responses.CompletionFormat("m", ByteTokenizer(ByteTokenizer.MIN_VOCAB))
    usage = responses.Usage()

    def out(delta: str, finish: str | None) -> RequestOutput:
        c = CompletionOutput(index=0, text=delta, token_ids=[1], delta_text=delta, delta_token_ids=[1],
                             finish_reason=finish, stop_reason=None)
        return RequestOutput("r", [9, 9], [c], finish is not None, RequestMetrics())

    plain, last = fmt.stream_chunk("r", 0, 1, out("hi", None), usage), fmt.stream_chunk("r", 0, 1, out("!", "length"), usage)
    assert json.loads(plain[0][6:])["choices"][0] == {"index": 0, "text": "hi", "logprobs": None,
                                                      "finish_reason": None, "stop_reason": None}
    assert json.loads(last[0][6:])["choices"][0]["finish_reason"] == "length"
    assert usage.as_dict() == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}
    assert fmt._templates.keys() == {0}  # the finishing frame went the generic way


@pytest.mark.parametrize("fmt_class", [responses.CompletionFormat, responses.ChatFormat])
def test_frames_hold_no_character_that_a_line_splitting_client_breaks_on(fmt_class):
    """JSON allows U+2028, U+2029 and U+0085 raw; Python's str.splitlines (httpx's aiter_lines)
    breaks lines on them, so a frame must carry them escaped."""
    text = "a\u2028b\u2029c\x85d"
    fmt = fmt_class("m\u2028", ByteTokenizer(ByteTokenizer.MIN_VOCAB))
    choice = CompletionOutput(index=0, text=text, token_ids=[5], delta_text=text, delta_token_ids=[5],
                              finish_reason="stop", stop_reason="\u2029")
    frames = [fmt._text_frame("cmpl-1", 0, text), responses.sse(fmt._chunk("cmpl-1", [fmt.delta_choice(0, choice)]))]
    for frame in frames:
        assert frame.splitlines() == frame.split("\n")[:2]  # one data line, then the blank line
        body = json.loads(frame[len("data: "):])
        assert body["model"] == "m\u2028"
        delta = body["choices"][0]
        assert (delta.get("text") if "text" in delta else delta["delta"]["content"]) == text
