"""The request-text scans of locus/server/prompts.py, on parsed bodies: where a lone surrogate sits
(the 400's parameter path), how many characters of text a body holds, and that token ids, numbers
and booleans are passed over (a prompt of ids holds no text) while text among them is still found."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from locus.server.prompts import lone_surrogate_path, text_chars

BAD = "x\ud800"  # what json.loads makes of "x\\ud800"


class Body(BaseModel):
    model_config = ConfigDict(extra="allow")
    prompt: object = None


def test_a_lone_surrogate_is_found_by_its_path_among_token_ids():
    assert lone_surrogate_path({"prompt": [1, 2, 3, BAD]}) == "prompt.3"
    assert lone_surrogate_path({"prompt": [[5, 6], [7, BAD, 8]]}) == "prompt.1.1"
    assert lone_surrogate_path({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "fine, é"}, {"type": "text", "text": BAD}]}]}) == "messages.0.content.1.text"
    assert lone_surrogate_path(Body(prompt=[0, 1, BAD], note=BAD)) == "prompt.2"  # fields first, then extras
    assert lone_surrogate_path(Body(prompt=[0, 1], note=[True, None, 2.5, BAD])) == "note.3"
    assert lone_surrogate_path(BAD) == "body"


def test_bodies_without_one_pass():
    ids = list(range(100_000))
    assert lone_surrogate_path({"prompt": ids, "max_tokens": 5, "echo": True, "stop": None}) is None
    assert lone_surrogate_path({"prompt": [ids[:64]] * 32}) is None
    assert lone_surrogate_path({"prompt": "paired: \U0001F600", "suffix": "é"}) is None


def test_text_chars_counts_text_only():
    assert text_chars({"prompt": list(range(1000)), "model": "abc"}) == 3
    assert text_chars({"prompt": ["ab", [1, 2, "cde"]], "meta": {"x": "f", "n": 4.5, "b": False}}) == 6
    assert text_chars([{"role": "user", "content": [{"type": "text", "text": "hello"}]}]) == len("user") + len("text") + 5
