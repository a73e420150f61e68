"""Expert-parallel serving with real processes: `locus serve --ep-ranks`, two torchrun agents, and a
rank killed mid-stream."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from locus.engine.frontend.llm import LLM
from locus.engine.sampling.sampler import SamplingParams
from locus.traces.prompt_families import FAMILIES, family_prompt
from tests.server.server_process import free_port, running_server

pytestmark = pytest.mark.slow  # every test starts a server of 2-4 rank processes

PROMPTS = ["expert parallel", "a longer prompt that takes a few more tokens to prefill", "x"]


def children_of(pid: int) -> list[int]:
    out = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(line.split(":\t", 1) for line in status.read_text().splitlines() if ":\t" in line)
        except OSError:
            continue
        if fields.get("PPid", "").strip() == str(pid):
            out.append(int(status.parent.name))
    return out


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/status").read_text().find("State:\tZ") < 0
    except OSError:
        return False


@pytest.fixture(scope="module")
def two_by_two():
    """One `--ep-ranks 4 --gpus-per-node 2` server of `tiny` for the tests that only send it requests (a
    launch of four ranks is most of such a test's time); its clean stop is checked once the last is done."""
    with running_server("--model", "tiny", "--ep-ranks", "4", "--gpus-per-node", "2") as proc:
        rank_pids = children_of(proc.pid)
        yield proc, rank_pids
    assert proc.returncode == 0
    assert not any(alive(pid) for pid in rank_pids), "a rank outlived the server"


def test_four_ranks_as_2x2_serve_what_one_process_serves(two_by_two):
    """The ranks' clean exit on SIGTERM (code 0, no rank left) is checked as the shared server stops."""
    llm = LLM("tiny")
    want = [out.outputs[0].text for out in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))]
    proc, rank_pids = two_by_two
    assert len(rank_pids) == 3  # ranks 1..3
    client = openai.OpenAI(base_url=f"{proc.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    got = [client.completions.create(model="tiny", prompt=p, max_tokens=10, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text for p in PROMPTS]
    assert got == want
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model="tiny", prompt=PROMPTS[1], max_tokens=10, temperature=0, stream=True, extra_body={"ignore_eos": True}))
    assert streamed == want[1]
    n2 = client.completions.create(model="tiny", prompt="two", max_tokens=5, n=2, seed=3)
    assert len(n2.choices) == 2
    stats = httpx.get(f"{proc.base_url}/ep/stats").json()
    assert stats["ranks"] == 4 and stats["inter_node_bytes"] > 0 and stats["intra_node_bytes"] > 0
    assert stats["tokens"] > 0


def test_two_torchrun_agents_serve_through_the_openai_client():
    port, master = free_port(), free_port()
    env = {**os.environ}
    env.pop("WORLD_SIZE", None)
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    agents = [subprocess.Popen([torchrun, "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(n),
                                "--master-addr", "127.0.0.1", "--master-port", str(master),
                                "-m", "locus.cli", "serve", "--model", "tiny", "--port", str(port), "--log-level", "warning"],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
              for n in (0, 1)]
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            assert all(a.poll() is None for a in agents), "an agent exited before the server was ready"
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the torchrun-launched server did not become healthy"
            time.sleep(0.3)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
        r = client.completions.create(model="tiny", prompt="two machines", max_tokens=6, temperature=0)
        assert r.usage.completion_tokens == 6
        assert httpx.get(f"{base}/ep/stats").json()["inter_node_bytes"] > 0  # 2 nodes of 1 rank: tier 1 only
    finally:
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, signal.SIGTERM)
        for a in agents:
            try:
                a.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(a.pid, signal.SIGKILL)
                a.wait()


def test_a_killed_rank_fails_open_streams_and_ends_the_server_with_no_process_left():
    with running_server("--model", "tiny", "--ep-ranks", "2", "--ep-timeout", "5") as proc:
        (rank1,) = children_of(proc.pid)
        body = {"prompt": "long", "max_tokens": 3000, "ignore_eos": True, "temperature": 0, "stream": True}
        with httpx.Client(base_url=proc.base_url, timeout=60) as http:
            with http.stream("POST", "/v1/completions", json=body) as r:
                lines = r.iter_lines()
                assert next(line for line in lines if line).startswith("data: {")
                os.kill(rank1, signal.SIGKILL)
                killed = time.monotonic()
                rest = [line for line in lines if line]
        assert json.loads(rest[-1].removeprefix("data: "))["error"]["type"] == "service_unavailable"
        try:  # the server may already be gone; while it is not, it says it is broken
            assert httpx.get(f"{proc.base_url}/health", timeout=2).status_code == 503
        except httpx.TransportError:
            pass
        code = proc.wait(30)
        assert time.monotonic() - killed < 5 + 15
    assert code != 0
    assert not alive(rank1)
    assert children_of(proc.pid) == []


