"""`locus replay --hardware`: the predicted TPOT lines and JSON, the link flags as overrides, and the
one-line refusals; without --hardware the output is what it was."""

import json

import numpy as np
import pytest

from locus.cli import main
from locus.traces.format import TraceMeta
from locus.traces.writer import TraceWriter

SHAPE = {"source": "test", "hidden_size": 64, "moe_intermediate_size": 128, "num_hidden_layers": 4, "num_moe_layers": 2,
         "num_experts": 16, "top_k": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
         "dense_intermediate_size": 256, "shared_intermediate_size": 128, "vocab_size": 1000}


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    root = tmp_path_factory.mktemp("hw")
    rng = np.random.default_rng(1)
    meta = TraceMeta("toy", 16, 2, (1, 3), hidden_size=64, dtype_bytes=2)
    with TraceWriter(root / "trace", meta) as writer:
        for i in range(24):
            n = int(rng.integers(6, 30))
            ids = np.stack([rng.permutation(16)[:2] for _ in range(2 * n)]).reshape(n, 2, 2)
            writer.add_request(f"r{i}", "code" if i % 2 else "math", 4, ids)
    (root / "toy.json").write_text(json.dumps(SHAPE))
    return root


def replay(trace, tmp_path, *extra):
    out = tmp_path / "r.json"
    rc = main(["replay", str(trace / "trace"), "--plan", "eplb", "--topology", "2x2", "--slots", "5",
               "--plan-requests", "0:0.5", "--requests", "0.5:1.0", "--json", str(out), *extra])
    assert rc == 0
    return json.loads(out.read_text())


def test_predicted_tpot_is_printed_and_written(trace, tmp_path, capsys):
    doc = replay(trace, tmp_path, "--step-order", "decode", "--concurrency", "4", "--hardware", "h200-ib400",
                 "--model-shape", str(trace / "toy.json"))
    out = capsys.readouterr().out
    assert "decode order, 4 requests in flight" in out
    assert "predicted TPOT (p50 / p99)" in out and "dispatch+combine" in out and "h200-ib400, model shape toy" in out
    t = doc["step_time"]
    assert t["hardware"] == "h200-ib400" and t["steps"] > 0 and 0 < t["tpot_p50_ms"] <= t["tpot_p99_ms"]
    assert doc["concurrency"] == 4 and set(t["split_ms"]) == {"attention", "experts", "exchange", "overhead", "overlap"}

    # a slower inter-node link (--inter-gbps replaces the profile's) costs more exchange, nothing else
    slow = replay(trace, tmp_path, "--step-order", "decode", "--concurrency", "4", "--hardware", "h200-ib400",
                  "--model-shape", str(trace / "toy.json"), "--inter-gbps", "0.001")["step_time"]
    assert slow["split_ms"]["exchange"] > t["split_ms"]["exchange"]
    assert slow["split_ms"]["experts"] == t["split_ms"]["experts"]
    tbo = replay(trace, tmp_path, "--step-order", "decode", "--concurrency", "4", "--hardware", "h200-ib400",
                 "--model-shape", str(trace / "toy.json"), "--two-batch-overlap")["step_time"]
    assert tbo["two_batch_overlap"] and tbo["split_ms"]["overlap"] != 0
    assert "two-batch overlap" in capsys.readouterr().out
    assert t["host_overlap"] == "none"


def test_a_per_collective_profile_prints_what_its_overlap_takes_off(trace, tmp_path, capsys):
    # cpu-2core-tbf at a slow link: each collective runs under the host work before it, so the step is
    # shorter than its serial parts, and the split says by how much
    doc = replay(trace, tmp_path, "--step-order", "decode", "--concurrency", "4", "--hardware", "cpu-2core-tbf",
                 "--model-shape", str(trace / "toy.json"), "--inter-gbps", "0.001")
    t, out = doc["step_time"], capsys.readouterr().out
    assert t["host_overlap"] == "per_collective" and t["split_ms"]["overlap"] < 0
    assert "cpu-2core-tbf, model shape toy, host overlap per_collective" in out
    assert f"host overlap {t['split_ms']['overlap']:+.3f}" in out
    rc = main(["replay", str(trace / "trace"), "--plan", "eplb", "--topology", "2x2", "--slots", "5", "--hardware",
               "cpu-2core-tbf", "--model-shape", str(trace / "toy.json"), "--two-batch-overlap"])
    assert rc == 2 and "two-batch overlap is modelled on a profile whose host_overlap is 'none'" in capsys.readouterr().err


def test_without_hardware_nothing_changes(trace, tmp_path, capsys):
    doc = replay(trace, tmp_path)
    out = capsys.readouterr().out
    assert "step-time" not in out and "TPOT" not in out and "step_time" not in doc and "concurrency" not in doc


@pytest.mark.parametrize("extra, message", [
    (["--two-batch-overlap"], "--two-batch-overlap applies to the step-time model: add --hardware PROFILE"),
    (["--model-shape", "mini"], "--model-shape applies to the step-time model"),
    (["--hardware", "h200-ib400"], "model shape 'toy': neither a known model"),
    (["--hardware", "h200-ib400", "--model-shape", "mini"], "model shape 'mini' has hidden_size 256, the trace 64"),
    (["--hardware", "tpu-v9"], "hardware profile 'tpu-v9': neither a known profile"),
    (["--concurrency", "0", "--step-order", "decode"], "--concurrency must be at least 1"),
])
def test_refusals(trace, extra, message, capsys):
    rc = main(["replay", str(trace / "trace"), "--plan", "eplb", "--topology", "2x2", "--slots", "5", *extra])
    assert rc == 2
    assert message in capsys.readouterr().err
