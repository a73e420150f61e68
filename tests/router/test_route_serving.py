"""`locus route` in front of real engines (issue 56): four `locus serve --model mini` processes as two
nodes of two ranks, a locality plan made from a mini recording, and the router's admissions checked
against `locus replay --assign grouper` on what the backends recorded; disconnects, faults and bad
input. One set of backends serves the whole module (the fault test that kills one runs last)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import numpy as np
import pytest

from tests.router.route_fixtures import metric, mini_backends, mini_plan, planning_and_measured, router, run_locus

pytestmark = pytest.mark.slow  # real server processes


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("route")
    plan = mini_plan(root)
    with mini_backends(root, 4) as backends:
        yield root, plan, backends


def send(base: str, body: dict, headers: dict | None = None, timeout: float = 120) -> httpx.Response:
    return httpx.post(f"{base}/v1/completions", json={"model": "mini", **body}, headers=headers or {}, timeout=timeout)


def test_the_router_admits_what_the_replayed_grouper_does(cluster):
    """The assignment the router logged is, request by request, `locus replay --assign grouper` through
    the same admissions and releases on the traces the backends recorded; replayed under the log, the
    recorded ranks or the grouper, the bytes are the same; untagged requests go where the plan's
    prompt predictor puts them."""
    from locus.routing.plan.grouping_spec import spec_of
    from locus.routing.plan.placement import load_plan
    from locus.traces.reader import TraceReader
    from locus.traces.route_log import read_route_log

    root, plan_path, backends = cluster
    urls = [url for url, _, _ in backends]
    for url in urls:
        assert httpx.post(f"{url}/traces/start", json={"path": "routed"}).status_code == 200
    _, measured = planning_and_measured()
    domains = sorted(measured)
    work = []  # (request id, prompt, tag, how the tag is sent, stream, max_tokens)
    for i in range(21):
        domain = domains[i % len(domains)]
        how = ["body", "header", None][i % 3]
        work.append((f"q{i}", measured[domain][i // len(domains)], domain, how, i % 4 == 0, 2 + i % 4))

    with router(root, plan_path, urls) as (base, proc, log_path):
        assert httpx.post(f"{base}/v1/completions", json={"model": "maxi", "prompt": "x"}).status_code == 404

        def go(item):
            rid, prompt, domain, how, stream, max_tokens = item
            body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": stream}
            headers = {"X-Request-Id": rid}
            if how == "body":
                body["domain"] = domain
            elif how == "header":
                headers["X-Locus-Domain"] = domain
            r = send(base, body, headers)
            assert r.status_code == 200, r.text
            assert r.headers["x-request-id"] == rid
            if stream:
                assert r.text.rstrip().endswith("data: [DONE]")
            return r

        with ThreadPoolExecutor(4) as pool:  # arrivals and finishes interleave: that order is what is replayed
            list(pool.map(go, work))
        text = httpx.get(f"{base}/metrics").text
    traces = []
    for url, _, trace_dir in backends:
        dump = httpx.post(f"{url}/traces/dump").json()
        traces.append(trace_dir / "routed")
        assert dump["path"] == str(traces[-1])

    log = read_route_log(log_path)
    assert set(log.requests) == {w[0] for w in work}
    assert all(r.released is not None for r in log.requests.values())
    routed = metric(text, "locus_route_requests_total")
    assert sum(routed.values()) == len(work)
    for rank in range(4):  # what the router sent each backend is what the backend ran
        ran = [r.id for r in TraceReader(traces[rank]).requests]
        assert sorted(log.match(i).id for i in ran) == sorted(k for k, r in log.requests.items() if r.rank == rank)
        assert routed[f'backend="{urls[rank]}",rank="{rank}"'] == len(ran)
    assert all(log.requests[w[0]].how == "tagged" and log.requests[w[0]].domain == w[2] for w in work if w[3])

    merged = root / "merged"
    done = run_locus("trace", "merge", *map(str, traces), "-o", str(merged), "--route-log", str(log_path))
    assert done.returncode == 0, done.stderr
    records = TraceReader(merged).requests
    assert [r.admitted for r in records] == sorted(r.admitted for r in records)
    saved = root / "grouper.json"
    figures = {}
    for assign in ("grouper", str(log_path), "recorded"):
        out = root / f"replay-{len(figures)}.json"
        extra = ["--save-assignment", str(saved)] if assign == "grouper" else []
        done = run_locus("replay", str(merged), "--plan", str(plan_path), "--assign", assign, "--json", str(out), *extra)
        assert done.returncode == 0, done.stderr
        figures[assign] = json.loads(out.read_text())
    assert "arrivals as the server recorded them" in run_locus(
        "replay", str(merged), "--plan", str(plan_path), "--assign", "grouper").stderr
    assert json.loads(saved.read_text()) == {r.id: log.match(r.id).rank for r in records}
    assert {r.id: r.rank for r in records} == {r.id: log.match(r.id).rank for r in records}
    keys = ("inter_node_bytes", "intra_node_bytes", "tokens")
    assert {tuple(f[k] for k in keys) for f in figures.values()} == {tuple(figures["recorded"][k] for k in keys)}

    # untagged requests: placed by the plan's predictor on the prompt ids the backend ran
    plan = load_plan(plan_path)
    spec = spec_of(plan)
    reader = TraceReader(merged)
    placed = 0
    for j, record in enumerate(reader.requests):
        logged = log.match(record.id)
        if record.domain:
            assert logged.how == "tagged" and logged.domain == record.domain
            continue
        lo = int(reader.offsets[j])
        prompt = np.asarray(reader.token_ids[lo:lo + record.prompt_tokens])
        assert logged.prompt_tokens == record.prompt_tokens
        assert logged.how == "predicted"
        assert logged.domain == spec.predictor.classify(prompt)
        placed += logged.domain is not None
    assert placed >= 2
    predicted = metric(text, "locus_route_admissions_total")
    assert sum(v for k, v in predicted.items() if 'how="predicted"' in k) == sum(w[3] is None for w in work)


def test_a_client_that_disconnects_frees_its_backend_request(cluster):
    """The client goes after the first chunk: the router closes the backend request, which the engine
    aborts (its finish reason `abort`), long before the 2000 tokens it asked for."""
    root, plan_path, backends = cluster
    urls = [url for url, _, _ in backends]

    def finished(reason: str) -> float:
        return sum(metric(httpx.get(f"{u}/metrics").text, "locus_request_success_total").get(
            f'finished_reason="{reason}",model_name="mini"', 0.0) for u in urls)

    def running() -> float:
        return sum(sum(metric(httpx.get(f"{u}/metrics").text, "locus_num_requests_running").values()) for u in urls)

    with router(root, plan_path, urls, name="router-disconnect") as (base, _, log_path):
        aborted, lengths = finished("abort"), finished("length")
        body = {"model": "mini", "prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=60) as client:
            with client.stream("POST", f"{base}/v1/completions", json=body, headers={"X-Request-Id": "gone"}) as r:
                assert r.status_code == 200
                assert b'"choices"' in next(r.iter_raw())  # the first token: it runs on its backend
        deadline = time.monotonic() + 30
        while finished("abort") == aborted and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (finished("abort"), finished("length")) == (aborted + 1, lengths)
        assert running() == 0
        assert sum(metric(httpx.get(f"{base}/metrics").text, "locus_route_in_flight").values()) == 0
        events = [json.loads(line) for line in log_path.read_text().splitlines()[1:]]
        assert [e["event"] for e in events if e["id"] == "gone"] == ["admit", "release"]


def test_bad_input_is_one_line_or_a_4xx(cluster):
    root, plan_path, backends = cluster
    urls = [url for url, _, _ in backends]
    three = run_locus("route", "--plan", str(plan_path), "--port", "0", *sum((["--backend", u] for u in urls[:3]), []))
    assert three.returncode == 2
    assert three.stderr.strip().splitlines() == [
        "locus: error: the plan's topology has 4 data-parallel ranks but 3 backend(s) were given (one per rank for "
        "--backend-kind locus)"]
    dead = urls[:3] + ["http://127.0.0.1:9"]
    unreachable = run_locus("route", "--plan", str(plan_path), "--port", "0", *sum((["--backend", u] for u in dead), []))
    assert unreachable.returncode == 2
    lines = unreachable.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("locus: error: backend http://127.0.0.1:9 (rank 3) is unreachable")
    eplb = root / "eplb.json"
    assert run_locus("plan", str(root / "planning"), "--topology", "2x2", "--planner", "eplb", "-o", str(eplb)).returncode == 0
    nogroup = run_locus("route", "--plan", str(eplb), "--port", "0", *sum((["--backend", u] for u in urls), []))
    assert nogroup.returncode == 2 and "has no grouping" in nogroup.stderr and len(nogroup.stderr.splitlines()) == 1
    with router(root, plan_path, urls, name="router-bad") as (base, _, _):
        assert send(base, {"model": "maxi", "prompt": "x"}).json()["error"]["param"] == "model"
        assert httpx.post(f"{base}/v1/completions", content=b"{nope").status_code == 400
        bad = send(base, {"prompt": {"not": "a prompt"}})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"
        assert send(base, {"prompt": "x", "temperature": -1}).status_code == 400  # the backend's own 400, passed on
        wrong = httpx.get(f"{base}/v1/chat/completions")
        assert wrong.status_code == 405 and wrong.headers["allow"] == "POST" and "takes POST" in wrong.json()["error"]["message"]


def test_sigterm_ends_open_streams_with_an_error_frame_after_the_grace(cluster):
    root, plan_path, backends = cluster
    urls = [url for url, _, _ in backends]
    with router(root, plan_path, urls, "--graceful-timeout", "1", name="router-stop") as (base, proc, _):
        body = {"model": "mini", "prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True, "stream": True}
        got = b""
        with httpx.Client(timeout=60) as client:
            with client.stream("POST", f"{base}/v1/completions", json=body) as r:
                chunks = r.iter_raw()
                got += next(chunks)
                proc.send_signal(signal.SIGTERM)
                for chunk in chunks:
                    got += chunk
        assert proc.wait(30) == 0
    last = [e for e in got.decode().split("\n\n") if e.strip()][-1]
    assert json.loads(last[6:])["error"]["message"] == "the router is shutting down"


class FailingBackend(BaseHTTPRequestHandler):
    """Answers /health and /v1/models like mini's server, and every generation with a 500."""

    def do_GET(self):
        body = b'{"status":"ok"}' if self.path == "/health" else json.dumps(
            {"object": "list", "data": [{"id": "mini", "object": "model", "max_model_len": 2048}]}).encode()
        self.reply(200, body)

    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self.reply(500, b'{"error": {"message": "boom", "type": "server_error", "param": null, "code": 500}}')

    def reply(self, status: int, body: bytes):
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass



