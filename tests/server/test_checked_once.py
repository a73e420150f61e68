"""Each input is checked once (issue 58, item 3): a served request's sampling ranges are checked where it
enters (the protocol layer), and the engine checks only the vocabulary bounds. An in-process app on the
tiny preset (no rank, no subprocess), with the range and vocabulary checks counted."""

from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient

from locus.engine.core.engine_core import EngineConfig
from locus.engine.sampling.params import SamplingParams
from locus.server.app import create_app
from locus.server.state import ServerConfig


@pytest.fixture(scope="module")
def client():
    app = create_app(ServerConfig(model="tiny", device="cpu", engine=EngineConfig(num_kv_blocks=64, block_size=16)))
    with TestClient(app) as c:
        deadline = time.monotonic() + 120
        while c.get("/health").status_code != 200:
            assert time.monotonic() < deadline, "the tiny engine did not load in 120 s"
            time.sleep(0.2)
        yield c


@pytest.fixture
def counted(monkeypatch):
    calls = {"check_ranges": 0, "check_vocab": 0}
    for name in calls:
        original = getattr(SamplingParams, name)

        def counting(self, *args, _name=name, _original=original):
            calls[_name] += 1
            return _original(self, *args)

        monkeypatch.setattr(SamplingParams, name, counting)
    return calls


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"model": "tiny", "prompt": "hello", "max_tokens": 2, "top_k": 5}),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
])
def test_a_served_request_has_its_ranges_checked_once(client, counted, path, body):
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    assert counted == {"check_ranges": 1, "check_vocab": 1}


def test_each_prompt_of_a_batch_is_checked_against_the_vocabulary_ranges_once(client, counted):
    response = client.post("/v1/completions", json={"model": "tiny", "prompt": ["a", "b", "c"], "max_tokens": 1})
    assert response.status_code == 200, response.text
    assert counted == {"check_ranges": 1, "check_vocab": 3}


def test_a_range_fault_is_refused_before_the_engine_sees_it(client, counted):
    response = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "top_p": 0, "top_k": 10 ** 9})
    assert response.status_code == 400 and response.json()["error"]["param"] == "top_p"
    assert counted == {"check_ranges": 1, "check_vocab": 0}


def test_a_vocabulary_fault_is_the_engines(client, counted):
    response = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "top_k": 10 ** 9})
    assert response.status_code == 400 and response.json()["error"]["param"] == "top_k"
    assert "(the vocabulary size)" in response.json()["error"]["message"]
    assert counted == {"check_ranges": 1, "check_vocab": 1}
