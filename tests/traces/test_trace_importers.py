"""Importers on small fixture files built here: vLLM responses and Megatron records (SGLang: its own file)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from locus.traces.format import TraceFormatError
from locus.traces.importers import ImportOptions, import_trace, parse_layers
from locus.traces.reader import TraceReader

# ---------------------------------------------------------------- vLLM

P1 = [[[0, 1], [2, 3]], [[1, 2], [3, 0]]]  # 2 prompt tokens, 2 layers, k=2
G1 = [[[4, 5], [6, 7]]]  # 1 generated token
COMBINED = [[[0, 2], [1, 3]], [[2, 0], [3, 1]], [[5, 4], [7, 6]]]  # prompt (2) + generated (1)
RESPONSES = [
    {"id": "cmpl-1", "domain": "code", "prompt_routed_experts": P1, "choices": [{"index": 0, "routed_experts": G1}]},
    {"id": "cmpl-2", "metadata": {"domain": "math"}, "prompt_routed_experts": P1,
     "choices": [{"index": 0, "routed_experts": G1}, {"index": 1, "routed_experts": G1 + G1}]},
    {"id": "cmpl-3", "usage": {"prompt_tokens": 2, "completion_tokens": 1},
     "choices": [{"index": 0, "routed_experts": COMBINED}]},
]


def write_jsonl(path, items):
    path.write_text("".join(json.dumps(x) + "\n" for x in items))
    return path


def test_vllm_jsonl(tmp_path):
    src = write_jsonl(tmp_path / "out.jsonl", RESPONSES)
    result = import_trace("vllm", src, tmp_path / "t", ImportOptions(model="m", hidden_size=16, num_experts=8))
    r = TraceReader(tmp_path / "t")
    assert result.num_requests == 4
    assert len(result.notes) == 1 and "layer indices unknown" in result.notes[0]
    assert [(q.id, q.domain, q.prompt_tokens, q.tokens) for q in r.requests] == [
        ("cmpl-1", "code", 2, 3), ("cmpl-2-0", "math", 2, 3), ("cmpl-2-1", "math", 2, 4), ("cmpl-3", "unknown", 2, 3)]
    np.testing.assert_array_equal(r.request_rows(0), np.array(P1 + G1))
    np.testing.assert_array_equal(r.request_rows(2), np.array(P1 + G1 + G1))
    np.testing.assert_array_equal(r.request_rows(3), np.array(COMBINED))
    assert r.meta.moe_layers == (0, 1) and r.meta.num_experts == 8 and r.meta.source.startswith("vllm:")


def test_vllm_json_list_equals_jsonl_and_infers_what_it_can(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", RESPONSES)
    (tmp_path / "b.json").write_text(json.dumps(RESPONSES, indent=2))
    opts = ImportOptions(model="llama4-maverick", moe_layers=(1, 3))  # preset gives hidden size
    import_trace("vllm", tmp_path / "a.jsonl", tmp_path / "ta", opts)
    result = import_trace("vllm", tmp_path / "b.json", tmp_path / "tb", opts)
    assert (tmp_path / "ta" / "expert_ids.npy").read_bytes() == (tmp_path / "tb" / "expert_ids.npy").read_bytes()
    meta = TraceReader(tmp_path / "tb").meta
    assert meta.hidden_size == 5120 and meta.moe_layers == (1, 3) and meta.num_experts == 128
    assert result.notes == []
    bare = import_trace("vllm", tmp_path / "a.jsonl", tmp_path / "tc", ImportOptions(hidden_size=16))
    assert bare.meta.num_experts == 8 and any("num_experts inferred" in n for n in bare.notes)
    assert any("layer indices unknown" in n for n in bare.notes)


@pytest.mark.parametrize(
    "lines, fragment",
    [
        ([json.dumps({"id": "x", "prompt_routed_experts": P1}), "{broken"], "line 2: not valid JSON"),
        ([json.dumps({"id": "x", "choices": [{"text": "hi"}]})], "--enable-return-routed-experts"),
        ([json.dumps(RESPONSES[0]), json.dumps({"id": "y", "prompt_routed_experts": [[[1, 2, 3]]]})],
         "line 2: routed experts are [*, 1, 3]"),
        ([json.dumps({"id": "x", "prompt_routed_experts": [[1, 2], [3]]})], "ragged"),
        ([json.dumps({"id": "x", "prompt_routed_experts": [[1, 2]]})], "expected [tokens, layers, k]"),
        ([json.dumps(RESPONSES[0]), json.dumps(RESPONSES[0])], "line 2: duplicate request id 'cmpl-1'"),
    ],
)
def test_vllm_errors(tmp_path, lines, fragment):
    src = tmp_path / "bad.jsonl"
    src.write_text("\n".join(lines) + "\n")
    with pytest.raises(TraceFormatError) as info:
        import_trace("vllm", src, tmp_path / "t", ImportOptions(hidden_size=16))
    assert fragment in str(info.value) and "bad.jsonl" in str(info.value)
    assert not (tmp_path / "t").exists()


def test_missing_hidden_size_is_explained(tmp_path):
    src = write_jsonl(tmp_path / "out.jsonl", RESPONSES[:1])
    with pytest.raises(TraceFormatError, match="--hidden-size"):
        import_trace("vllm", src, tmp_path / "t", ImportOptions())


# ---------------------------------------------------------------- Megatron

def megatron_lines(steps=(0, 1), layers=(1, 3)):
    out = []
    for step in steps:
        for layer in layers:
            out.append({"step": step, "layer": layer, "top_indices": [[step, layer], [2, 0], [layer, 2]]})
    return out


def test_megatron(tmp_path):
    src = write_jsonl(tmp_path / "routing.jsonl", megatron_lines())
    result = import_trace("megatron", src, tmp_path / "t", ImportOptions(hidden_size=16, num_experts=4))
    r = TraceReader(tmp_path / "t")
    assert result.num_tokens == 6 and r.meta.moe_layers == (1, 3) and r.meta.top_k == 2
    assert [(q.id, q.prompt_tokens, q.tokens) for q in r.requests] == [("step0", 3, 3), ("step1", 3, 3)]
    np.testing.assert_array_equal(r.request_rows(1)[:, 1], [[1, 3], [2, 0], [3, 2]])  # step 1, layer 3


def test_megatron_ranks_and_micro_batches_split_steps(tmp_path):
    lines = [dict(x, rank=r, micro_batch=0) for r in (0, 1) for x in megatron_lines(steps=(5,))]
    src = write_jsonl(tmp_path / "routing.jsonl", lines)
    import_trace("megatron", src, tmp_path / "t", ImportOptions(hidden_size=16))
    assert [q.id for q in TraceReader(tmp_path / "t").requests] == ["step5-rank0-mb0", "step5-rank1-mb0"]


@pytest.mark.parametrize(
    "lines, fragment",
    [
        (megatron_lines()[:3] + megatron_lines()[:1], "not consecutive"),
        (megatron_lines()[:3], "covers layers [1]"),
        ([{"step": 0, "layer": 1}], "missing field 'top_indices'"),
        ([{"step": 0, "layer": 1, "top_indices": [1, 2]}], "expected [tokens, k]"),
        ([{"step": 0, "layer": 1, "top_indices": [[1, 2]]}, {"step": 0, "layer": 3, "top_indices": [[1, 2], [0, 1]]}],
         "disagree on [tokens, k]"),
    ],
)
def test_megatron_errors(tmp_path, lines, fragment):
    src = write_jsonl(tmp_path / "routing.jsonl", lines)
    with pytest.raises(TraceFormatError) as info:
        import_trace("megatron", src, tmp_path / "t", ImportOptions(hidden_size=16))
    assert fragment in str(info.value) and "routing.jsonl" in str(info.value)


def test_parse_layers():
    assert parse_layers("1,3,5") == (1, 3, 5)
    assert parse_layers("1:48:2")[:3] == (1, 3, 5) and len(parse_layers("1:48:2")) == 24
    with pytest.raises(TraceFormatError, match="--moe-layers"):
        parse_layers("one")
