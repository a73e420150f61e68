"""`locus serve --model DIR` on Meta's FBGEMM FP8 layout (the trained `mini`, written as an FP8
checkpoint here) and with --quantize-experts: real HTTP against a real server process."""

from __future__ import annotations

import httpx
import pytest

from locus.engine.checkpoint.loader import shipped_model
from locus.engine.checkpoint.weights import load_model
from locus.engine.frontend.llm import LLM
from locus.engine.sampling.sampler import SamplingParams
from tests.engine.checkpoint.quantized_checkpoints import write_quantized
from tests.server.server_process import running_server

pytestmark = pytest.mark.slow
PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def fp8_mini(tmp_path_factory):
    mini = shipped_model("mini")
    if mini is None:
        pytest.skip("the shipped mini checkpoint is not installed")
    return write_quantized(load_model(mini), mini, tmp_path_factory.mktemp("fp8mini"), "fbgemm_fp8")


def complete(base: str, prompt: str) -> dict:
    r = httpx.post(f"{base}/v1/completions", json={"model": "x", "prompt": prompt, "max_tokens": 12,
                                                   "temperature": 0}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_serves_an_fp8_checkpoint_as_its_dequantized_twin_would(fp8_mini):
    q, twin = fp8_mini
    with running_server("--model", str(q), "--served-model-name", "x", "--moe-backend", "cpu") as server:
        served = complete(server.base_url, PROMPT)["choices"][0]["text"]
    expected = LLM(str(twin), moe_backend="cpu").generate([PROMPT], SamplingParams(max_tokens=12, temperature=0.0))
    assert served == expected[0].outputs[0].text


def test_serves_with_quantized_experts():
    if shipped_model("mini") is None:
        pytest.skip("the shipped mini checkpoint is not installed")
    with running_server("--model", "mini", "--served-model-name", "x", "--quantize-experts", "mxfp8") as server:
        body = complete(server.base_url, PROMPT)
    assert body["usage"]["completion_tokens"] == 12
