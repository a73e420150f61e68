"""`locus trace export --to sglang-counts`: SGLang stat-dump layout, read back by our own SGLang importer."""

from __future__ import annotations

import json

import numpy as np
import pytest

from locus.cli import main
from locus.traces.counts import read_counts, write_counts
from locus.traces.export import export_trace, sglang_logical_count
from locus.traces.format import TraceFormatError
from locus.traces.importers import ImportOptions, import_trace

from trace_fixtures import tiny_meta, write_tiny_trace

torch = pytest.importorskip("torch")

LAYERS = (1, 3, 5)  # tiny_meta: 8 experts, top-2, MoE layers 1, 3, 5 of a 6-layer model


@pytest.fixture
def token_trace(tmp_path):
    path = tmp_path / "trace"
    write_tiny_trace(path)
    return path


@pytest.fixture
def count_trace(tmp_path):
    path = tmp_path / "counts"
    counts = np.arange(1, 25, dtype=np.int64).reshape(3, 8)  # no zero row: the importer drops zero rows
    write_counts(path, tiny_meta(), counts, num_tokens=None)
    return path


def import_back(src, dst):
    """Our SGLang importer on the exported file, as a user would run it on a real stat dump."""
    return import_trace("sglang", src, dst, ImportOptions(model="tiny", hidden_size=64, top_k=2))


def test_export_then_import_gives_the_same_counts(token_trace, tmp_path):
    out = tmp_path / "counts.pt"
    result = export_trace(token_trace, "sglang-counts", out)
    original = read_counts(token_trace)
    assert result.num_hidden_layers == 6 and result.num_experts == 8 and result.pairs == int(original.counts.sum())
    back = import_back(out, tmp_path / "back")
    got = read_counts(back.path)
    assert np.array_equal(got.counts, original.counts)
    assert got.meta.moe_layers == LAYERS  # dense rows are zero, so the importer drops them
    assert got.num_tokens == original.num_tokens  # every layer sums to tokens * top_k


def test_pt_layout_is_the_stat_recorder_dump(token_trace, tmp_path):
    out = tmp_path / "counts.pt"
    export_trace(token_trace, "sglang-counts", out, num_hidden_layers=8)
    data = torch.load(out, weights_only=True)
    assert set(data) == {"rank", "logical_count", "average_utilization_rate_over_window"}
    logical = data["logical_count"]
    assert logical.dtype == torch.int64 and tuple(logical.shape) == (1, 8, 8)  # [steps, num_hidden_layers, E]
    original = read_counts(token_trace).counts
    assert np.array_equal(logical[0, list(LAYERS)].numpy(), original)
    dense = [i for i in range(8) if i not in LAYERS]
    assert int(logical[0, dense].sum()) == 0


def test_count_trace_exports_too_and_json_holds_the_same(count_trace, tmp_path):
    out = tmp_path / "counts.json"
    export_trace(count_trace, "sglang-counts", out)
    doc = json.loads(out.read_text())
    logical = np.array(doc["logical_count"])
    assert logical.shape == (1, 6, 8) and doc["rank"] == 0
    assert np.array_equal(logical[0, list(LAYERS)], read_counts(count_trace).counts)
    # the .pt of the same trace imports back to the same counts
    pt = tmp_path / "counts.pt"
    export_trace(count_trace, "sglang-counts", pt)
    assert np.array_equal(read_counts(import_back(pt, tmp_path / "back").path).counts, read_counts(count_trace).counts)


def test_sglang_logical_count_places_rows_by_model_layer(count_trace):
    c = read_counts(count_trace)
    logical = sglang_logical_count(c, 7)
    assert logical.shape == (1, 7, 8)
    assert np.array_equal(logical[0, 3], c.counts[1])
    with pytest.raises(TraceFormatError, match="--num-hidden-layers 5 is too small: the trace has MoE layer 5"):
        sglang_logical_count(c, 5)


def test_cli_export(token_trace, tmp_path, capsys):
    out = tmp_path / "c.pt"
    assert main(["trace", "export", str(token_trace), "--to", "sglang-counts", "-o", str(out)]) == 0
    assert "logical_count [1, 6, 8]" in capsys.readouterr().out
    assert out.is_file()
    # an existing file needs --force
    assert main(["trace", "export", str(token_trace), "--to", "sglang-counts", "-o", str(out)]) == 2
    assert "already exists; pass --force" in capsys.readouterr().err
    assert main(["trace", "export", str(token_trace), "--to", "sglang-counts", "-o", str(out), "--force",
                 "--num-hidden-layers", "9"]) == 0
    assert tuple(torch.load(out, weights_only=True)["logical_count"].shape) == (1, 9, 8)


@pytest.mark.parametrize("args, message", [
    (["-o", "{tmp}/c.npy"], "unknown file type '.npy'; use a .pt or .json file name"),
    (["-o", "{tmp}/no/c.pt"], "directory"),
    (["-o", "{tmp}/c.pt", "--num-hidden-layers", "3"], "--num-hidden-layers 3 is too small"),
])
def test_cli_errors_are_one_line_and_write_nothing(token_trace, tmp_path, capsys, args, message):
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    before = sorted(p.name for p in tmp_path.iterdir())
    assert main(["trace", "export", str(token_trace), "--to", "sglang-counts", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("locus: error: ") and message in err and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_cli_missing_trace(tmp_path, capsys):
    assert main(["trace", "export", str(tmp_path / "absent"), "--to", "sglang-counts",
                 "-o", str(tmp_path / "c.pt")]) == 2
    assert "locus: error:" in capsys.readouterr().err
    assert not (tmp_path / "c.pt").exists()