def test_a_raised_error_on_another_rank_reaches_every_stream_at_once():
    """A rank whose step raises (a bug in its forward, injected by faulty_serve) says why in the
    rendezvous store and leaves; rank 0's next collective with it fails at once, not at --ep-timeout,
    every open stream ends with an error object, and rank 0's log names the rank and its error."""
    from tests.server.faulty_serve import FAULT

    with running_server("--model", "tiny", "--ep-ranks", "2", "--ep-timeout", "60", module="tests.server.faulty_serve") as proc:
        (rank1,) = children_of(proc.pid)
        long = {"prompt": "long", "max_tokens": 3000, "ignore_eos": True, "temperature": 0, "stream": True}
        with httpx.Client(base_url=proc.base_url, timeout=60) as http:
            with http.stream("POST", "/v1/completions", json=long) as r:  # rank 0 (balanced: the first request)
                lines = r.iter_lines()
                assert next(line for line in lines if line).startswith("data: {")
                sent = time.monotonic()
                fault = http.post("/v1/completions", json={"prompt": FAULT.decode(), "max_tokens": 4})  # rank 1
                rest = [line for line in lines if line]
                ended = time.monotonic()
        error = json.loads(rest[-1].removeprefix("data: "))["error"]
        assert ended - sent < 2.0, f"the open stream learned of the failure after {ended - sent:.1f} s"
        assert error["type"] == "service_unavailable"
        assert fault.status_code >= 500 and "error" in fault.json()
        code = proc.wait(30)
        log = proc.stdout.read()
    assert code != 0
    assert "rank 1 failed: RuntimeError: injected fault" in log
    assert not alive(rank1)
    assert children_of(proc.pid) == []


def test_expert_load_in_metrics_is_every_ranks(two_by_two):
    """/metrics' locus_expert_tokens sums the (token, slot) pairs every rank routed, not rank 0's:
    K pairs per token and MoE layer, for the tokens /ep/stats says the ranks ran (both counters count
    from the launch, so what other tests sent the shared server is in both)."""
    from locus.engine.checkpoint.presets import PRESETS

    config = PRESETS["tiny"]
    proc, _ = two_by_two
    client = openai.OpenAI(base_url=f"{proc.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    with ThreadPoolExecutor(6) as pool:  # in flight together: the balanced assignment spreads them
        list(pool.map(lambda i: client.completions.create(model="tiny", prompt=f"prompt {i} " * (i + 1),
                                                          max_tokens=12, temperature=0), range(6)))
    stats = httpx.get(f"{proc.base_url}/ep/stats").json()
    metrics = httpx.get(f"{proc.base_url}/metrics").text
    pairs = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith("locus_expert_tokens_total{"))
    assert sum(1 for r in stats["per_rank"] if r["tokens"] > 0) >= 3
    assert pairs == stats["tokens"] * config.num_experts_per_tok * len(config.moe_layers)


def domain_prompt(domain: str, i: int) -> str:
    """bench/ep.py's prompt families, shorter (locus/traces/prompt_families.py)."""
    return family_prompt(domain, i, min_chars=12, step=3, cycle=5)


def record_planning_trace(path: Path, families: tuple[str, ...] = tuple(FAMILIES), requests: int = 24,
                          model_name: str = "small") -> None:
    """A single-process engine on `model_name` (a preset) records the routing of a mixed-domain workload."""
    from locus.engine.core.engine_core import EngineConfig, EngineCore
    from locus.engine.checkpoint.presets import build_preset
    from locus.engine.checkpoint.tokenizer import ByteTokenizer

    model = build_preset(model_name)
    tok = ByteTokenizer(model.config.vocab_size)
    core = EngineCore(model, tok, EngineConfig(block_size=8, num_kv_blocks=256))
    core.start_recording(path, model_name)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for i in range(requests):
        domain = families[i % len(families)]
        core.add_request(f"plan-{i}", tok.encode(domain_prompt(domain, i)), params, domain)
    while core.has_unfinished():
        core.step()
    core.dump_recording()


