"""Narrow experts under expert parallelism, over real HTTP against real server processes:
`--quantize-experts` with `--ep-ranks` (each rank quantizing its own slots), an FP8 checkpoint in
Meta's FBGEMM layout with `--ep-ranks`, and `--ep-elastic` surviving a SIGKILLed rank while every
rank holds fp8 experts (the survivors read the lost rank's experts narrow, as loaded)."""

from __future__ import annotations

import signal

import httpx
import pytest

from locus.engine.checkpoint.presets import PRESETS
from locus.engine.frontend.llm import LLM
from locus.engine.sampling.sampler import SamplingParams
from tests.server.server_process import running_server
from tests.server.test_elastic_serving import PROMPTS, TOKENS, rank_of, streams_through_a_kill
from tests.server.test_expert_parallel_serving import children_of

pytestmark = pytest.mark.slow  # servers of 2-4 rank processes

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def complete(base: str, prompt: str, tokens: int = 16) -> str:
    r = httpx.post(f"{base}/v1/completions", json={"prompt": prompt, "max_tokens": tokens, "temperature": 0,
                                                   "ignore_eos": True}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_quantize_experts_serves_under_expert_parallelism_as_one_process_does():
    """The flag used to be refused with --ep-ranks; the ranks now hold their slots narrow."""
    fmt = "mxfp8"
    prompts = PROMPTS[:4]
    want = [o.outputs[0].text for o in LLM("tiny", quantize_experts=fmt).generate(prompts, GREEDY)]
    with running_server("--model", "tiny", "--ep-ranks", "2", "--quantize-experts", fmt) as proc:
        got = [complete(proc.base_url, p) for p in prompts]
        stats = httpx.get(f"{proc.base_url}/ep/stats").json()
    assert got == want
    # each rank holds 4 of tiny's 8 experts in 3 MoE layers, in MXFP8: 1 byte a value + an E8M0 scale per 32
    E, H, I = 4, 64, 64
    narrow = 3 * E * (H * 2 * I + H // 32 * 2 * I + I * H + I // 32 * H)
    assert [r["expert_bytes"] for r in stats["per_rank"]] == [narrow, narrow]


def test_an_fp8_checkpoint_serves_under_expert_parallelism_as_one_process_does(tmp_path):
    """Before: every rank read its slice narrow, then start-up failed on the fingerprints of the narrow
    experts (AttributeError: 'QuantizedTensor' object has no attribute 'reshape')."""
    from tests.engine.ep.test_quantized_experts_ep import write_checkpoints

    path = write_checkpoints(tmp_path)["fbgemm_fp8"]
    prompts = PROMPTS[:4]
    want = [o.outputs[0].text for o in LLM(path).generate(prompts, GREEDY)]
    with running_server("--model", path, "--ep-ranks", "2") as proc:
        got = [complete(proc.base_url, p) for p in prompts]
    assert got == want


def test_a_lost_rank_holding_narrow_experts_loses_no_stream_and_no_token():
    want = [o.outputs[0].text for o in LLM("tiny", quantize_experts="fp8").generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True))]
    with running_server("--model", "tiny", "--ep-ranks", "4", "--gpus-per-node", "2", "--ep-elastic",
                        "--ep-timeout", "20", "--quantize-experts", "fp8") as proc:
        ranks = {rank_of(pid): pid for pid in children_of(proc.pid)}
        streams, stats, _ = streams_through_a_kill(proc.base_url, ranks[2])
        assert [s["end"] for s in streams] == ["done"] * len(PROMPTS)
        assert [s["text"] for s in streams] == want
        recovery = stats["recoveries"][0]
        assert recovery["lost_ranks"] == [2] and stats["ranks"] == 3
        # the survivors' experts stay narrow: fp8 bytes, not float32's, for every slot they hold now (each
        # rank's figure as its last report says, after the streams: the survivors have reported since)
        stats = httpx.get(f"{proc.base_url}/ep/stats").json()
        fp8_expert = 64 * 128 + 128 * 4 + 64 * 64 + 64 * 4
        slots = stats["topology"]["slots_per_gpu"] * len(PRESETS["tiny"].moe_layers)
        assert [r["expert_bytes"] for r in stats["per_rank"]] == [slots * fp8_expert] * 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
