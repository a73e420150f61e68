"""The README's quick start, run as a newcomer runs it: the blocks between its quickstart markers, read
from the README itself. `make serve` starts in its own process group with PORT set to a free port (the
Makefile's `PORT ?= 8000` gives way to it); the wait for /health, the curl request and the Python
snippet run verbatim but for that port; the server's whole group is stopped at the end."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # starts `make serve`

ROOT = Path(__file__).resolve().parents[1]
BEGIN, END = "<!-- quickstart -->", "<!-- /quickstart -->"
README_ADDRESS = "127.0.0.1:8000"
SERVE = "make serve &"
READY_SECONDS = 120  # the server loads torch and `mini`; the venv is built before the suite runs


def quickstart_blocks() -> list[tuple[str, str]]:
    """(language, code) of the fenced blocks between the README's quickstart markers, in order."""
    text = (ROOT / "README.md").read_text()
    assert text.count(BEGIN) == 1 and text.count(END) == 1, f"README.md must hold {BEGIN} and {END} once each"
    section = text.split(BEGIN, 1)[1].split(END, 1)[0]
    return re.findall(r"^```(\w+)\n(.*?)^```", section, re.S | re.M)


def shell_commands(code: str) -> list[str]:
    """A bash block's commands, continuation lines joined, comments dropped."""
    lines = code.replace("\\\n", " ").splitlines()
    return [line.strip() for line in lines if line.strip() and not line.strip().startswith("#")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to `make` and the server it started (one process group), SIGKILL if they linger."""
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def test_the_readme_quickstart_runs_as_written(tmp_path):
    blocks = quickstart_blocks()
    assert [lang for lang, _ in blocks] == ["bash", "python"], "the quick start is one bash and one python block"
    commands = shell_commands(blocks[0][1])
    assert commands[0] == SERVE, f"the quick start starts with `{SERVE}`"
    wait, requests = commands[1], commands[2:]
    assert wait.startswith("until curl") and "/health" in wait, "the quick start waits for /health"
    assert requests and all(c.startswith("curl ") for c in requests)
    python = blocks[1][1]
    for text in [*commands, python]:
        assert ":8000" not in text.replace(README_ADDRESS, ""), f"a port other than the README's: {text}"
    # `make serve` would build the venv first where its stamp is older than the lock; the suite runs after
    # `make test` built it, so that only happens on a checkout whose lock changed since
    if subprocess.run(["make", "-q", ".venv/.locus-serve"], cwd=ROOT, capture_output=True).returncode != 0:
        pytest.skip("make serve would (re)build .venv first: run `make venv` (or `make test`) before this test")

    port = free_port()
    address = f"127.0.0.1:{port}"
    log = (tmp_path / "serve.log").open("wb")
    server = subprocess.Popen(["bash", "-c", SERVE.removesuffix("&").strip()], cwd=ROOT, stdout=log,
                              stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, "PORT": str(port)})
    try:
        waiter = subprocess.Popen(["bash", "-c", wait.replace(README_ADDRESS, address)], cwd=ROOT,
                                  stdout=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + READY_SECONDS
        while waiter.poll() is None:
            if server.poll() is not None or time.monotonic() > deadline:
                os.killpg(waiter.pid, signal.SIGKILL)
                waiter.wait()
                pytest.fail(f"the server was not ready within {READY_SECONDS} s (exit {server.poll()}):\n"
                            + (tmp_path / "serve.log").read_text()[-3000:])
            time.sleep(0.2)
        assert waiter.returncode == 0

        for command in requests:
            out = subprocess.run(["bash", "-c", command.replace(README_ADDRESS, address)], cwd=ROOT,
                                 capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stderr
            body = json.loads(out.stdout)  # an error (a wrong model name: 404) is an `error` object
            assert "error" not in body, body
            assert body["choices"][0]["text"].strip(), body

        script = tmp_path / "quickstart.py"
        script.write_text(python.replace(README_ADDRESS, address))
        out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip(), "the Python snippet printed no completion text"
    finally:
        stop_group(server)
        log.close()
