"""`locus trace ...` through the real dispatcher: output, exit codes, one-line errors."""

from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest

from locus.cli import main
from locus.traces.cli import PRESET_NAMES
from locus.traces.presets import PRESETS
from locus.traces.reader import TraceReader


def test_preset_names_match_the_presets():
    assert tuple(PRESETS) == PRESET_NAMES


def test_synth_validate_stats(tmp_path, capsys):
    out = tmp_path / "t"
    rc = main(["trace", "synth", "--preset", "mixtral-8x7b", "--requests", "30", "--seed", "3", "-o", str(out),
               "--domain-skew", "0.5", "--domains", "code=1,math=1", "--prompt-median", "20", "--decode-median", "10",
               "--weights", "--quiet"])
    assert rc == 0
    assert "30 requests" in capsys.readouterr().out
    r = TraceReader(out)
    assert {q.domain for q in r.requests} <= {"code", "math"} and r.expert_weights is not None

    assert main(["trace", "validate", str(out)]) == 0
    text = capsys.readouterr().out
    assert "valid locus-trace v1" in text and "8 experts, top-2, 32 MoE layers" in text

    assert main(["trace", "stats", str(out), "--json", str(tmp_path / "s.json"), "--quiet"]) == 0
    text = capsys.readouterr().out
    assert "load imbalance" in text and "domain specificity" in text
    d = json.loads((tmp_path / "s.json").read_text())
    assert d["num_requests"] == 30 and d["top_k"] == 2

    # Same seed, same trace; an existing output needs --force.
    assert main(["trace", "synth", "--preset", "mixtral-8x7b", "--requests", "30", "-o", str(out), "--quiet"]) == 2
    assert "already exists" in capsys.readouterr().err


def test_plots_or_a_clear_message(tmp_path, capsys):
    out = tmp_path / "t"
    assert main(["trace", "synth", "--preset", "llama4-scout", "--requests", "10", "-o", str(out), "--quiet"]) == 0
    rc = main(["trace", "stats", str(out), "--plots", str(tmp_path / "plots"), "--quiet"])
    if importlib.util.find_spec("matplotlib") is None:
        assert rc == 2 and "plots need matplotlib" in capsys.readouterr().err
    else:
        assert rc == 0 and (tmp_path / "plots" / "expert_load.png").exists()


def test_errors_are_one_line(tmp_path, capsys):
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "meta.json").write_text("{")
    assert main(["trace", "validate", str(tmp_path / "broken")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("locus: error: ") and "meta.json: not valid JSON" in err and err.count("\n") == 1
    assert main(["trace", "stats", str(tmp_path / "missing")]) == 2
    assert "not a trace directory" in capsys.readouterr().err


def test_import_and_count_trace_commands(tmp_path, capsys):
    src = tmp_path / "routing.jsonl"
    src.write_text("".join(json.dumps({"step": s, "layer": layer, "top_indices": [[s, 1], [2, 3]]}) + "\n"
                           for s in range(3) for layer in (1, 3)))
    out = tmp_path / "t"
    assert main(["trace", "import", "--from", "megatron", str(src), "-o", str(out), "--hidden-size", "64"]) == 0
    captured = capsys.readouterr()
    assert "wrote tokens trace" in captured.out and "num_experts inferred" in captured.err
    assert TraceReader(out).meta.moe_layers == (1, 3)
    assert main(["trace", "import", "--from", "megatron", str(src), "-o", str(tmp_path / "u")]) == 2
    assert "--hidden-size" in capsys.readouterr().err

    from locus.traces.counts import write_counts

    write_counts(tmp_path / "c", TraceReader(out).meta, np.array([[3, 3, 0, 0], [1, 1, 2, 2]]), num_tokens=6)
    assert main(["trace", "validate", str(tmp_path / "c")]) == 0
    assert "valid count trace" in capsys.readouterr().out
    assert main(["trace", "stats", str(tmp_path / "c")]) == 0
    assert "count trace: 6 tokens" in capsys.readouterr().out


def test_bare_trace_command_prints_help(capsys):
    assert main(["trace"]) == 2
    assert "synth" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["trace", "synth", "--help"], ["trace", "import", "--help"]])
def test_help(argv, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 0


def test_cli_module_and_package_stay_light():
    """`locus --help` must not pay for numpy: the trace CLI and package import it lazily."""
    import subprocess
    import sys

    code = "import sys, locus.traces, locus.traces.cli; print('numpy' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"
    import locus.traces as traces
    from locus.traces.reader import TraceReader as Reader

    assert traces.TraceReader is Reader and "compute_stats" in traces.__all__