def locality_plan(tmp_path: Path, slots: int, families: tuple[str, ...] = tuple(FAMILIES), requests: int = 24,
                  model_name: str = "small") -> Path:
    """`locus plan --planner locality` for 2x2 from a planning trace recorded on `model_name`."""
    record_planning_trace(tmp_path / "planning", families, requests, model_name)
    plan_path = tmp_path / "plan.json"
    planned = subprocess.run([sys.executable, "-m", "locus.cli", "plan", str(tmp_path / "planning"), "--topology", "2x2",
                              "--slots", str(slots), "--planner", "locality", "-o", str(plan_path)],
                             capture_output=True, text=True, timeout=300)
    assert planned.returncode == 0, planned.stderr
    return plan_path


def test_measured_bytes_equal_the_replay_of_the_trace_the_server_recorded(tmp_path):
    """docs/design.md's promise ("Expert-parallel serving"): what a running server counts equals, to the byte, what `locus replay`
    computes for the same routing, plan and request -> rank assignment. `small` on 2x2 under a
    locality plan (replicas, and a grouping: the front-end assigns requests with the plan's grouper)."""
    from locus.routing.plan.grouping_spec import spec_of
    from locus.routing.plan.placement import load_plan
    from locus.traces.reader import TraceReader

    plan_path = locality_plan(tmp_path, slots=6)
    plan = load_plan(plan_path)
    domain_nodes = {d: {n for n, w in enumerate(ws) if w > 0} for d, ws in spec_of(plan).domain_nodes.items()}
    assert set(domain_nodes) == set(FAMILIES)

    trace = tmp_path / "trace"
    with running_server("--model", "small", "--ep-ranks", "4", "--gpus-per-node", "2", "--plan", str(plan_path),
                        "--record-trace", str(trace)) as proc:
        client = openai.OpenAI(base_url=f"{proc.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
        for i in range(9):
            domain = list(FAMILIES)[i % 3]
            response = client.completions.create(model="small", prompt=domain_prompt(domain, 100 + i), max_tokens=4 + i % 3,
                                                 temperature=0.7, seed=i, stream=i % 2 == 0,
                                                 extra_headers={"x-locus-domain": domain})
            if i % 2 == 0:
                reasons = [c.finish_reason for chunk in response for c in chunk.choices]  # read to the end
                assert reasons[-1] == "length"
        stats = httpx.get(f"{proc.base_url}/ep/stats").json()
        metrics = httpx.get(f"{proc.base_url}/metrics").text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    out = tmp_path / "replay.json"
    done = subprocess.run([sys.executable, "-m", "locus.cli", "replay", str(trace), "--plan", str(plan_path),
                           "--assign", "recorded", "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    replayed = json.loads(out.read_text())
    assert replayed["requests"] == [0, 9]
    assert (stats["inter_node_bytes"], stats["intra_node_bytes"]) == (replayed["inter_node_bytes"], replayed["intra_node_bytes"])
    assert stats["inter_node_bytes"] > 0 and stats["intra_node_bytes"] > 0
    assert stats["tokens"] == replayed["tokens"]

    # the plan's grouper assigned the requests: each ran on a node of its domain
    assert stats["assignment"] == "grouper"
    for record in TraceReader(trace).requests:
        assert record.rank // 2 in domain_nodes[record.domain], (record.domain, record.rank)

    # /metrics says the same as /ep/stats; every rank holds 6 of 16 experts' weights per layer
    full = 4 * 16 * (256 * 1024 + 512 * 256) * 4
    assert [r["expert_bytes"] for r in stats["per_rank"]] == [full * 6 // 16] * 4
    for tier in ("inter_node", "intra_node"):
        sent = sum(float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                   if line.startswith("locus_ep_bytes_total{") and f'tier="{tier}"' in line)
        assert sent == stats[f"{tier}_bytes"]
    assert sum(r["expert_pairs"] for r in stats["per_rank"]) > 0
    assert all(r["steps"] > 0 and r["step_s"] >= r["exchange_s"] + r["control_s"] for r in stats["per_rank"])
    assert 'locus_ep_rank_step_seconds_total{model_name="small",part="exchange",rank="1"}' in metrics


def test_a_live_replan_under_load_moves_experts_and_keeps_every_stream(tmp_path):
    """--replan-api: streams of a shifted domain mix decode while POST /ep/replan forces a re-plan (a
    second one meanwhile gets 409); every stream completes with the single-process greedy tokens, and
    /ep/stats' bytes per placement epoch equal `locus replay --plan embedded` of the recorded trace."""
    from concurrent.futures import ThreadPoolExecutor as Pool

    from locus.engine.frontend.llm import LLM

    plan_path = locality_plan(tmp_path, slots=5, families=("code",), requests=12)  # planned for code only
    shifted = [("math" if i % 2 else "chat", domain_prompt("math" if i % 2 else "chat", 200 + i)) for i in range(8)]
    want = [o.outputs[0].text for o in LLM("small").generate([p for _, p in shifted],
                                                              SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))]
    trace = tmp_path / "trace"
    with running_server("--model", "small", "--ep-ranks", "4", "--gpus-per-node", "2", "--plan", str(plan_path),
                        "--record-trace", str(trace), "--replan-api", "--replan-window", "256") as proc:
        base = proc.base_url

        def stream(item) -> str:
            domain, prompt = item
            body = {"prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True, "stream": True}
            chunks = []
            with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=300,
                              headers={"x-locus-domain": domain}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        chunks.append(json.loads(line[6:]))
                        decoding.release()
            assert all("error" not in c for c in chunks), chunks[-1]
            return "".join(c["choices"][0]["text"] for c in chunks if c.get("choices"))

        decoding = threading.Semaphore(0)
        with Pool(9) as pool:
            streams = [pool.submit(stream, item) for item in shifted]
            for _ in range(4 * len(shifted)):  # the streams are decoding: a few tokens each in the window
                assert decoding.acquire(timeout=120)
            first = pool.submit(httpx.post, f"{base}/ep/replan", json={"force": True}, timeout=300)
            deadline = time.monotonic() + 60  # a second request while the first is under way: 409
            while httpx.get(f"{base}/ep/stats").json()["replan"]["state"] == "idle" and not first.done():
                assert time.monotonic() < deadline
                time.sleep(0.01)
            second = httpx.post(f"{base}/ep/replan", json={}, timeout=300)
            decision = first.result().json()
            got = [s.result() for s in streams]
        assert second.status_code == 409 and second.json()["error"]["type"] == "conflict_error"
        assert decision["applied"] and decision["moved_slots"] > 0 and decision["planner"] == "locality"
        assert got == want
        deadline = time.monotonic() + 60
        while (stats := httpx.get(f"{base}/ep/stats").json())["replan"]["state"] != "idle":
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert httpx.post(f"{base}/ep/replan", json={"force": "yes"}).status_code == 400
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    assert len(stats["epochs"]) == 1 + 4 and stats["replan"]["moved"]["experts"] == decision["moved_slots"]
    out = tmp_path / "replay.json"
    done = subprocess.run([sys.executable, "-m", "locus.cli", "replay", str(trace), "--plan", "embedded",
                           "--assign", "recorded", "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    replayed = json.loads(out.read_text())
    assert [(e["epoch"], e["inter_node_bytes"], e["intra_node_bytes"], e["tokens"]) for e in replayed["epochs"]] == [
        (e["epoch"], e["inter_node_bytes"], e["intra_node_bytes"], e["tokens"]) for e in stats["epochs"] if e["tokens"]]


def test_a_plan_for_other_layers_is_refused_naming_the_layer(tmp_path):
    """Issue 30, finding 8: a plan whose MoE layers are not the model's said only "no expert slice for
    MoE layer 3" from one process; now every rank refuses it before loading, saying which layer."""
    from locus.routing.planners.baselines import round_robin
    from locus.routing.plan.topology import Topology

    plan = round_robin(8, (0, 1, 2), Topology(1, 2, 4), model="tiny")  # tiny's MoE layers are 0, 1, 3
    plan.save(tmp_path / "plan.json")
    with pytest.raises(RuntimeError) as info:
        with running_server("--model", "tiny", "--ep-ranks", "2", "--plan", str(tmp_path / "plan.json"), timeout=60):
            pass
    message = str(info.value)
    assert "does not fit the model" in message and "layer" in message and "no expert slice" not in message


def stream_and_leave(base: str, prompt: str, kind: str, chunks: int | None, leave_when=None) -> str:
    """One greedy stream tagged `kind` (the trace's domain): read to its end (`chunks` None), or leave
    after `chunks` chunks (0: before any token, once the response has started and `leave_when()`)."""
    body = {"prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=120) as client:  # its own connection: closing it is the disconnect
        with client.stream("POST", f"{base}/v1/completions", json=body, headers={"x-locus-domain": kind}) as r:
            assert r.status_code == 200, r.read()
            if chunks == 0:
                leave_when()
                return "left"
            seen = 0
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    return "done"
                if line.startswith("data: {"):
                    assert "error" not in line, line
                    seen += 1
                    if chunks is not None and seen >= chunks:
                        return "left"
    return "cut"


def tokens_grew(base: str, by: int, timeout: float = 60):
    """A wait until /ep/stats' tokens have grown by `by` from now."""
    start = httpx.get(f"{base}/ep/stats").json()["tokens"]

    def wait() -> None:
        deadline = time.monotonic() + timeout
        while httpx.get(f"{base}/ep/stats").json()["tokens"] < start + by:
            assert time.monotonic() < deadline, "the prefill did not start"
            time.sleep(0.005)
    return wait


def quiet_stats(base: str, timeout: float = 60) -> dict:
    """/ep/stats once no request runs or waits and the ranks' counts have stopped moving."""
    deadline, last = time.monotonic() + timeout, None
    while True:
        metrics = httpx.get(f"{base}/metrics").text
        busy = [line for line in metrics.splitlines()
                if line.startswith(("locus_num_requests_running{", "locus_num_requests_waiting{"))
                and float(line.rsplit(" ", 1)[1]) > 0]
        stats = httpx.get(f"{base}/ep/stats").json()
        if not busy and last is not None and stats["tokens"] == last["tokens"]:
            return stats
        assert time.monotonic() < deadline, "the server never went quiet"
        last = stats
        time.sleep(0.3)


def test_a_recorded_trace_keeps_aborted_requests_and_replays_to_ep_stats(tmp_path):
    """Issue 55, item 3: `--ep-ranks 2 --record-trace`, streams of which some disconnect mid-stream and
    two (long prompts, prefilled in 32-token chunks) before their first token. /ep/stats counted the
    aborted requests' routing but the trace left them out, so `locus replay --assign recorded` came out
    short of /ep/stats. Now every request the ranks routed is in the trace, an aborted one marked
    `"aborted": true` with the rows that ran (a cut prefill's: fewer than its prompt), and the replay
    equals /ep/stats to the byte."""
    from locus.traces.reader import TraceReader

    long_prompt = " ".join(f"w{i}" for i in range(600))  # 2889 byte tokens: about ninety 32-token prefill chunks
    streams = [(f"stream number {i} of the aborted mix", "cut" if i % 3 == 0 else "done", 4 if i % 3 == 0 else None)
               for i in range(12)]
    trace = tmp_path / "trace"
    with running_server("--model", "tiny", "--ep-ranks", "2", "--record-trace", str(trace),
                        "--max-num-batched-tokens", "32") as proc:
        base = proc.base_url
        for i in range(2):  # each alone, its client gone once two of its chunks have run
            assert stream_and_leave(base, f"{long_prompt} {i}", "prefill", 0, tokens_grew(base, 64)) == "left"
        with ThreadPoolExecutor(len(streams)) as pool:
            ends = list(pool.map(lambda job: stream_and_leave(base, *job), streams))
        assert ends == ["left" if chunks is not None else "done" for _, _, chunks in streams]
        stats = quiet_stats(base)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    out = tmp_path / "replay.json"
    done = subprocess.run([sys.executable, "-m", "locus.cli", "replay", str(trace), "--plan", "embedded",
                           "--assign", "recorded", "--json", str(out)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    replayed = json.loads(out.read_text())
    assert (replayed["inter_node_bytes"], replayed["intra_node_bytes"], replayed["tokens"]) == (
        stats["inter_node_bytes"], stats["intra_node_bytes"], stats["tokens"])

    records = TraceReader(trace).requests
    by_kind = {kind: [r for r in records if r.domain == kind] for kind in ("done", "cut", "prefill")}
    assert len(by_kind["done"]) == 8 and not any(r.aborted for r in by_kind["done"])
    assert all(r.tokens == r.prompt_tokens + 39 for r in by_kind["done"])
    # the streams left after 4 chunks: aborted mid-decode, their prompt and the tokens that ran kept
    assert len(by_kind["cut"]) == 4 and all(r.aborted and r.prompt_tokens < r.tokens < r.prompt_tokens + 39
                                            for r in by_kind["cut"])
    # the long prompts left before their first token: aborted mid-prefill, the chunks that ran kept
    assert len(by_kind["prefill"]) == 2 and all(r.aborted and 64 <= r.prompt_tokens == r.tokens < len(long_prompt)
                                                for r in by_kind["prefill"])
    assert all(r.rank in (0, 1) and r.admitted is not None and r.released is not None for r in records)
