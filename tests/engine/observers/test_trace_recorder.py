"""Traces recorded from the engine match the router's top-k recomputed in separate forward passes."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from locus.engine.core.engine_core import EngineConfig, EngineCore
from locus.engine.model.forward_batch import ForwardBatch
from locus.engine.sampling.sampler import SamplingParams
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


@pytest.mark.slow  # recomputes every request's routing with full forwards
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


@pytest.mark.parametrize("overlap", [False, True])
def test_aborted_requests_stay_in_the_trace_with_the_rows_that_ran(tiny, tok, tmp_path, overlap):
    """Issue 55, item 3: an aborted request (its client went away) was left out of the trace, though the
    engine had routed its rows (and an expert-parallel server had counted their bytes). Now it is kept,
    marked aborted, with the rows whose routing was seen before the abort: a prefill cut after two
    16-token chunks (fewer rows than its prompt; overlapped, the chunk in flight at the abort is not
    seen), a stream cut after 4 tokens. Every row the engine published is in the trace: the trace's
    expert counts equal the engine's expert-load counters (what /metrics shows)."""
    core = EngineCore(tiny, tok, EngineConfig(block_size=8, num_kv_blocks=64, max_num_batched_tokens=16,
                                              async_scheduling=overlap))
    core.start_recording(tmp_path / "trace", model_name="tiny")
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = {"long": [1 + i % 250 for i in range(100)], "cut": list(range(40, 50)), "done": list(range(60, 66))}
    core.add_request("long", prompts["long"], params)
    core.step()
    core.step()
    assert core.abort("long").outputs[0].finish_reason == "abort"  # two chunks launched, 84 prompt tokens to go
    core.add_request("cut", prompts["cut"], params)
    core.add_request("done", prompts["done"], params)
    outs = {}
    while core.has_unfinished():
        for out in core.step():
            outs[out.request_id] = out
        if "cut" in core.requests and len(core.requests["cut"].seqs[0].output_ids) >= 4:
            core.abort("cut")
    core.dump_recording()

    reader = TraceReader(tmp_path / "trace")
    records = {r.id: (i, r) for i, r in enumerate(reader.requests)}
    assert sorted(records) == ["cut", "done", "long"]
    long, cut, done = (records[k][1] for k in ("long", "cut", "done"))
    assert long.aborted and long.prompt_tokens == long.tokens == (16 if overlap else 32)
    assert cut.aborted and cut.prompt_tokens == 10 and 10 + 3 <= cut.tokens < 10 + 19
    assert not done.aborted and done.tokens == 6 + 19
    lines = [json.loads(line) for line in (tmp_path / "trace" / "requests.jsonl").read_text().splitlines()]
    assert [line.get("aborted") for line in lines] == [True, True, None]  # (written only when true)
    for rid, (r, record) in records.items():
        tokens = reader.token_ids[reader.offsets[r]:reader.offsets[r + 1]].tolist()
        assert tokens[:min(len(prompts[rid]), record.tokens)] == prompts[rid][:record.tokens]
        assert np.array_equal(reader.request_rows(r), recompute(tiny, tokens)[0].astype(np.int16)), rid
    counts = np.zeros_like(core.expert_load.totals())
    ids = np.asarray(reader.expert_ids)
    for layer in range(ids.shape[1]):
        counts[layer] = np.bincount(ids[:, layer].ravel(), minlength=counts.shape[1])
    assert np.array_equal(counts, core.expert_load.totals())


# ---------------------------------------------------------------- recording failures never fail serving (issue 41)


