"""Every way a trace can be broken gets a TraceFormatError naming the file and the problem."""

from __future__ import annotations

import json

import numpy as np
import pytest
from trace_fixtures import write_tiny_trace

from locus.traces.counts import read_counts, write_counts
from locus.traces.format import TraceFormatError
from locus.traces.reader import TraceReader


@pytest.fixture
def trace(tmp_path):
    path = tmp_path / "t"
    write_tiny_trace(path, with_weights=True)
    return path


def rewrite_meta(path, **changes):
    d = json.loads((path / "meta.json").read_text())
    for key, value in changes.items():
        if value is None:
            d.pop(key)
        else:
            d[key] = value
    (path / "meta.json").write_text(json.dumps(d))


def rewrite_requests(path, edit):
    lines = (path / "requests.jsonl").read_text().splitlines()
    (path / "requests.jsonl").write_text("\n".join(edit(lines)) + "\n")


def expect(path, file, *fragments):
    with pytest.raises(TraceFormatError) as info:
        TraceReader(path)
    message = str(info.value)
    assert file in message, message
    for fragment in fragments:
        assert fragment in message, message
    return message


def test_truncated_npy(trace):
    data = (trace / "expert_ids.npy").read_bytes()
    (trace / "expert_ids.npy").write_bytes(data[:-10])
    expect(trace, "expert_ids.npy", "truncated")


def test_truncated_header(trace):
    (trace / "expert_ids.npy").write_bytes((trace / "expert_ids.npy").read_bytes()[:40])
    expect(trace, "expert_ids.npy", "not a valid .npy")


def test_trailing_bytes(trace):
    with open(trace / "expert_ids.npy", "ab") as f:
        f.write(b"\0\0")
    expect(trace, "expert_ids.npy", "unexpected bytes")


def test_wrong_dtype(trace):
    ids = np.load(trace / "expert_ids.npy")
    np.save(trace / "expert_ids.npy", ids.astype(np.int32))
    expect(trace, "expert_ids.npy", "dtype", "int16")


def test_wrong_weights_dtype(trace):
    np.save(trace / "expert_weights.npy", np.load(trace / "expert_weights.npy").astype(np.float32))
    expect(trace, "expert_weights.npy", "dtype", "float16")


def test_rows_do_not_match_requests(trace):
    rewrite_requests(trace, lambda lines: lines[:-1])  # drop a request: rows no longer add up
    expect(trace, "expert_ids.npy", "11 tokens", "has 18 rows")


def test_row_shape_does_not_match_meta(trace):
    rewrite_meta(trace, top_k=1)
    expect(trace, "expert_ids.npy", "top_k 1")


@pytest.mark.parametrize("field", ["model", "num_experts", "top_k", "moe_layers", "hidden_size"])
def test_missing_meta_field(trace, field):
    rewrite_meta(trace, **{field: None})
    expect(trace, "meta.json", f"missing field {field!r}")


@pytest.mark.parametrize(
    "changes, fragment",
    [
        ({"format": "other"}, "format"),
        ({"version": 2}, "unsupported version"),
        ({"num_experts": "8"}, "must be an integer"),
        ({"moe_layers": [5, 3, 1]}, "strictly increasing"),
        ({"hidden_size": 0}, "hidden_size"),
    ],
)
def test_bad_meta_values(trace, changes, fragment):
    rewrite_meta(trace, **changes)
    expect(trace, "meta.json", fragment)


def test_meta_not_json(trace):
    (trace / "meta.json").write_text("{not json")
    expect(trace, "meta.json", "not valid JSON")


def test_missing_files(trace, tmp_path):
    (trace / "requests.jsonl").unlink()
    expect(trace, "requests.jsonl", "missing")
    expect(tmp_path / "nowhere", "nowhere", "not a trace directory")


def test_expert_id_out_of_range(trace):
    ids = np.load(trace / "expert_ids.npy")
    ids[16, 2, 1] = 8  # num_experts is 8
    np.save(trace / "expert_ids.npy", ids)
    expect(trace, "expert_ids.npy", "row 16", "request 'req-3'", "MoE layer 5", "slot 1", "expert id 8", "num_experts 8")


def test_expert_id_below_minus_one(trace):
    ids = np.load(trace / "expert_ids.npy")
    ids[0, 0, 0] = -2
    np.save(trace / "expert_ids.npy", ids)
    expect(trace, "expert_ids.npy", "expert id -2")


