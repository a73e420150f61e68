"""Helpers for the router's tests: domain prompts of the shipped `mini` model, a locality plan made from
a mini recording, and real `locus serve` / `locus route` processes, each in its own process group that
is always stopped."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import httpx

from tests.server.server_process import free_port

MINI = Path(__file__).resolve().parents[2] / "locus" / "assets" / "mini"


def domain_texts(prompt_tokens: int = 24) -> dict[str, list[str]]:
    """Held-out documents of mini's training domains (heldout_sample.json) cut into prompts of about
    `prompt_tokens` tokens: {domain: [text, ...]}."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(MINI / "tokenizer.json"))
    out: dict[str, list[str]] = {}
    for domain, texts in json.loads((MINI / "heldout_sample.json").read_text())["documents"].items():
        for text in texts:
            ids = tok.encode(text, add_special_tokens=False).ids
            for start in range(0, max(1, len(ids) - 8), prompt_tokens):
                piece = ids[start:start + prompt_tokens]
                if len(piece) >= 8:
                    out.setdefault(domain, []).append(tok.decode(piece))
    return out


def planning_and_measured() -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """Two disjoint pools of prompts per domain: the plan is made from one, requests are sent from the other."""
    texts = domain_texts()
    return {d: p[0::2] for d, p in texts.items()}, {d: p[1::2] for d, p in texts.items()}


def mini_plan(root: Path, topology: str = "2x2", per_domain: int = 8) -> Path:
    """`locus plan --planner locality` from a recording of mini (in this process's engine) on the planning
    prompts, tagged with their domains: the plan has a grouping and a prompt predictor."""
    from locus.engine.frontend.llm import LLM
    from locus.engine.sampling.sampler import SamplingParams

    planning, _ = planning_and_measured()
    llm = LLM("mini", seed=0)
    core = llm.engine
    trace = root / "planning"
    core.start_recording(trace, "mini")
    i = 0
    for domain, prompts in planning.items():
        for prompt in prompts[:per_domain]:
            core.add_request(f"plan-{i}", llm.tokenizer.encode(prompt), SamplingParams(max_tokens=4, temperature=0),
                             domain=domain)
            i += 1
    while core.has_unfinished():
        core.step()
    core.dump_recording()
    plan = root / f"plan-{topology}.json"
    done = subprocess.run([sys.executable, "-m", "locus.cli", "plan", str(trace), "--topology", topology,
                           "--planner", "locality", "-o", str(plan)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return plan


def start(args: list[str], log: Path) -> subprocess.Popen:
    """A `python -m locus.cli ...` process in its own process group (stopped with stop())."""
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "locus.cli", *args], stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)


def stop(proc: subprocess.Popen, grace: float = 30.0) -> None:
    """SIGTERM the process group, then SIGKILL it if it lingers."""
    if proc.poll() is None:
        with _gone():
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    with _gone():
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


@contextmanager
def _gone():
    try:
        yield
    except ProcessLookupError:
        pass


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float = 180.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{url} exited early:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{url} did not become healthy:\n{log.read_text()[-3000:]}")
        time.sleep(0.2)


@contextmanager
def mini_backends(root: Path, count: int):
    """`count` `locus serve --model mini` processes, each with the trace API on (its own --trace-dir),
    started together. Yields [(url, process, trace dir)]."""
    started = []
    try:
        for i in range(count):
            port = free_port()
            traces = root / f"traces-{i}"
            log = root / f"backend-{i}.log"
            proc = start(["serve", "--model", "mini", "--host", "127.0.0.1", "--port", str(port), "--log-level",
                          "warning", "--enable-trace-api", "--trace-dir", str(traces)], log)
            started.append((f"http://127.0.0.1:{port}", proc, traces, log))
        for url, proc, _, log in started:
            wait_healthy(url, proc, log)
        yield [(url, proc, traces) for url, proc, traces, _ in started]
    finally:
        for _, proc, _, _ in started:
            stop(proc)


@contextmanager
def router(root: Path, plan: Path, backends: list[str], *extra: str, name: str = "router"):
    """A `locus route` process in front of `backends`; yields (base url, process, assignment log)."""
    port = free_port()
    log_file, out = root / f"{name}.jsonl", root / f"{name}.log"
    args = ["route", "--plan", str(plan), "--port", str(port), "--assignment-log", str(log_file), "--log-level",
            "warning", *extra]
    for b in backends:
        args += ["--backend", b]
    proc = start(args, out)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, out, timeout=60)
        yield url, proc, log_file
    finally:
        stop(proc)


def run_locus(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "locus.cli", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


def metric(text: str, name: str) -> dict[str, float]:
    """{labels: value} of one Prometheus metric in /metrics text."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            key, _, value = line.rpartition(" ")
            out[key[len(name):].strip("{}")] = float(value)
    return out
