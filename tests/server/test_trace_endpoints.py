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
    with running_server("--model", "tiny") as proc:
        base = proc.base_url
        assert httpx.post(f"{base}/traces/dump").status_code == 400  # not recording
        r = httpx.post(f"{base}/traces/start", json={"path": str(tmp_path / "t")})
        assert r.status_code == 200 and r.json()["status"] == "recording"
        assert httpx.post(f"{base}/traces/start", json={"path": str(tmp_path / "u")}).status_code == 400
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
