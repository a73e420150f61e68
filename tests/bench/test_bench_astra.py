"""bench/astra.py without ASTRA-sim: the skip path, the parsing of ASTRA-sim's output, and the whole
run against a stand-in binary that checks its inputs and prints what ASTRA-sim's workload layer prints."""

import importlib.util
import json
import stat
import sys
import textwrap

import pytest
from tests.bench.bench_scripts import BENCH, run_bench

spec = importlib.util.spec_from_file_location("bench_astra", BENCH / "astra.py")
astra = importlib.util.module_from_spec(spec)
spec.loader.exec_module(astra)

# ASTRA-sim 518bd51's workload-layer report lines (spdlog pattern around them), interleaved with others
OUTPUT = """\
[2026-05-01 10:00:00.000] [workload] [info] sys[1] finished, 1830, exposed communication 1830 cycles.
[2026-05-01 10:00:00.001] [workload] [info] sys[0] finished, 2048000 cycles, exposed communication 2000000 cycles.
[2026-05-01 10:00:00.001] [statistics] [info] sys[0] something else 12 cycles
[2026-05-01 10:00:00.002] [workload] [info] sys[1] finished, 2050500 cycles, exposed communication 2050500 cycles.
"""


@pytest.mark.slow  # runs bench/astra.py as a subprocess
def test_skips_without_a_binary(monkeypatch, tmp_path):
    monkeypatch.delenv(astra.ENV_BIN, raising=False)
    out = run_bench("astra.py", "--out", str(tmp_path / "astra.json"))
    assert "skipped: no ASTRA-sim binary" in out and "ASTRA_SIM_BIN" in out
    assert not (tmp_path / "astra.json").exists()


def test_binary_from_flag_then_environment():
    assert astra.find_binary(None, env={}) is None
    assert astra.find_binary(None, env={"ASTRA_SIM_BIN": "/x/astra"}) == "/x/astra"
    assert astra.find_binary("/y/astra", env={"ASTRA_SIM_BIN": "/x/astra"}) == "/y/astra"
    assert astra.find_binary(None, env={"ASTRA_SIM_BIN": ""}) is None


def test_parses_the_finish_lines():
    ranks = astra.parse_astra_output(OUTPUT)
    assert ranks == {0: (2048000, 2000000), 1: (2050500, 2050500)}  # the malformed first line is not matched
    summary = astra.simulated_summary(ranks, 2)
    assert summary["simulated_ns"] == 2050500 and summary["simulated_ms"] == pytest.approx(2.0505)
    assert summary["rank_finish_ns"] == [2048000, 2050500]
    with pytest.raises(astra.BenchError, match="1 of 2 ranks finished"):
        astra.simulated_summary({0: (5, 5)}, 2)


FAKE = """\
#!{python}
# Stand-in for AstraSim_Analytical_Congestion_Unaware: checks its arguments and inputs, then prints one
# workload-layer report line per rank (finish tick = the rank's trace size, so plans differ).
import json, os, sys
args = dict(a[2:].split("=", 1) for a in sys.argv[1:])
net = {{}}
for line in open(args["network-configuration"]):
    if ":" in line and not line.startswith("#"):
        key, value = line.split(":", 1)
        net[key.strip()] = [v.strip() for v in value.strip(" []\\n").split(",")]
json.load(open(args["system-configuration"])); json.load(open(args["remote-memory-configuration"]))
ranks = 1
for n in net["npus_count"]:
    ranks *= int(n)
os.makedirs(args["logging-folder"], exist_ok=True)
for r in range(ranks):
    size = os.path.getsize(args["workload-configuration"] + f".{{r}}.et")
    print(f"[t] [workload] [info] sys[{{r}}] finished, {{size}} cycles, exposed communication {{size}} cycles.")
"""


@pytest.mark.slow  # runs bench/astra.py as a subprocess
def test_runs_every_plan_through_the_binary(tmp_path):
    fake = tmp_path / "fake_astra"
    fake.write_text(FAKE.format(python=sys.executable))
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    out_json = tmp_path / "astra.json"
    out = run_bench("astra.py", "--astra-bin", str(fake), "--requests", "8", "--topologies", "2x2",
                    "--batch-tokens", "512", "--out", str(out_json), "--keep", str(tmp_path / "work"), timeout=600)
    doc = json.loads(out_json.read_text())
    rows = doc["rows"]
    assert [r["plan"] for r in rows] == list(astra.PLANS)
    for r in rows:
        assert r["gpus"] == 4 and r["inter_node_bytes"] > 0 and r["locus_a2a_ms"] > 0
        assert r["simulated_ns"] == max(r["rank_finish_ns"]) and len(r["rank_finish_ns"]) == 4
        assert f"| {r['plan']} | 4 (2x2) |" in out
    assert (tmp_path / "work" / "2x2_locality_grouper" / "et.network.yml").exists()
    assert textwrap.dedent("| plan | GPUs |") in out
