"""`locus serve` starting and stopping as a real process (issue 53): a failed bind is one line and
exit 1, --port is checked, port 0 names the port it took, SIGINT ends open streams with an error
frame at once, a second SIGINT exits on the spot, SIGTERM drains; and --help names the default model
it serves. Under `--ep-ranks` (issue 55) a launch is whole or nothing: a rank that fails while
starting ends every rank."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

import httpx
import pytest

from locus.cli import main
from tests.server.server_process import free_port, running_server

LONG_STREAM = {"prompt": "long", "max_tokens": 2000, "ignore_eos": True, "temperature": 0, "stream": True}


def serve(*args: str, err) -> subprocess.Popen:
    """`locus serve --model mini` writing its errors to `err`, a file: a rank left running would hold
    a pipe open, and reading it to the end would hang the test instead of failing it."""
    cmd = [sys.executable, "-m", "locus.cli", "serve", "--model", "mini", *args]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, text=True, env={**os.environ})


def failed_start(*args: str) -> tuple[int, str]:
    """The exit status and stderr of a `locus serve` that must stop before serving."""
    with tempfile.TemporaryFile("w+") as err:
        proc = serve(*args, err=err)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise AssertionError(f"`locus serve {' '.join(args)}` is still running") from None
        err.seek(0)
        return proc.returncode, err.read()


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


@pytest.mark.parametrize("host", ["256.1.1.1", "192.0.2.1"])  # no such address; not one of this machine
@pytest.mark.slow  # starts a real `locus serve` process
def test_a_bad_host_is_one_line_and_exit_1(host):
    port = free_port()
    code, err = failed_start("--host", host, "--port", str(port))
    assert code == 1, err
    assert_one_line(err, f"{host}:{port}")  # the reason is the OS's: "not known", "Cannot assign requested address"


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


def serving_processes(marker: str) -> list[int]:
    """The processes whose command line holds `marker` (a launch's unique --port), ranks included."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        if marker.encode() in b" ".join(args) and alive(int(cmdline.parent.name)):
            found.append(int(cmdline.parent.name))
    return found


def alive(pid: int) -> bool:
    try:
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


def rank_1_of(proc: subprocess.Popen, marker: str, timeout: float = 60.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        others = [pid for pid in serving_processes(marker) if pid != proc.pid]
        if others:
            return others[0]
        time.sleep(0.05)
    raise AssertionError(f"rank 0 started no rank 1 (exit status {proc.poll()})")


def wait_gone(pids: list[int], timeout: float) -> list[int]:
    deadline = time.monotonic() + timeout
    while any(map(alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [pid for pid in pids if alive(pid)]


@pytest.mark.slow  # starts real `locus serve --ep-ranks 2` processes
def test_an_expert_parallel_launch_on_a_busy_port_leaves_no_rank():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        code, err = failed_start("--ep-ranks", "2", "--host", "127.0.0.1", "--port", str(port))
        left = wait_gone(serving_processes(f"--port {port}"), 5)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert code == 1 and not left, (code, left, err)
    assert_one_line(err, f"127.0.0.1:{port}", "Address already in use")


@pytest.mark.slow  # starts real `locus serve --ep-ranks 2` processes
def test_a_rank_killed_while_starting_ends_the_launch_in_one_line():
    port = str(free_port())
    with tempfile.TemporaryFile("w+") as err:
        proc = serve("--ep-ranks", "2", "--host", "127.0.0.1", "--port", port, "--log-level", "warning", err=err)
        try:
            os.kill(rank_1_of(proc, f"--port {port}"), signal.SIGKILL)  # as the OOM killer would, mid-load
            code = proc.wait(30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        err.seek(0)
        text = err.read()
    assert code == 1, text
    assert_one_line(text, "rank 1 (status -9) exited while starting")


@pytest.mark.slow  # starts real `locus serve --ep-ranks 2` processes
def test_rank_0_killed_while_starting_takes_its_ranks_with_it():
    port = str(free_port())
    proc = serve("--ep-ranks", "2", "--host", "127.0.0.1", "--port", port, "--log-level", "warning",
                 err=subprocess.DEVNULL)
    rank1 = rank_1_of(proc, f"--port {port}")
    proc.kill()  # no chance to tell rank 1 anything
    proc.wait()
    left = wait_gone([rank1], 30)  # it may still be importing torch when rank 0 goes
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, "rank 1 outlived rank 0"
