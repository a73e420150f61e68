"""logit_bias and the scoring API (echo, max_tokens 0) under expert parallelism: two rank processes
answer what one process answers."""

from __future__ import annotations

import json

import httpx
import pytest

from locus.engine.frontend.llm import LLM
from locus.engine.sampling.sampler import SamplingParams
from tests.server.server_process import running_server

pytestmark = pytest.mark.slow

PROMPT = "expert parallel"


def test_logit_bias_and_echo_over_two_ranks_equal_one_process():
    llm = LLM("tiny")
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    plain = llm.generate([PROMPT], greedy)[0].outputs[0]
    bias = {t: -100.0 for t in plain.token_ids}
    banned = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logit_bias=bias))[0]
    assert not set(banned.outputs[0].token_ids) & set(plain.token_ids)
    scored = llm.generate([PROMPT], SamplingParams(max_tokens=0, prompt_logprobs=1))[0].prompt_logprobs
    with running_server("--model", "tiny", "--ep-ranks", "2") as proc:
        http = httpx.Client(base_url=proc.base_url, timeout=60)
        body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        assert http.post("/v1/completions", json=body).json()["choices"][0]["text"] == plain.text
        biased = http.post("/v1/completions", json={**body, "logit_bias": {str(t): b for t, b in bias.items()}})
        assert biased.json()["choices"][0]["text"] == banned.outputs[0].text != plain.text
        forced = http.post("/v1/completions", json={**body, "max_tokens": 4, "logit_bias": {"65": 100}, "stream": True})
        chunks = [json.loads(line[6:]) for line in forced.text.split("\n") if line.startswith("data: {")]
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == "AAAA"
        echo = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 1}).json()
        choice = echo["choices"][0]
        assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
        assert choice["logprobs"]["token_logprobs"][0] is None
        assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx([e.logprob for e in scored[1:]], abs=1e-5)
        assert echo["usage"]["completion_tokens"] == 0
        streamed = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "echo": True, "logprobs": 0,
                                                      "temperature": 0, "stream": True})
        assert streamed.status_code == 200 and f'"text": "{PROMPT}' in streamed.text
