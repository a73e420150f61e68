"""A DeepSeek-V3 checkpoint served end to end: a real `locus serve` process answers the official openai
client, records a trace whose experts are the router's top-k after group limiting (on the layers after
first_k_dense_replace), and `locus plan` + `locus replay` run on that trace."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

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


def test_a_served_deepseek_v3_checkpoint_answers_records_the_routers_top_k_and_plans(tmp_path):
    ck, trace = tmp_path / "dsv3-ck", tmp_path / "trace"
    assert main(["init-model", "--preset", "tiny-deepseek-v3", "--out", str(ck)]) == 0
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    want = [out.outputs[0].text for out in LLM(str(ck)).generate(PROMPTS, greedy)]

    with running_server("--model", str(ck), "--record-trace", str(trace)) as proc:
        client = openai.OpenAI(base_url=f"{proc.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["dsv3-ck"]
        got = [client.completions.create(model="dsv3-ck", prompt=p, max_tokens=8, temperature=0,
                                         extra_body={"ignore_eos": True}).choices[0].text for p in PROMPTS]
        stream = client.completions.create(model="dsv3-ck", prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        streamed = "".join(chunk.choices[0].text for chunk in stream)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    assert got == want and streamed == want[0]

    reader = TraceReader(trace)
    assert reader.meta.moe_layers == (1, 2, 3)  # layer 0 is dense (first_k_dense_replace)
    assert (reader.meta.num_experts, reader.meta.top_k) == (16, 4) and reader.num_requests == len(PROMPTS) + 1
    model = load_model(ck)
    for r in range(reader.num_requests):
        rows = slice(int(reader.offsets[r]), int(reader.offsets[r + 1]))
        with torch.no_grad():
            routing = model(ForwardBatch.single(reader.token_ids[rows].tolist()), record_routing=True).routing
        assert sorted(routing) == [1, 2, 3]
        recorded = np.asarray(reader.expert_ids[rows])  # [n, L, K]
        for j, layer in enumerate((1, 2, 3)):
            ids = routing[layer].ids.numpy()
            assert np.array_equal(np.sort(recorded[:, j], axis=-1), np.sort(ids, axis=-1))
            # group-limited: each token's four experts lie in at most topk_group (2) of the 4 groups of 4
            assert max(len(set(row // 4)) for row in ids) <= 2
        weights = np.asarray(reader.expert_weights[rows], dtype=np.float32)
        assert np.allclose(weights.sum(-1), 2.5, atol=1e-2)  # renormalised, times routed_scaling_factor

    plan, out = tmp_path / "plan.json", tmp_path / "replay.json"
    done = cli("plan", str(trace), "--topology", "1x2", "--slots", "10", "--planner", "locality", "-o", str(plan))
    assert done.returncode == 0, done.stderr
    done = cli("replay", str(trace), "--plan", str(plan), "--json", str(out))
    assert done.returncode == 0, done.stderr
    replayed = json.loads(out.read_text())
    assert replayed["tokens"] == reader.num_tokens and replayed["intra_node_bytes"] > 0
