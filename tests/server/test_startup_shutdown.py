"""`locus serve` starting and stopping as a real process (issue 53): a failed bind is one line and
exit 1, --port is checked, port 0 names the port it took, SIGINT ends open streams with an error
frame at once, a second SIGINT exits on the spot, SIGTERM drains; and --help names the default model
it serves."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterable, Iterator

import httpx
import pytest

from locus.cli import main
from tests.server.server_process import free_port, running_server

LONG_STREAM = {"prompt": "long", "max_tokens": 2000, "ignore_eos": True, "temperature": 0, "stream": True}


def serve(*args: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "locus.cli", "serve", "--model", "mini", *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ})


def failed_start(*args: str) -> tuple[int, str]:
    """The exit status and stderr of a `locus serve` that must stop before serving."""
    proc = serve(*args)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise AssertionError(f"`locus serve {' '.join(args)}` is still running") from None
    return proc.returncode, err


def assert_one_line(err: str, *words: str) -> None:
    assert "terminate called" not in err and "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and all(w in lines[0] for w in words), err


@pytest.mark.slow  # starts a real `locus serve` process
def test_a_busy_port_is_one_line_and_exit_1():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, err = failed_start("--host", "127.0.0.1", "--port", str(port))
    assert code == 1, err
    assert_one_line(err, f"127.0.0.1:{port}", "Address already in use")


@pytest.mark.parametrize("host", ["256.1.1.1", "no-such-host.invalid"])
@pytest.mark.slow  # starts a real `locus serve` process
def test_a_bad_host_is_one_line_and_exit_1(host):
    port = free_port()
    code, err = failed_start("--host", host, "--port", str(port))
    assert code == 1, err
    assert_one_line(err, f"{host}:{port}")  # the reason is the resolver's: "not known", or a DNS failure


@pytest.mark.slow  # starts a real `locus serve` process
def test_a_port_beyond_65535_is_refused():
    code, err = failed_start("--port", "99999")
    assert code == 2, err
    assert_one_line(err, "--port", "99999")


class Output:
    """A process's output, read on a thread as it comes, so a test can wait for a line with a bound."""

    def __init__(self, stream):
        self.lines: list[str] = []
        self.changed = threading.Condition()
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream) -> None:
        for line in stream:
            with self.changed:
                self.lines.append(line)
                self.changed.notify_all()

    def wait_for(self, pattern: str, timeout: float) -> re.Match:
        with self.changed:
            found = self.changed.wait_for(lambda: self._search(pattern), timeout)
        assert found, f"no line matching {pattern!r} within {timeout} s:\n{self.text()}"
        return found

    def _search(self, pattern: str) -> re.Match | None:
        return next((m for m in map(re.compile(pattern).search, self.lines) if m), None)

    def text(self) -> str:
        with self.changed:
            return "".join(self.lines)


def wait_healthy(base: str, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{base} never became healthy (exit status {proc.poll()})")


def data_frames(lines: Iterable[str]) -> Iterator[str]:
    return (line.removeprefix("data: ") for line in lines if line.startswith("data: "))


@pytest.mark.slow  # starts a real `locus serve` process
def test_port_0_names_the_port_it_took_and_sigint_ends_streams_with_an_error_frame():
    proc = subprocess.Popen([sys.executable, "-m", "locus.cli", "serve", "--model", "mini", "--host", "127.0.0.1",
                             "--port", "0", "--log-level", "info"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ})
    out = Output(proc.stdout)
    try:
        port = int(out.wait_for(r"locus\.server: running on http://127\.0\.0\.1:(\d+)", 60).group(1))
        assert port != 0
        base = f"http://127.0.0.1:{port}"
        wait_healthy(base, proc)  # the port the line names is the one that answers
        with httpx.Client(base_url=base, timeout=httpx.Timeout(30, read=10)) as http:
            with http.stream("POST", "/v1/completions", json=LONG_STREAM) as r:
                frames = data_frames(r.iter_lines())
                assert json.loads(next(frames))["choices"]
                proc.send_signal(signal.SIGINT)
                interrupted = time.monotonic()
                last = list(frames)[-1]
                took = time.monotonic() - interrupted
        proc.send_signal(signal.SIGINT)  # Ctrl-C again, as an impatient user would: still no traceback
        code = proc.wait(15)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert took < 3.0, f"the stream ended {took:.1f} s after SIGINT"
    error = json.loads(last)["error"] if last != "[DONE]" else {}
    assert error.get("type") == "service_unavailable" and "interrupted" in error["message"], last
    assert code in (0, 130)
    assert "Traceback" not in out.text() and "CancelledError" not in out.text(), out.text()


@pytest.mark.slow  # starts a real `locus serve` process
def test_sigterm_drains_open_streams_and_a_sigint_meanwhile_exits_at_once():
    short = {**LONG_STREAM, "max_tokens": 48}
    with running_server("--model", "mini", "--graceful-timeout", "60") as proc:
        with httpx.Client(base_url=proc.base_url, timeout=httpx.Timeout(30, read=10)) as http:
            with http.stream("POST", "/v1/completions", json=LONG_STREAM) as long_r:
                long_frames = data_frames(long_r.iter_lines())
                with http.stream("POST", "/v1/completions", json=short) as short_r:
                    short_frames = data_frames(short_r.iter_lines())
                    assert json.loads(next(short_frames))["choices"]
                    proc.send_signal(signal.SIGTERM)
                    drained = list(short_frames)
                assert drained[-1] == "[DONE]" and not any('"error"' in frame for frame in drained)
                assert json.loads(next(long_frames))["choices"]  # still streaming during the drain
                proc.send_signal(signal.SIGINT)
                interrupted = time.monotonic()
                code = proc.wait(15)
        took = time.monotonic() - interrupted
        log = proc.stdout.read()
    assert code == 130 and took < 5.0, (code, took, log)
    assert "Traceback" not in log and "CancelledError" not in log, log


def test_help_names_mini_as_the_default_model(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "Default: 'mini'" in text and "default tiny" not in text.lower() and "'tiny' preset, built" not in text