def error_frame(frame: str) -> bool:
    """Whether an SSE event is an error frame, not a chunk whose sampled text happens to hold the word
    (the last event read may be cut short, so no JSON parse)."""
    return frame.startswith('data: {"error": ')  # the router's frame (locus/router/errors.py); a chunk is an object too


def one_node_domains(plan_path: Path) -> tuple[str, str]:
    """A domain the plan places on node 0 only and one on node 1 only: two requests of each fill the
    2x2 cluster one stream a rank (the grouper's node, then the rank of it with the fewest tokens admitted)."""
    nodes = json.loads(plan_path.read_text())["grouping"]["domain_nodes"]
    only = [[d for d, share in nodes.items() if share[n] > 0 and share[1 - n] == 0] for n in (0, 1)]
    assert only[0] and only[1], nodes
    return only[0][0], only[1][0]


def test_a_request_failing_before_its_first_byte_is_retried_once_elsewhere(cluster):
    root, plan_path, backends = cluster
    stub = ThreadingHTTPServer(("127.0.0.1", 0), FailingBackend)
    threading.Thread(target=stub.serve_forever, daemon=True).start()
    try:
        urls = [url for url, _, _ in backends][:3] + [f"http://127.0.0.1:{stub.server_address[1]}"]
        with router(root, plan_path, urls, name="router-retry") as (base, _, log_path):
            body = {"prompt": "Once upon a time", "max_tokens": 40, "ignore_eos": True, "stream": True}
            tags = one_node_domains(plan_path)
            with ThreadPoolExecutor(4) as pool:  # four in flight, two a node: one on every rank
                answers = list(pool.map(lambda i: send(base, {**body, "domain": tags[i // 2]},
                                                       {"X-Request-Id": f"r{i}"}), range(4)))
            assert [a.status_code for a in answers] == [200] * 4
            assert all(a.text.rstrip().endswith("data: [DONE]") for a in answers)
            text = httpx.get(f"{base}/metrics").text
            rank3 = f'backend="{urls[3]}",rank="3"'
            retried = metric(text, "locus_route_retries_total")[rank3]
            assert retried >= 1 and metric(text, "locus_route_failures_total")[rank3 + ',stage="status"'] == retried
            events = [json.loads(line) for line in log_path.read_text().splitlines()[1:]]
            finals = {}
            for e in events:
                if e["event"] == "admit":
                    finals[e["id"]] = e["rank"]
            assert 3 not in finals.values()  # every retried request ran on a real backend
            assert httpx.get(f"{base}/health").json()["status"] == "ok"  # a 500 is no reason to take it out
    finally:
        stub.shutdown()


def test_a_killed_backend_ends_its_streams_with_an_error_frame_and_takes_nothing_new(cluster):
    """Runs last: it kills one of the module's backends (SIGKILL, mid-stream)."""
    root, plan_path, backends = cluster
    urls = [url for url, _, _ in backends]
    with router(root, plan_path, urls, "--health-interval", "0.3", name="router-kill") as (base, _, log_path):
        body = {"model": "mini", "prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True, "stream": True}
        frames: dict[str, list[str]] = {}
        started, killed_event = threading.Barrier(5), threading.Event()

        tags = one_node_domains(plan_path)

        def stream(rid: str) -> None:
            """Read until an error frame, or a few events after the kill; then leave."""
            got, after = b"", 0
            tagged = {**body, "domain": tags[int(rid[1:]) // 2]}
            with httpx.Client(timeout=120) as client:
                with client.stream("POST", f"{base}/v1/completions", json=tagged, headers={"X-Request-Id": rid}) as r:
                    chunks = r.iter_raw()
                    got += next(chunks)
                    started.wait(60)
                    for chunk in chunks:
                        got += chunk
                        after += killed_event.is_set()
                        if b'"error"' in chunk or after > 20:
                            break
            frames[rid] = [e for e in got.decode().split("\n\n") if e.strip()]

        threads = [threading.Thread(target=stream, args=(f"s{i}",)) for i in range(4)]
        for t in threads:
            t.start()
        started.wait(60)  # four streams in flight, two a node: one on every rank
        events = [json.loads(line) for line in log_path.read_text().splitlines()[1:]]
        on = {e["rank"]: e["id"] for e in events if e["event"] == "admit"}
        assert sorted(on) == [0, 1, 2, 3]
        killed = backends[3][1]
        os.killpg(killed.pid, signal.SIGKILL)
        killed.wait()
        killed_event.set()
        for t in threads:
            t.join(120)
        last = frames[on[3]][-1]
        assert last.startswith("data: ") and "failed mid-stream" in json.loads(last[6:])["error"]["message"]
        assert not any(error_frame(frame) for r in range(3) for frame in frames[on[r]])

        deadline = time.monotonic() + 10
        while (health := httpx.get(f"{base}/health").json())["status"] == "ok" and time.monotonic() < deadline:
            time.sleep(0.1)
        assert health["status"] == "degraded" and urls[3] in health["detail"]
        assert [b["status"] for b in health["backends"]] == ["up", "up", "up", "out"]
        for i in range(6):  # new requests go to the others
            r = send(base, {"prompt": "Es war einmal", "max_tokens": 2}, {"X-Request-Id": f"after{i}"})
            assert r.status_code == 200, r.text
        events = [json.loads(line) for line in log_path.read_text().splitlines()[1:]]
        assert all(e["rank"] != 3 for e in events if e["event"] == "admit" and e["id"].startswith("after"))
        text = httpx.get(f"{base}/metrics").text
        assert metric(text, "locus_route_failures_total")[f'backend="{urls[3]}",rank="3",stage="stream"'] == 1
        assert metric(text, "locus_route_backend_up")[f'backend="{urls[3]}",ranks="3"'] == 0