def test_id_scan_streams_in_blocks(trace, monkeypatch):
    """The range check reads bounded blocks, never the whole array at once."""
    ids = np.load(trace / "expert_ids.npy")
    ids[17, 0, 0] = 99
    np.save(trace / "expert_ids.npy", ids)
    reader = TraceReader(trace, check_ids=False)
    blocks = []
    real_read = reader.read_rows

    def spy(start, stop, weights=False):
        out = real_read(start, stop, weights)
        blocks.append(out.shape[0])
        return out

    monkeypatch.setattr(reader, "read_rows", spy)
    with pytest.raises(TraceFormatError, match="row 17"):
        reader.check_expert_ids(scan_rows=4)
    assert blocks == [4, 4, 4, 4, 2]


def test_bad_json_line(trace):
    rewrite_requests(trace, lambda lines: lines[:2] + ['{"id": "x", "domain": '] + lines[3:])
    expect(trace, "requests.jsonl", "line 3", "not valid JSON")


@pytest.mark.parametrize(
    "line, fragment",
    [
        ('{"id": "req-2", "domain": "code", "prompt_tokens": 5, "tokens": 4}', "prompt_tokens 5 > tokens 4"),
        ('{"id": "req-2", "domain": "code", "tokens": 4}', "missing field 'prompt_tokens'"),
        ('{"id": 7, "domain": "code", "prompt_tokens": 0, "tokens": 4}', "field 'id' must be a string"),
        ('{"id": "req-2", "domain": "code", "prompt_tokens": -1, "tokens": 4}', "negative"),
        ('[1, 2]', "expected a JSON object"),
        ('{"id": "req-2", "domain": "code", "prompt_tokens": 0, "tokens": 4, "aborted": 1}',
         "field 'aborted' must be true or false"),
    ],
)
def test_bad_request_line(trace, line, fragment):
    rewrite_requests(trace, lambda lines: lines[:2] + [line] + lines[3:])
    expect(trace, "requests.jsonl", "line 3", fragment)


def test_duplicate_request_ids(trace):
    rewrite_requests(trace, lambda lines: lines[:3] + [lines[3].replace("req-3", "req-1")])
    expect(trace, "requests.jsonl", "line 4", "duplicate request id 'req-1'", "first on line 2")


def test_weights_shape_mismatch(trace):
    w = np.load(trace / "expert_weights.npy")
    np.save(trace / "expert_weights.npy", w[:, :, :1].copy())
    expect(trace, "expert_weights.npy", "does not match")


def test_count_trace_is_not_a_token_trace(trace, tmp_path):
    from trace_fixtures import tiny_meta

    write_counts(tmp_path / "c", tiny_meta(), np.ones((3, 8), dtype=np.int64), num_tokens=12)
    expect(tmp_path / "c", "meta.json", "count trace", "read_counts")
    c = read_counts(tmp_path / "c")
    assert c.counts.shape == (3, 8) and c.num_tokens == 12


def test_count_trace_corruption(tmp_path):
    from trace_fixtures import tiny_meta

    write_counts(tmp_path / "c", tiny_meta(), np.ones((3, 8), dtype=np.int64))
    np.save(tmp_path / "c" / "counts.npy", np.ones((3, 7), dtype=np.int64))
    with pytest.raises(TraceFormatError, match=r"counts.npy: shape \(3, 7\)"):
        read_counts(tmp_path / "c")
    np.save(tmp_path / "c" / "counts.npy", np.ones((3, 8), dtype=np.float32))
    with pytest.raises(TraceFormatError, match="counts.npy: dtype"):
        read_counts(tmp_path / "c")


@pytest.mark.parametrize("field,value,needle", [("hidden_size", 10**18, "hidden_size"), ("dtype_bytes", 3, "dtype_bytes")])
def test_absurd_sizes_in_meta_are_refused(tmp_path, field, value, needle):
    """Issue 30, finding 8: hidden_size 1e18 was accepted and replay printed 10^30 GiB."""
    import json

    from locus.traces.reader import TraceReader

    write_tiny_trace(tmp_path / "t")
    meta = json.loads((tmp_path / "t" / "meta.json").read_text())
    meta[field] = value
    (tmp_path / "t" / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(TraceFormatError, match=needle):
        TraceReader(tmp_path / "t")