def fill_disk_at(monkeypatch, write: int):
    """Make the `write`-th append to expert_weights.npy land half its bytes, then fail as a full disk does."""
    import errno

    from locus.traces import npyfile

    real, seen = npyfile.NpyStream.append, {"n": 0}

    def append(self, rows):
        if self.path.name == "expert_weights.npy":
            seen["n"] += 1
            if seen["n"] >= write:
                data = np.ascontiguousarray(rows, dtype=self.dtype).tobytes()
                if seen["n"] == write:
                    self._file.write(data[: len(data) // 2])
                    self._file.flush()
                raise OSError(errno.ENOSPC, "No space left on device")
        real(self, rows)

    monkeypatch.setattr(npyfile.NpyStream, "append", append)


def add_staggered(core: EngineCore, n: int, prefix: str = "r") -> None:
    for i in range(n):  # each finishes one step after the one before: they are written in order
        core.add_request(f"{prefix}{i}", [1 + i, 2, 3, 4], SamplingParams(temperature=0, max_tokens=2 + i, ignore_eos=True))


def test_a_write_the_disk_refuses_stops_the_recording_not_the_requests(tiny, tmp_path, monkeypatch):
    """Issue 41, finding 5: with the trace's disk full, every request finishing while recording failed
    after its whole generation (OSError: [Errno 28], as a 400), the dump failed and nothing was left."""
    tok = ByteTokenizer(ByteTokenizer.MIN_VOCAB)
    clean = EngineCore(tiny, tok)
    clean.start_recording(tmp_path / "clean")
    add_staggered(clean, 6)
    run_all(clean)
    clean.dump_recording()

    fill_disk_at(monkeypatch, write=4)
    core = EngineCore(tiny, tok)
    core.start_recording(tmp_path / "t")
    add_staggered(core, 6)
    outs = run_all(core)
    assert sorted(outs) == [f"r{i}" for i in range(6)]
    for i in range(6):
        assert outs[f"r{i}"].error is None and outs[f"r{i}"].outputs[0].finish_reason == "length"
        assert len(outs[f"r{i}"].outputs[0].token_ids) == 2 + i
    recorder = core.recorder
    assert recorder.state == "failed" and recorder.stop_reason == "ENOSPC" and core.recording_failures == 1
    add_staggered(core, 2, prefix="after")  # served, not recorded
    assert all(o.error is None for o in run_all(core).values())
    summary = core.dump_recording()
    assert (summary.status, summary.reason, summary.kept, summary.requests) == (
        "failed", "No space left on device (ENOSPC)", True, 3)
    kept, whole = TraceReader(tmp_path / "t"), TraceReader(tmp_path / "clean")
    assert [r.id for r in kept.requests] == ["r0", "r1", "r2"]
    rows = kept.num_tokens
    np.testing.assert_array_equal(np.asarray(kept.expert_ids), np.asarray(whole.expert_ids)[:rows])
    np.testing.assert_array_equal(np.asarray(kept.expert_weights), np.asarray(whole.expert_weights)[:rows])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clean", "t"]  # no staging directory left
    core.start_recording(tmp_path / "u")  # a failed recording, once dumped, makes room for the next
    assert core.recorder.state == "recording"


def test_a_failure_before_any_request_was_written_leaves_nothing(tiny, tmp_path, monkeypatch):
    fill_disk_at(monkeypatch, write=1)
    core = EngineCore(tiny, ByteTokenizer(ByteTokenizer.MIN_VOCAB))
    core.start_recording(tmp_path / "t")
    add_staggered(core, 3)
    assert all(o.error is None for o in run_all(core).values())
    summary = core.dump_recording()
    assert (summary.status, summary.kept, summary.requests) == ("failed", False, 0)
    assert list(tmp_path.iterdir()) == []


def test_the_byte_budget_is_exact(tiny, tmp_path):
    """--trace-max-bytes counts every byte of the trace directory (meta.json and headers too)."""
    core = EngineCore(tiny, ByteTokenizer(ByteTokenizer.MIN_VOCAB))
    core.start_recording(tmp_path / "t", max_bytes=4000)
    add_staggered(core, 12)
    run_all(core)
    assert core.recorder.state == "stopped" and core.recorder.stop_reason == "budget"
    summary = core.dump_recording()
    size = sum(p.stat().st_size for p in (tmp_path / "t").iterdir())
    assert 0 < summary.requests < 12 and len(TraceReader(tmp_path / "t").requests) == summary.requests
    assert size <= 4000


def test_a_recording_the_disk_cannot_start_is_refused_and_leaves_nothing(tiny, tmp_path, monkeypatch):
    import errno
    from pathlib import Path

    from locus.engine.observers.trace_recorder import RecordingStorageError

    def full(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_bytes", full)  # meta.json, the last file a trace starts with
    core = EngineCore(tiny, ByteTokenizer(ByteTokenizer.MIN_VOCAB))
    with pytest.raises(RecordingStorageError, match=r"the trace 't' cannot be started: No space left on device \(ENOSPC\)"):
        core.start_recording(tmp_path / "t")
    assert core.recorder is None and list(tmp_path.iterdir()) == []
