"""A Qwen3-MoE checkpoint served end to end: a real `locus serve` process answers the official openai
client, records a trace whose experts are the router's top-k (on the MoE layers mlp_only_layers leaves),
and `locus plan` + `locus replay` run on that trace."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import httpx
import numpy as np
import openai
import pytest
import torch

from locus.cli import main
from locus.engine.checkpoint.weights import load_model
from locus.engine.frontend.llm import LLM
from locus.engine.model.forward_batch import ForwardBatch
from locus.engine.sampling.sampler import SamplingParams
from locus.traces.reader import TraceReader
from tests.server.server_process import running_server

pytestmark = pytest.mark.slow  # starts a real `locus serve` process

PROMPTS = ["def fibonacci(n):", "Der Sinn des Lebens ist", "2 + 2 =", "#include <stdio.h>"]


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "locus.cli", *args], capture_output=True, text=True, timeout=300)


def test_a_served_qwen3_checkpoint_answers_records_the_routers_top_k_and_plans(tmp_path):
    ck, trace = tmp_path / "qwen3-ck", tmp_path / "trace"
    assert main(["init-model", "--preset", "tiny-qwen3-moe", "--out", str(ck)]) == 0
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    want = [out.outputs[0].text for out in LLM(str(ck)).generate(PROMPTS, greedy)]

    with running_server("--model", str(ck), "--record-trace", str(trace)) as proc:
        client = openai.OpenAI(base_url=f"{proc.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["qwen3-ck"]
        got = [client.completions.create(model="qwen3-ck", prompt=p, max_tokens=8, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text for p in PROMPTS]
        stream = client.completions.create(model="qwen3-ck", prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        streamed = "".join(chunk.choices[0].text for chunk in stream)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    assert got == want and streamed == want[0]

    reader = TraceReader(trace)
    assert reader.meta.moe_layers == (0, 1, 3)  # layer 2 is dense (mlp_only_layers)
    assert (reader.meta.num_experts, reader.meta.top_k) == (16, 4) and reader.num_requests == len(PROMPTS) + 1
    model = load_model(ck)
    for r in range(reader.num_requests):
        rows = slice(int(reader.offsets[r]), int(reader.offsets[r + 1]))
        with torch.no_grad():
            routing = model(ForwardBatch.single(reader.token_ids[rows].tolist()), record_routing=True).routing
        assert sorted(routing) == [0, 1, 3]
        recorded = np.asarray(reader.expert_ids[rows])  # [n, L, K]
        for j, layer in enumerate((0, 1, 3)):
            assert np.array_equal(np.sort(recorded[:, j], axis=-1), np.sort(routing[layer].ids.numpy(), axis=-1))
        weights = np.asarray(reader.expert_weights[rows], dtype=np.float32)
        assert np.allclose(weights.sum(-1), 1.0, atol=2e-3)  # norm_topk_prob: the four weights sum to 1

    plan, out = tmp_path / "plan.json", tmp_path / "replay.json"
    done = cli("plan", str(trace), "--topology", "1x2", "--slots", "10", "--planner", "locality", "-o", str(plan))
    assert done.returncode == 0, done.stderr
    done = cli("replay", str(trace), "--plan", str(plan), "--json", str(out))
    assert done.returncode == 0, done.stderr
    replayed = json.loads(out.read_text())
    assert replayed["tokens"] == reader.num_tokens and replayed["intra_node_bytes"] > 0


def test_an_expert_parallel_qwen3_server_counts_the_bytes_replay_computes(tmp_path):
    """`locus serve --ep-ranks 2` (1x2, each rank holding 8 of the 16 experts) answers as one process
    does, and its own byte counters equal `locus replay --plan embedded --assign recorded` of the trace it
    recorded (each request on the rank it ran on)."""
    ck, trace = tmp_path / "qwen3-ck", tmp_path / "trace"
    assert main(["init-model", "--preset", "tiny-qwen3-moe", "--out", str(ck)]) == 0
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    want = [out.outputs[0].text for out in LLM(str(ck)).generate(PROMPTS[:2], greedy)]
    with running_server("--model", str(ck), "--ep-ranks", "2", "--record-trace", str(trace), timeout=300) as proc:
        client = openai.OpenAI(base_url=f"{proc.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
        got = [client.completions.create(model="qwen3-ck", prompt=p, max_tokens=6, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text for p in PROMPTS[:2]]
        stats = httpx.get(f"{proc.base_url}/ep/stats", timeout=30).json()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    assert got == want
    out = tmp_path / "replay.json"
    done = cli("replay", str(trace), "--plan", "embedded", "--assign", "recorded", "--json", str(out))
    assert done.returncode == 0, done.stderr
    replayed = json.loads(out.read_text())
    assert stats["intra_node_bytes"] > 0
    assert (replayed["inter_node_bytes"], replayed["intra_node_bytes"], replayed["tokens"]) == (
        stats["inter_node_bytes"], stats["intra_node_bytes"], stats["tokens"])
