"""Traces recorded from the engine match the router's top-k recomputed in separate forward passes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from locus.engine.engine_core import EngineConfig, EngineCore
from locus.engine.model.forward_batch import ForwardBatch
from locus.engine.sampling import SamplingParams
from locus.engine.checkpoint.tokenizer import ByteTokenizer
from locus.errors import LocusError
from locus.traces.reader import TraceReader


def run_all(core: EngineCore) -> dict:
    outs = {}
    while core.has_unfinished():
        for out in core.step():
            if out.finished:
                outs[out.request_id] = out
    return outs


def recompute(model, tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
    with torch.no_grad():
        routing = model(ForwardBatch.single(tokens), record_routing=True).routing
    layers = model.config.moe_layers
    ids = torch.stack([routing[l].ids for l in layers], dim=1).numpy()
    weights = torch.stack([routing[l].weights for l in layers], dim=1).numpy()
    return ids, weights


def test_recorded_trace_equals_recomputed_routing(tiny, tmp_path):
    tok = ByteTokenizer(ByteTokenizer.MIN_VOCAB)
    # small pool and step budget: chunked prefill and preemption happen while recording
    core = EngineCore(tiny, tok, EngineConfig(block_size=8, num_kv_blocks=40, max_num_batched_tokens=64))
    core.start_recording(tmp_path / "trace", model_name="tiny")
    g = torch.Generator().manual_seed(3)
    prompts = {f"r{i}": torch.randint(0, 256, (int(n),), generator=g).tolist()
               for i, n in enumerate(torch.randint(1, 120, (10,), generator=g))}
    for rid, prompt in prompts.items():
        core.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                         domain="code" if rid < "r5" else "chat")
    core.add_request("n2", prompts["r1"], SamplingParams(n=2, temperature=1.0, seed=1, max_tokens=6, ignore_eos=True))
    outs = run_all(core)
    summary = core.dump_recording()
    assert core.stats().num_preemptions + core.stats().num_chunked_prefills > 0

    reader = TraceReader(tmp_path / "trace")
    assert reader.meta.num_experts == 8 and reader.meta.top_k == 2 and reader.meta.moe_layers == (0, 1, 3)
    assert summary.requests == len(reader.requests) == 12
    assert reader.expert_weights is not None
    for r, record in enumerate(reader.requests):
        rid, _, index = record.id.partition("#")
        out = outs[rid].outputs[int(index or 0)]
        tokens = prompts["r1" if rid == "n2" else rid] + out.token_ids[:-1]
        assert record.prompt_tokens == len(tokens) - len(out.token_ids) + 1
        assert record.tokens == len(tokens)
        assert record.domain == ("" if rid == "n2" else "code" if rid < "r5" else "chat")
        ids, weights = recompute(tiny, tokens)
        rows = reader.request_rows(r)
        assert np.array_equal(rows, ids.astype(np.int16)), f"request {record.id}"
        recorded_w = np.asarray(reader.expert_weights[reader.offsets[r]:reader.offsets[r + 1]], dtype=np.float32)
        assert np.allclose(recorded_w, weights, atol=2e-3)


def test_recording_controls(tiny, tmp_path):
    core = EngineCore(tiny, ByteTokenizer(ByteTokenizer.MIN_VOCAB))
    with pytest.raises(LocusError, match="not recording"):
        core.dump_recording()
    core.start_recording(tmp_path / "t")
    with pytest.raises(LocusError, match="already recording"):
        core.start_recording(tmp_path / "u")
    core.add_request("a", [1, 2, 3], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    core.step()
    core.stop_recording()
    core.add_request("b", [4, 5, 6], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))  # after stop
    run_all(core)
    summary = core.dump_recording()
    assert summary.requests == 1 and summary.tokens == 3 + 2
    assert [r.id for r in TraceReader(tmp_path / "t").requests] == ["a"]
    assert core.blocks.enable_prefix_caching  # restored
