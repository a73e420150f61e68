"""Trace recording over HTTP: /traces/start|stop|dump and --record-trace."""

from __future__ import annotations

import signal
import time
from contextlib import contextmanager

import httpx
import pytest

from locus.traces.reader import TraceReader
from tests.server.server_process import running_server

pytestmark = pytest.mark.slow  # every test starts a real `locus serve` process


def complete(base: str, prompt: str, domain: str | None = None, header: bool = False) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    headers = {}
    if domain and header:
        headers["X-Locus-Domain"] = domain
    elif domain:
        body["domain"] = domain
    r = httpx.post(f"{base}/v1/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_start_stop_dump_over_http(tmp_path):
    with running_server("--model", "tiny", "--enable-trace-api", "--trace-dir", str(tmp_path)) as proc:
        base = proc.base_url
        assert httpx.post(f"{base}/traces/dump").status_code == 400  # not recording
        r = httpx.post(f"{base}/traces/start", json={"path": "t"})
        assert r.status_code == 200 and r.json()["status"] == "recording"
        assert httpx.post(f"{base}/traces/start", json={"path": "u"}).status_code == 400
        complete(base, "hello", domain="code")
        complete(base, "world", domain="math", header=True)
        assert httpx.post(f"{base}/traces/stop").status_code == 200
        complete(base, "not recorded")
        dump = httpx.post(f"{base}/traces/dump").json()
        assert dump["requests"] == 2 and dump["path"] == str(tmp_path / "t")
    trace = TraceReader(tmp_path / "t")
    assert [r.domain for r in trace.requests] == ["code", "math"]
    assert [r.tokens for r in trace.requests] == [6 + 4, 6 + 4]  # BOS + 5 bytes, then 4 of 5 generated tokens


def test_record_trace_flag_writes_at_shutdown(tmp_path):
    """With a stream whose client leaves after 3 chunks: kept, marked aborted (issue 55, item 3, the
    single-process server as the expert-parallel one), so the trace holds every row the engine routed,
    which the expert-load counters of /metrics count."""
    from tests.server.test_expert_parallel_serving import stream_and_leave

    with running_server("--model", "tiny", "--record-trace", str(tmp_path / "rec")) as proc:
        for i in range(3):
            complete(proc.base_url, f"prompt {i}")
        assert stream_and_leave(proc.base_url, "a stream whose client leaves", "cut", 3) == "left"
        deadline, idle = time.monotonic() + 30, 'locus_num_requests_running{model_name="tiny"} 0.0'
        while idle not in (metrics := httpx.get(f"{proc.base_url}/metrics").text):
            assert time.monotonic() < deadline, "the aborted stream never ended"
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    trace = TraceReader(tmp_path / "rec")
    assert [r.aborted for r in trace.requests] == [False] * 3 + [True]
    cut = trace.requests[3]
    assert cut.domain == "cut" and cut.prompt_tokens + 2 <= cut.tokens < cut.prompt_tokens + 39
    routed = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                 if line.startswith("locus_expert_tokens_total{"))
    assert routed == int((trace.expert_ids[:] >= 0).sum())


def test_the_trace_api_is_off_unless_enabled_and_writes_only_inside_its_directory(tmp_path):
    """Issue 30, finding 4: /traces/start wrote wherever a client said, with no budget."""
    with running_server("--model", "tiny") as proc:
        r = httpx.post(f"{proc.base_url}/traces/start", json={"path": "x"})
        assert r.status_code == 404 and "--enable-trace-api" in r.json()["error"]["message"]
    root = tmp_path / "traces"
    outside = tmp_path / "outside"
    outside.mkdir()
    with running_server("--model", "tiny", "--enable-trace-api", "--trace-dir", str(root),
                        "--trace-max-bytes", "3000") as proc:
        base = proc.base_url
        assert root.is_dir()  # created at the first start
        (root / "escape").symlink_to(outside)
        for bad in (str(tmp_path / "abs"), "../up", "a/b", "..", ".hidden", "escape", "x" * 200):
            r = httpx.post(f"{base}/traces/start", json={"path": bad})
            assert r.status_code == 400, (bad, r.text)
            assert r.json()["error"]["type"] == "invalid_request_error"
        long_domain = complete_raw(base, "hi", "d" * 65)
        assert long_domain.status_code == 400 and "domain" in long_domain.json()["error"]["message"]
        assert httpx.post(f"{base}/traces/start", json={}).status_code == 200  # default name, inside root
        for i in range(12):  # ~600 bytes a request: the budget stops the recording after a few
            complete(base, f"prompt {i}", domain="code")
        dump = httpx.post(f"{base}/traces/dump").json()
        assert 0 < dump["requests"] < 12
        assert dump["path"].startswith(str(root))
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        log = proc.stdout.read()
    assert "--trace-max-bytes" in log
    assert list(outside.iterdir()) == [] and not (tmp_path / "abs").exists()


def complete_raw(base: str, prompt: str, domain: str) -> httpx.Response:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 5, "domain": domain}
    return httpx.post(f"{base}/v1/completions", json=body, timeout=60)


