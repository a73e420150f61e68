"""Trace recording over HTTP: /traces/start|stop|dump and --record-trace."""

from __future__ import annotations

import signal

import httpx

from locus.traces.reader import TraceReader
from tests.server.server_process import running_server


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
    with running_server("--model", "tiny", "--record-trace", str(tmp_path / "rec")) as proc:
        for i in range(3):
            complete(proc.base_url, f"prompt {i}")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    assert len(TraceReader(tmp_path / "rec").requests) == 3


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
