"""bench/serve.py against a real `locus serve --model tiny` subprocess on a free loopback port."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "serve.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_is_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture(scope="module")
def server_url(tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("server") / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "locus.cli", "serve", "--model", "tiny", "--port", str(port)],
                                stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                if httpx.get(f"{url}/health", timeout=2, trust_env=False).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        else:
            pytest.fail(f"server did not become ready: {log.read_text()[-2000:]}")
        yield url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def bench(*args: str, via_cli: bool = False, timeout: int = 120) -> subprocess.CompletedProcess:
    head = [sys.executable, "-m", "locus.cli", "bench", "serve"] if via_cli else [sys.executable, str(SCRIPT)]
    return subprocess.run([*head, *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow  # bench/serve.py against a real server
@pytest.mark.parametrize("client", ["raw", "aiohttp"])
def test_completions_with_token_id_prompts_reports_exact_lengths(server_url, tmp_path, client):
    out = tmp_path / "serve.json"
    r = bench("--base-url", server_url, "--num-prompts", "4", "--input-len", "8", "--output-len", "5",
              "--concurrency", "2", "--client", client, "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert f"({client}, " in r.stdout  # the CPU line names the client
    assert "Output token throughput" in r.stdout and "TTFT" in r.stdout
    result = json.loads(out.read_text())
    load = result["load"]
    assert result["model"] == "tiny" and result["endpoint"] == "completions" and result["request_rate"] == "inf"
    assert result["client"] == client
    assert (load["successful"], load["failed"], load["errors"]) == (4, 0, [])
    assert (load["prompt_tokens"], load["output_tokens"]) == (4 * 8, 4 * 5)  # token-id prompts + ignore_eos: exact
    assert load["duration_s"] > 0
    assert load["output_throughput"] == pytest.approx(load["output_tokens"] / load["duration_s"])
    assert load["total_token_throughput"] == pytest.approx((32 + 20) / load["duration_s"])
    for metric in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        m = load[metric]
        assert 0 < m["median"] <= m["p90"] <= m["p99"], metric
    assert load["ttft_ms"]["mean"] < load["e2e_ms"]["mean"]
    assert result["offline"] == [] and result["ratio_http_over_offline"] is None
    assert result["machine"]["cpus"] >= 1 and "source" in result
    sys.path.insert(0, str(SCRIPT.parent))
    import gpu_suite  # what the GPU suite reads of it

    assert gpu_suite.serve_figures(result)["output_throughput"] == load["output_throughput"]


@pytest.mark.slow  # bench/serve.py against a real server
def test_chat_with_poisson_arrivals_through_locus_bench(server_url, tmp_path):
    out = tmp_path / "chat.json"
    r = bench("--base-url", server_url, "--endpoint", "chat", "--num-prompts", "3", "--input-len", "6",
              "--output-len", "4", "--request-rate", "50", "--seed", "3", "--out", str(out), via_cli=True)
    assert r.returncode == 0, r.stderr
    load = json.loads(out.read_text())["load"]
    assert (load["successful"], load["output_tokens"]) == (3, 12)
    assert load["prompt_tokens"] > 3 * 6  # words and the chat template: more tokens than words


@pytest.mark.slow  # bench/serve.py against a real server
def test_text_dataset_file(server_url, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "The expert said"}\n{"prompt": "Once upon"}\n')
    out = tmp_path / "ds.json"
    r = bench("--base-url", server_url, "--dataset", str(data), "--num-prompts", "3", "--output-len", "3",
              "--warmup", "0", "--out", str(out))
    assert r.returncode == 0, r.stderr
    load = json.loads(out.read_text())["load"]
    assert (load["successful"], load["output_tokens"]) == (3, 9)


@pytest.mark.slow  # runs bench/serve.py as a subprocess
def test_unreachable_server_is_one_line_and_exit_2(tmp_path):
    r = bench("--port", str(free_port()), "--num-prompts", "2", "--out", str(tmp_path / "x.json"))
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "cannot reach" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "x.json").exists()


@pytest.mark.slow  # runs bench/serve.py as a subprocess
def test_compile_reaches_both_sides_and_bad_bucket_flags_are_refused(tmp_path):
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import serve as bench_serve
        from serve_lib.server import launch_command
    finally:
        sys.path.remove(str(SCRIPT.parent))
    args = bench_serve.parse_args(["--launch-model", "tiny", "--compare-offline", "--compile", "--compile-buckets", "32,8"])
    assert args.compile and args.compile_buckets == (8, 32)
    cmd = launch_command(args, 1234)
    assert cmd[cmd.index("--compile") + 1:cmd.index("--compile") + 3] == ["--compile-buckets", "8,32"]
    assert "--compile" not in launch_command(bench_serve.parse_args(["--launch-model", "tiny"]), 1234)
    for bad, message in ((["--compile-buckets", "8"], "needs --compile"), (["--compile", "--compile-buckets", "0,x"], "comma-separated")):
        r = bench("--launch-model", "tiny", *bad, "--out", str(tmp_path / "x.json"))
        assert r.returncode == 2 and message in r.stderr, r.stderr
        assert not (tmp_path / "x.json").exists()


@pytest.mark.slow  # loads the model twice (offline engine, then the launched server)
def test_launch_model_with_offline_comparison_stops_its_server(tmp_path):
    out = tmp_path / "launch.json"
    r = bench("--launch-model", "tiny", "--compare-offline", "--num-prompts", "4", "--input-len", "8",
              "--output-len", "4", "--concurrency", "2", "--rounds", "3", "--out", str(out))
    assert r.returncode == 0, r.stderr
    result = json.loads(out.read_text())
    load = result["load"]  # the last round's
    # the server's max_num_seqs, then the client's concurrency (same batch width as over HTTP)
    assert [o["max_num_seqs"] for o in result["offline"]] == [256, 2]
    for offline in result["offline"]:
        assert offline["output_tokens"] == load["output_tokens"] == 16
        assert offline["prompt_tokens"] == load["prompt_tokens"] == 32  # the very same prompts
    first, same_width = result["offline"]
    rounds = result["rounds"]
    assert len(rounds) == 3
    assert rounds[-1]["http_output_throughput"] == load["output_throughput"]
    assert rounds[-1]["ratios"] == pytest.approx([load["output_throughput"] / first["output_throughput"],
                                                 load["output_throughput"] / same_width["output_throughput"]])
    for width in range(2):  # the quoted ratios are the medians over the rounds
        median = sorted(r["ratios"][width] for r in rounds)[1]
        key = "ratio_http_over_offline" if width == 0 else "ratio_http_over_offline_same_width"
        assert result[key] == pytest.approx(median)
    assert "median HTTP / offline over 3 rounds" in r.stdout
    assert result["server"]["omp_num_threads"] == first["threads"]
    assert "HTTP / offline" in r.stdout
    port = int(result["base_url"].rsplit(":", 1)[1])
    assert not port_is_open(port)  # the launched server was stopped


def prefix_cache_hits(url: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=5, trust_env=False).text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("locus_prefix_cache_hits"))


@pytest.mark.slow  # bench/serve.py against a real server
def test_rounds_draw_new_prompts_so_the_prefix_cache_never_hits(server_url, tmp_path):
    # 40-token prompts fill two 16-token blocks each, which a repeat of the same prompt would reuse
    before = prefix_cache_hits(server_url)
    r = bench("--base-url", server_url, "--num-prompts", "3", "--input-len", "40", "--output-len", "2",
              "--rounds", "3", "--seed", "7100", "--out", str(tmp_path / "rounds.json"))
    assert r.returncode == 0, r.stderr
    assert len(json.loads((tmp_path / "rounds.json").read_text())["rounds"]) == 3
    assert prefix_cache_hits(server_url) == before
    # the check can fail: running the very same round again does hit the cache
    again = bench("--base-url", server_url, "--num-prompts", "3", "--input-len", "40", "--output-len", "2",
                  "--seed", "7100", "--out", str(tmp_path / "again.json"))
    assert again.returncode == 0, again.stderr
    assert prefix_cache_hits(server_url) > before


@pytest.mark.slow  # bench/serve.py against a real server
def test_compare_constrained_runs_the_workload_twice_and_reports_the_ratio(server_url, tmp_path):
    out = tmp_path / "serve.json"
    r = bench("--base-url", server_url, "--num-prompts", "4", "--input-len", "8", "--output-len", "6",
              "--compare-constrained", "0.5", "--rounds", "2", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "median ratio" in r.stdout
    constrained = json.loads(out.read_text())["constrained"]
    assert constrained["fraction"] == 0.5 and len(constrained["rounds"]) == 2
    assert all(row["failed"] == 0 and row["free"] > 0 and row["constrained"] > 0 for row in constrained["rounds"])
    assert constrained["median_ratio"] > 0


def test_the_client_skips_decoding_only_chunks_that_carry_a_token_and_nothing_else():
    """The load client leaves plain token chunks undecoded; every chunk our formats produce, even
    with text that looks like the keys it looks for, is classified as decoding it would."""
    from tests.bench.bench_scripts import BENCH
    sys.path.insert(0, str(BENCH))
    from serve_lib.load import carries_token, plain_token_chunk

    from locus.engine.checkpoint.loader import load
    from locus.engine.core.outputs import CompletionOutput, RequestOutput
    from locus.server import responses

    tok = load("tiny").tokenizer
    texts = ["hi", '"usage": {}', '"error": 1', '"role": "x"', "\n\n", ""]
    for fmt, chat in ((responses.CompletionFormat("m", tok), False), (responses.ChatFormat("m", tok), True)):
        usage = responses.Usage()
        frames = fmt.stream_start("r", 1, 1)
        for i, text in enumerate(texts):
            last = i == len(texts) - 1
            out = RequestOutput("r", [1], [CompletionOutput(0, "", [], text, [5], finish_reason="length" if last else None)],
                                last, metrics=None)
            frames += fmt.stream_chunk("r", 0, 1, out, usage)
        frames.append(fmt.usage_chunk("r", usage))
        for frame in frames:
            data = frame[len("data: "):].strip().encode()
            chunk = json.loads(data)
            if plain_token_chunk(data, chat):  # skipping the decode loses nothing
                assert carries_token(chunk, chat) and "usage" not in chunk and "error" not in chunk, frame
        # every token chunk, the finishing one too, skips it (not the role chunk nor the usage chunk)
        assert sum(plain_token_chunk(f[6:].strip().encode(), chat) for f in frames) == len(texts)