# ---------------------------------------------------------------- issue 41: recording failures never fail serving


@contextmanager
def tiny_tmpfs(path, size: str):
    """A small tmpfs at `path` (root only; skipped otherwise), always unmounted."""
    import os
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def metric(text: str, name: str) -> dict[str, float]:
    return {line.split("{", 1)[1].split("}")[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith(name + "{")}


@pytest.mark.slow
def test_a_full_disk_stops_the_recording_and_every_request_finishes(tmp_path):
    """Issue 41, finding 5, on a real full filesystem: every request finishing while recording failed
    after its whole generation (OSError: [Errno 28] as a 400), /traces/dump answered 500 and nothing
    was left on disk."""
    with tiny_tmpfs(tmp_path / "disk", "128k") as disk, \
            running_server("--model", "tiny", "--enable-trace-api", "--trace-dir", str(disk)) as proc:
        base = proc.base_url
        assert httpx.post(f"{base}/traces/start", json={"path": "t"}).status_code == 200
        for i in range(4):  # 3,000 rows of 24 bytes in two files each: the disk is full at the second
            body = {"prompt": f"{i}" * 3000, "max_tokens": 8, "ignore_eos": True, "temperature": 0,
                    "stream": i % 2 == 1}
            r = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            if not body["stream"]:
                assert r.json()["usage"]["completion_tokens"] == 8
            else:
                assert r.text.rstrip().endswith("data: [DONE]") and '"error"' not in r.text
        status = httpx.get(f"{base}/traces/status").json()
        assert status["state"] == "failed" and status["reason"] == "No space left on device (ENOSPC)", status
        assert status["stop_reason"] == "ENOSPC" and status["recording_failures"] == 1
        metrics = httpx.get(f"{base}/metrics").text
        assert metric(metrics, "locus_trace_recording_state")['model_name="tiny",state="failed"'] == 1.0
        assert metric(metrics, "locus_trace_recording_stop_reason") == {'model_name="tiny",reason="ENOSPC"': 1.0}
        assert metric(metrics, "locus_trace_recording_failures_total") == {'model_name="tiny"': 1.0}
        dump = httpx.post(f"{base}/traces/dump")
        assert dump.status_code == 200, dump.text
        dump = dump.json()
        assert dump["status"] == "failed" and dump["kept"] and dump["requests"] >= 1
        trace = TraceReader(disk / "t")
        assert len(trace.requests) == dump["requests"] and trace.num_tokens == dump["tokens"]
        assert [p.name for p in disk.iterdir()] == ["t"]  # no staging directory left behind
        assert httpx.get(f"{base}/traces/status").json()["state"] == "idle"
        assert httpx.get(f"{base}/health").status_code == 200


@pytest.mark.slow
def test_trace_names_never_collide_and_refusals_never_show_the_servers_paths(tmp_path):
    """Issue 41: /traces/start with an existing name, or {"path": null} twice within a second, was a
    500; the refusal of a second start showed the trace's absolute path."""
    with running_server("--model", "tiny", "--enable-trace-api", "--trace-dir", str(tmp_path)) as proc:
        base = proc.base_url
        names = []
        for _ in range(3):  # within a second: the default name gets -2, -3
            r = httpx.post(f"{base}/traces/start", json={"path": None})
            assert r.status_code == 200, r.text
            names.append(httpx.get(f"{base}/traces/status").json()["name"])
            refused = httpx.post(f"{base}/traces/start", json={})
            assert refused.status_code == 400 and str(tmp_path) not in refused.text
            assert names[-1] in refused.json()["error"]["message"]
            assert httpx.post(f"{base}/traces/dump").json()["status"] == "written"
        assert len(set(names)) == 3
        taken = httpx.post(f"{base}/traces/start", json={"path": names[0]})
        assert taken.status_code == 409 and taken.json()["error"]["type"] == "conflict_error"
        assert str(tmp_path) not in taken.text
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names)


@pytest.mark.slow
def test_the_byte_budget_covers_the_whole_trace_directory(tmp_path):
    """Issue 41: --trace-max-bytes bounded one recording, not the directory (25 start/dump cycles wrote
    688 KB against 64 KiB)."""
    (tmp_path / "older").mkdir()
    (tmp_path / "older" / "data").write_bytes(b"x" * 45_000)  # already in the directory: counted
    with running_server("--model", "tiny", "--enable-trace-api", "--trace-dir", str(tmp_path),
                        "--trace-max-bytes", "64KiB") as proc:
        base = proc.base_url
        for cycle in range(25):
            r = httpx.post(f"{base}/traces/start", json={"path": f"c{cycle}"})
            if r.status_code != 200:
                break
            for i in range(2):
                complete(base, f"cycle {cycle} request {i}")
            assert httpx.post(f"{base}/traces/dump").status_code == 200
        assert r.status_code == 507 and 0 < cycle < 25, (cycle, r.text)
        error = r.json()["error"]
        assert error["type"] == "insufficient_storage" and "--trace-max-bytes" in error["message"]
    total = sum(p.stat().st_size for p in tmp_path.rglob("*") if p.is_file())
    assert total <= 64 * 1024
