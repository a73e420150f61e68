"""bench/route_load_tool.py (guidellm through the router, its token counts against the backends'),
bench/route_bytes.py (what routing saved, replayed through the router's log), bench/route_pairs.py
(the TTFT the router adds, request by request) and bench/route_instant.py (the same against backends
that answer at once): how each reads what it checks, and (slow) whole small runs. guidellm is not in the lock: its run is skipped without it
(LOCUS_GUIDELLM names the executable, else `guidellm` on PATH)."""

import json
import os
import shutil
import sys

import pytest

from tests.bench.bench_scripts import BENCH, run_bench

sys.path.insert(0, str(BENCH))

import route_load_tool  # noqa: E402

GUIDELLM = os.environ.get("LOCUS_GUIDELLM") or shutil.which("guidellm")


def test_the_tool_s_totals_count_successful_requests_only(tmp_path):
    ok = [{"prompt_tokens": 128, "output_tokens": 64}, {"prompt_tokens": 100, "output_tokens": 7}]
    report = {"benchmarks": [{"requests": {"successful": ok, "errored": [{"prompt_tokens": 5, "output_tokens": 0,
                                                                          "info": {"error": "boom"}}],
                                           "incomplete": None}}]}
    path = tmp_path / "g.json"
    path.write_text(json.dumps(report))
    totals = route_load_tool.tool_totals(path)
    assert (totals["successful"], totals["errored"], totals["incomplete"]) == (2, 1, 0)
    assert (totals["prompt_tokens"], totals["output_tokens"]) == (228, 71)
    assert totals["errors"] == ["boom"]


def test_the_guidellm_command_targets_the_router_s_completions():
    args = route_load_tool.parse_args(["--requests", "10", "--concurrency", "2"])
    command = route_load_tool.guidellm_command(args, "http://127.0.0.1:9", route_load_tool.Path("/tmp/r.json"))
    backend = command[command.index("--backend") + 1]
    assert backend == "kind=openai_http,target=http://127.0.0.1:9,model=mini,request_format=/v1/completions"
    assert "kind=max_requests,count=10" in command and "kind=concurrent,streams=2" in command


def test_without_guidellm_the_script_says_how_to_get_it(capsys):
    assert route_load_tool.main(["--guidellm", "/nonexistent/guidellm"]) == 2
    assert "pip install guidellm" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.skipif(GUIDELLM is None, reason="guidellm is not installed (not in the lock); LOCUS_GUIDELLM names it")
def test_guidellm_through_the_router_counts_what_the_backends_served(tmp_path):
    out = tmp_path / "tool.json"
    run_bench("route_load_tool.py", "--guidellm", GUIDELLM, "--requests", "12", "--concurrency", "4",
              "--prompt-tokens", "32", "--output-tokens", "8", "--out", str(out), timeout=900)
    result = json.loads(out.read_text())
    assert all(result["checks"].values()), result["checks"]
    assert result["tool"]["successful"] == 12 and result["served"]["locus_generation_tokens_total"] == 12 * 8


@pytest.mark.slow
def test_route_bytes_replays_the_router_s_assignment_and_round_robin_on_the_same_tokens(tmp_path):
    out = tmp_path / "bytes.json"
    run_bench("route_bytes.py", "--requests", "24", "--concurrency", "4", "--output-len", "4", "--out", str(out),
              timeout=900)
    result = json.loads(out.read_text())
    router, rr = result["figures"]["router"], result["figures"]["round_robin"]
    assert result["requests"] == 24 and result["failed"] == 0
    assert sum(result["admissions"].values()) == 24 and result["admissions"]["tagged"] == 12
    assert router["tokens"] == rr["tokens"] > 0
    assert result["saved"]["inter_node_bytes"] == pytest.approx(1 - router["inter_node_bytes"] / rr["inter_node_bytes"])


@pytest.mark.slow
def test_route_pairs_sends_every_prompt_to_both_targets(tmp_path):
    out = tmp_path / "pairs.json"
    run_bench("route_pairs.py", "--pairs", "6", "--output-len", "4", "--out", str(out), timeout=900)
    result = json.loads(out.read_text())
    pairs = result["pairs_ms"]
    assert len(pairs) == result["summary"]["pairs"] == 6 and all(d > 0 and r > 0 for d, r in pairs)
    middle = sorted(r - d for d, r in pairs)[2:4]  # the median of six differences
    assert result["summary"]["added_ms_p50"] == pytest.approx(sum(middle) / 2)
    assert result["summary"]["router_own_ms_p50"] is not None


@pytest.mark.slow
def test_route_instant_sends_every_prompt_to_both_targets_and_reads_the_router_s_cost(tmp_path):
    out = tmp_path / "instant.json"
    run_bench("route_instant.py", "--pairs", "6", "--output-len", "4", "--out", str(out), timeout=900)
    result = json.loads(out.read_text())
    pairs, summary = result["pairs_ms"], result["summary"]
    assert len(pairs) == summary["pairs"] == 6 and all(d > 0 and r > 0 for d, r in pairs)
    middle = sorted(r - d for d, r in pairs)[2:4]  # the median of six differences
    assert summary["added_ms_p50"] == pytest.approx(sum(middle) / 2)
    assert summary["router_own_ms_p50"] > 0 and summary["router_cpu_ms_per_request"] is not None
