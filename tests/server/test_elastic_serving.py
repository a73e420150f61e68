"""--ep-elastic with real processes: SIGKILL of a rank mid-stream, then of a second one; the survivors
regroup, re-plan onto themselves, resume the lost ranks' requests from what they streamed, and every
stream completes with the single-process engine's greedy tokens. SIGTERM then drains and exits 0 with
no process left. Without --ep-elastic, a lost rank still ends the server (test_expert_parallel_serving)."""

from __future__ import annotations

import functools
import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from locus.engine.frontend.llm import LLM
from locus.engine.sampling.sampler import SamplingParams
from tests.engine.ep.counter_checks import assert_never_backwards, closed_epochs, metrics_counters, stats_counters
from tests.server.server_process import running_server
from tests.server.test_expert_parallel_serving import alive, children_of

pytestmark = pytest.mark.slow  # a server of 4 rank processes, two of them killed

PROMPTS = [f"stream number {i} says" for i in range(8)]
TOKENS = 120


def rank_of(pid: int) -> int:
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return int(next(v for v in environ if v.startswith(b"RANK=")).split(b"=", 1)[1])


def wait_for_recoveries(base: str, count: int, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = httpx.get(f"{base}/ep/stats", timeout=10).json()
        if len(stats["recoveries"]) >= count:
            return stats
        assert time.monotonic() < deadline, "the survivors did not regroup"
        time.sleep(0.1)


def every_counter(base: str) -> tuple[dict, dict[str, float]]:
    """/ep/stats, and every counter it and /metrics show."""
    stats = httpx.get(f"{base}/ep/stats", timeout=10).json()
    metrics = httpx.get(f"{base}/metrics", timeout=10).text
    return stats, {**stats_counters(stats), **metrics_counters(metrics)}


def reported_since(base: str, stats: dict, timeout: float = 60) -> dict:
    """/ep/stats once every rank of `stats` has reported a step run after it (after a regroup: every
    survivor's counts of the epoch the regroup ended have reached rank 0)."""
    steps = {r["identity"]: r["steps"] for r in stats["per_rank"]}
    return wait_for(lambda: (now := httpx.get(f"{base}/ep/stats", timeout=10).json())
                    and all(r["steps"] > steps[r["identity"]] for r in now["per_rank"]) and now,
                    timeout, "a survivor never reported a step after the regroup")


def streams_through_a_kill(base: str, pid: int, recovery_timeout: float = 60) -> tuple[list, dict, float]:
    """Stream every prompt, SIGKILL `pid` once all have started, wait for the first recovery:
    the streams' results, /ep/stats after it, and the seconds from the kill to the recovery."""
    started = [threading.Event() for _ in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        streams = [pool.submit(sse_stream, base, p, TOKENS, started[i]) for i, p in enumerate(PROMPTS)]
        assert all(event.wait(60) for event in started), "a stream did not start"
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        stats = wait_for_recoveries(base, 1, timeout=recovery_timeout)
        regrouped = time.monotonic() - killed
        return [s.result() for s in streams], stats, regrouped


def test_two_lost_ranks_lose_no_stream_and_no_token():
    """Two SIGKILLs mid-stream: every stream's tokens kept, and no counter of /ep/stats or /metrics runs
    backwards (issue 55, item 2)."""
    want = greedy_texts(PROMPTS, TOKENS)
    with running_server("--model", "tiny", "--ep-ranks", "4", "--gpus-per-node", "2", "--ep-elastic",
                        "--ep-timeout", "20") as proc:
        base = proc.base_url
        ranks = {rank_of(pid): pid for pid in children_of(proc.pid)}
        assert sorted(ranks) == [1, 2, 3]
        gaps: dict[int, float] = {}
        decoding = [threading.Event() for _ in PROMPTS]

        def stream(i: int) -> str:
            body = {"prompt": PROMPTS[i], "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True, "stream": True}
            text, last, worst = "", time.monotonic(), 0.0
            with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    assert "error" not in chunk, chunk
                    now = time.monotonic()
                    worst, last = max(worst, now - last), now
                    decoding[i].set()
                    text += "".join(c["text"] for c in chunk["choices"])
            gaps[i] = worst
            return text

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            streams = [pool.submit(stream, i) for i in range(len(PROMPTS))]
            for event in decoding:  # every stream is decoding, on every rank (balanced assignment)
                assert event.wait(60), "a stream did not start"
            _, before_first = every_counter(base)
            os.kill(ranks[2], signal.SIGKILL)
            first = wait_for_recoveries(base, 1)
            assert httpx.get(f"{base}/health").status_code == 200
            regrouped = time.monotonic()
            reported_since(base, first)  # every survivor's counts of epoch 0 have reached rank 0: it is closed
            time.sleep(max(0.0, 0.5 - (time.monotonic() - regrouped)))
            between, before_second = every_counter(base)
            os.kill(ranks[3], signal.SIGKILL)
            second = wait_for_recoveries(base, 2)
            got = [s.result() for s in streams]
        assert got == want
        # issue 55, item 2: no counter of /ep/stats or /metrics ran backwards through either regroup (rank 0's
        # own and the survivors' counts used to restart at zero, and the lost ranks' to leave the totals),
        # and an epoch's figure is what it was once the epoch ended
        final, at_end = every_counter(base)
        assert_never_backwards(before_first, before_second, slack=1e-6)
        assert_never_backwards(before_second, at_end, slack=1e-6)
        assert closed_epochs(between) == {0: closed_epochs(final)[0]} and sorted(closed_epochs(final)) == [0, 1]
        assert [r["identity"] for r in final["per_rank"]] == [0, 1]
        assert [r["identity"] for r in final["retired"]["per_rank"]] == [2, 3]
        assert at_end["locus_ep_rank_tokens_total{model_name=tiny,rank=3}"] > 0  # labelled as started, kept
        for tier in ("inter_node", "intra_node"):
            assert sum(v for k, v in at_end.items() if k.startswith("locus_ep_bytes_total{") and f"tier={tier}" in k) \
                == final[f"{tier}_bytes"] > 0
        assert first["recoveries"][0]["lost_ranks"] == [2] and first["recoveries"][0]["readmitted"] >= 1
        assert second["ranks"] == 2 and second["recoveries"][1]["survivors"] == 2
        assert second["topology"]["nodes"] * second["topology"]["gpus_per_node"] == 2
        assert max(gaps.values()) < 10, gaps  # the stall a client saw, kill to first token after
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    assert not any(alive(pid) for pid in ranks.values())
    assert children_of(proc.pid) == []


def test_elastic_without_room_for_the_survivors_is_refused_at_start():
    """Issue 27, acceptance 4: refused clearly, before serving, not at the first loss."""
    with pytest.raises(RuntimeError) as info:
        with running_server("--model", "tiny", "--ep-ranks", "4", "--gpus-per-node", "2", "--ep-elastic",
                            "--ep-max-slots", "2", timeout=60):
            pass
    assert "--ep-max-slots 2" in str(info.value) and "need 3 expert slots" in str(info.value)


# --- issue 41: the elastic invariant, losses inside a regroup, the rendezvous's exposure ------------------
def listening_addresses(pids: list[int]) -> set[str]:
    """The local addresses of every listening TCP socket the processes `pids` hold."""
    import ipaddress
    import socket

    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                link = os.readlink(fd)
            except OSError:
                continue
            if link.startswith("socket:["):
                inodes.add(link[8:-1])
    found = set()
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                continue
            raw = bytes.fromhex(fields[1].split(":")[0])
            packed = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # each 32-bit word is host order
            address = ipaddress.ip_address(socket.inet_ntop(family, packed))
            found.add(str(address.ipv4_mapped or address) if family == socket.AF_INET6 else str(address))
    return found


def sse_stream(base: str, prompt: str, tokens: int, started: threading.Event | None = None,
               domain: str | None = None) -> dict:
    """One greedy stream: its text, how it ended (`done`, `error` or `cut`), and when."""
    body = {"prompt": prompt, "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": True}
    headers = {"x-locus-domain": domain} if domain else {}
    text, end, chunks = "", "cut", 0
    try:
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120, headers=headers) as r:
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    end = "done"
                elif line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        end = "error"
                        continue
                    text += "".join(c["text"] for c in chunk["choices"])
                    chunks += 1
                    if started is not None and chunks >= 4:
                        started.set()
    except httpx.HTTPError:
        pass
    return {"text": text, "end": end, "at": time.monotonic()}


def greedy_texts(prompts: list[str], tokens: list[int] | int) -> list[str]:
    """The single-process engine's greedy text of each prompt (`tokens` each, or one count per prompt);
    several tests want the same texts, so each set is generated once."""
    counts = tokens if isinstance(tokens, list) else [tokens] * len(prompts)
    return list(_greedy_texts(tuple(prompts), tuple(counts)))


@functools.cache
def _greedy_texts(prompts: tuple[str, ...], counts: tuple[int, ...]) -> tuple[str, ...]:
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in counts]
    return tuple(o.outputs[0].text for o in LLM("tiny").generate(list(prompts), params))


def kill_all(pids) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, what
        time.sleep(0.02)



@pytest.mark.slow
def test_a_rank_lost_while_a_replan_is_planned_discards_it_and_a_disagreement_fails_requests(tmp_path, monkeypatch):
    """Issue 41, finding 1: `--ep-elastic --replan-api`, 2x2 with a locality plan (replicas), a forced
    re-plan, and rank 2 SIGKILLed while the re-plan is `planning` (the planner is slowed by the fault
    wrapper so that the kill lands there every time). The decision, made for four ranks, used to be
    applied to the three survivors: a shape error, taken for a second loss, and wrong text from then on
    with /health ok. Now it is discarded (the POST gets 409), every stream is the single-process text,
    and /health says `degraded`. Then rank 1 is SIGKILLed and rank 3 refills a slot with the wrong
    expert's weights (injected): the ranks disagree, so every open stream ends with an error frame
    (after correct text only), and the server exits non-zero. No re-plan directory is left behind."""
    from tests.server.test_expert_parallel_serving import domain_prompt, locality_plan

    plan_path = locality_plan(tmp_path, slots=3, families=("code",), requests=12, model_name="tiny")
    jobs = [("math" if i % 2 else "chat", domain_prompt("math" if i % 2 else "chat", 300 + i)) for i in range(8)]
    later = [domain_prompt("chat", 400 + i) for i in range(4)]
    texts = greedy_texts([p for _, p in jobs] + later, [96] * len(jobs) + [240] * len(later))
    want, want_later = texts[:len(jobs)], texts[len(jobs):]
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    monkeypatch.setenv("LOCUS_TEST_FAULTS", "slow-plan=3,bad-refill=3@2")
    pids = []
    with running_server("--model", "tiny", "--ep-ranks", "4", "--gpus-per-node", "2", "--plan", str(plan_path),
                        "--ep-elastic", "--replan-api", "--replan-window", "256", "--ep-timeout", "20",
                        module="tests.server.elastic_faults") as proc:
        base = proc.base_url
        ranks = {rank_of(pid): pid for pid in children_of(proc.pid)}
        pids = list(ranks.values())
        try:
            started = [threading.Event() for _ in jobs]
            with ThreadPoolExecutor(len(jobs) + 1) as pool:
                streams = [pool.submit(sse_stream, base, p, 96, started[i], d) for i, (d, p) in enumerate(jobs)]
                assert all(event.wait(120) for event in started), "a stream did not start"
                replan = pool.submit(httpx.post, f"{base}/ep/replan", json={"force": True}, timeout=120)
                wait_for(lambda: httpx.get(f"{base}/ep/stats").json()["replan"]["state"] == "planning", 60,
                         "the re-plan never reached `planning`")
                os.kill(ranks[2], signal.SIGKILL)
                got = [s.result() for s in streams]
                answer = replan.result()
            assert [g["text"] for g in got] == want and {g["end"] for g in got} == {"done"}
            assert answer.status_code == 409 and "nothing moved" in answer.json()["error"]["message"]
            stats = httpx.get(f"{base}/ep/stats").json()
            assert [r["lost_ranks"] for r in stats["recoveries"]] == [[2]]  # no second regroup with lost_ranks []
            assert stats["replan"]["decisions"] == [] and stats["replan"]["state"] == "idle" and stats["epoch"] == 1
            health = httpx.get(f"{base}/health")
            assert health.status_code == 200 and health.json()["status"] == "degraded", health.text
            assert "[2]" in health.json()["detail"]

            started = [threading.Event() for _ in later]
            with ThreadPoolExecutor(len(later)) as pool:
                streams = [pool.submit(sse_stream, base, p, 240, started[i]) for i, p in enumerate(later)]
                assert all(event.wait(120) for event in started), "a stream did not start"
                os.kill(ranks[1], signal.SIGKILL)
                got = [s.result() for s in streams]
            code = proc.wait(60)
            log = proc.stdout.read()
        finally:
            kill_all(pids)
    assert {g["end"] for g in got} == {"error"}, got
    assert all(w.startswith(g["text"]) for g, w in zip(got, want_later))  # never a wrong token before the error
    assert code != 0 and "disagree on the expert placement" in log
    assert not any(alive(pid) for pid in pids) and children_of(proc.pid) == []
    assert list(scratch.glob("locus-replan-*")) == []


@pytest.mark.slow
def test_a_second_loss_inside_the_regroup_restarts_it_and_sigterm_during_a_regroup_ends_every_stream(monkeypatch):
    """Issue 41, findings 3 and 4, and the rendezvous's exposure. Rank 2 is SIGKILLed; rank 3 dies
    (injected) once the survivors are decided, before it joins them: the regroup used to wait in
    init_process_group for the whole --ep-timeout, then fail every stream. Now it restarts without
    rank 3 and every stream is the single-process text. Then rank 1 is SIGSTOPped: past --ep-timeout
    the survivors regroup, waiting for it, and /health says `recovering` (503); SIGTERM then ends every
    open stream with an error frame within --graceful-timeout (the engine thread is inside the regroup).
    Every listening socket of every rank is on 127.0.0.1 (the rendezvous store used to listen on all
    interfaces)."""
    want = greedy_texts(PROMPTS, TOKENS)
    monkeypatch.setenv("LOCUS_TEST_FAULTS", "die-joining=3@1")
    pids = []
    with running_server("--model", "tiny", "--ep-ranks", "4", "--gpus-per-node", "2", "--ep-elastic",
                        "--ep-timeout", "8", "--graceful-timeout", "4", module="tests.server.elastic_faults") as proc:
        base = proc.base_url
        ranks = {rank_of(pid): pid for pid in children_of(proc.pid)}
        pids = list(ranks.values())
        try:
            assert listening_addresses([proc.pid, *pids]) == {"127.0.0.1"}
            got, stats, regrouped = streams_through_a_kill(base, ranks[2])
            assert [g["text"] for g in got] == want and {g["end"] for g in got} == {"done"}
            assert [r["lost_ranks"] for r in stats["recoveries"]] == [[2, 3]] and stats["ranks"] == 2
            assert regrouped < 8, f"the regroup took {regrouped:.1f} s (--ep-timeout 8)"
            assert not alive(ranks[3])

            started = [threading.Event() for _ in PROMPTS[:4]]
            with ThreadPoolExecutor(4) as pool:
                streams = [pool.submit(sse_stream, base, p, 3000, started[i]) for i, p in enumerate(PROMPTS[:4])]
                assert all(event.wait(60) for event in started), "a stream did not start"
                os.kill(ranks[1], signal.SIGSTOP)
                health = wait_for(lambda: (h := httpx.get(f"{base}/health", timeout=5)).json()["status"] == "recovering"
                                  and h, 60, "/health never said `recovering`")
                assert health.status_code == 503 and "Retry-After" in health.headers
                proc.send_signal(signal.SIGTERM)
                terminated = time.monotonic()
                got = [s.result() for s in streams]
            assert {g["end"] for g in got} == {"error"}, got  # 3000 tokens each: none can finish, none is cut
            assert max(g["at"] for g in got) - terminated < 4 + 1, "a stream outlived --graceful-timeout"
            assert all(g["text"][:len(w)] == w[:len(g["text"])] for g, w in zip(got, want))  # no wrong token
            proc.wait(60)
        finally:
            kill_all(pids)
    assert not any(alive(pid) for pid in pids) and children_of(proc.pid) == []


@pytest.mark.slow
def test_a_loss_inside_torchs_rendezvous_of_the_regroup_restarts_it(monkeypatch):
    """Issue 41, finding 3, the later half of the window: rank 2 is SIGKILLed, and rank 3 dies (injected)
    at the call that joins the survivors' new process group, after every member said it was ready, so
    rank 0 cannot call the generation off from the ready barrier. The survivors used to wait in
    init_process_group for the whole --ep-timeout (40 s here), then fail every stream. Now torch's
    rendezvous runs under the join timeout (elastic.JOIN_TIMEOUT_S), the attempt fails as a lost peer
    and restarts without rank 3: every stream is the single-process text, one recovery lists both."""
    want = greedy_texts(PROMPTS, TOKENS)
    monkeypatch.setenv("LOCUS_TEST_FAULTS", "die-in-join=3@1")
    pids = []
    with running_server("--model", "tiny", "--ep-ranks", "4", "--gpus-per-node", "2", "--ep-elastic",
                        "--ep-timeout", "40", module="tests.server.elastic_faults") as proc:
        base = proc.base_url
        ranks = {rank_of(pid): pid for pid in children_of(proc.pid)}
        pids = list(ranks.values())
        try:
            got, stats, regrouped = streams_through_a_kill(base, ranks[2], recovery_timeout=90)
            assert [g["text"] for g in got] == want and {g["end"] for g in got} == {"done"}
            assert [r["lost_ranks"] for r in stats["recoveries"]] == [[2, 3]] and stats["ranks"] == 2
            from locus.engine.ep.ranks.elastic import JOIN_TIMEOUT_S

            assert regrouped < JOIN_TIMEOUT_S + 15, f"the regroup took {regrouped:.1f} s (--ep-timeout 40)"
            assert not alive(ranks[3])
            health = httpx.get(f"{base}/health")
            assert health.status_code == 200 and health.json()["status"] == "degraded", health.text
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == 0
        finally:
            kill_all(pids)
    assert not any(alive(pid) for pid in pids) and children_of(proc.pid) == []


# --- issue 46: a rank lost in the middle of moving a request after its prefill (--ep-moves) ----------------
@pytest.fixture(scope="module")
def moving_plan(tmp_path_factory):
    """A 2x2 locality plan for `tiny` whose grouper moves a request whenever that saves any byte (margin
    0) and a rank has room for it (attention cap 4: only the stream cap bounds a move), and two of its
    domains: one the plan puts on node 0 only, one on node 1 only (which ones is the planner's domain
    layout's choice)."""
    from tests.server.test_expert_parallel_serving import locality_plan

    path = locality_plan(tmp_path_factory.mktemp("moving-plan"), slots=3, requests=24, model_name="tiny")
    plan = json.loads(path.read_text())
    plan["grouping"]["move_margin"] = 0.0
    plan["grouping"]["caps"]["attention"] = 4.0
    nodes = plan["grouping"]["domain_nodes"]
    only = [[d for d, share in nodes.items() if share[n] > 0 and share[1 - n] == 0] for n in (0, 1)]
    assert only[0] and only[1], nodes
    path.write_text(json.dumps(plan))
    return path, only[0][0], only[1][0]


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["die-moving-out", "die-moving-in", "die-moving-in-from-0", "die-after-move"])
def test_a_rank_lost_mid_move_loses_no_stream_and_no_token(fault, moving_plan, tmp_path, monkeypatch):
    """Issue 46, acceptance 3: `--ep-elastic --ep-moves`, rounds of 12 greedy streams, 3 at a time, of
    prompts of a domain on node 0 and one on node 1, each tagged with the other: admitted to the wrong node by its tag,
    each moves to the other once its prefill has run (sources and targets on both nodes; for a move out
    of rank 0, node 1's domain only). A round is sent again (at most 3) until the move the fault waits
    for has happened. In the first
    move between two ranks other than 0, the source (`die-moving-out`) or the target (`die-moving-in`)
    is SIGKILLed (injected) once the move's header and sampler state have crossed, before its KV rows;
    or the target of the first move out of rank 0 (`die-moving-in-from-0`); or, once a move between two
    ranks other than 0 has reached its target, a third rank, in the step of that iteration
    (`die-after-move`). The survivors regroup, and the moved request is resumed (source lost: on the
    target, from what rank 0 streamed; target lost: on a survivor; both alive: the move is sent again),
    not lost: every stream ends `done` with the single-process engine's text, no token missing or
    repeated. With the target lost, the old code streamed tokens twice: those of the
    source's report made before the regroup (`die-moving-in`), or, from rank 0, those rank 0 had
    streamed itself, which the resumed request did not count as streamed (`die-moving-in-from-0`). With
    both ends alive, the source had forgotten what it sent before the move was sent again, and the
    request failed (`die-after-move`)."""
    from tests.server.test_expert_parallel_serving import domain_prompt

    # (the prompt's domain, its tag). Which rank of a node admits a request, and whether the other node
    # has room when its prefill is observed, depend on when the three concurrent streams arrive; for a
    # move out of rank 0, every request is admitted to node 0 (rank 0 first) and belongs on node 1.
    moving_plan, on0, on1 = moving_plan  # a domain on node 0 only, one on node 1 only
    domains = [(on1, on0)] * 12 if fault.endswith("-0") else [(on0, on1), (on1, on0)] * 6
    prompts = [domain_prompt(family, 500 + i) for i, (family, _) in enumerate(domains)]
    tokens = [12 + 4 * (i % 3) for i in range(len(prompts))]
    want = greedy_texts(prompts, tokens)
    died = tmp_path / "died"
    monkeypatch.setenv("LOCUS_TEST_FAULTS", f"{fault}={died}")
    pids = []
    with running_server("--model", "tiny", "--ep-ranks", "4", "--gpus-per-node", "2", "--plan", str(moving_plan),
                        "--ep-moves", "--ep-elastic", "--ep-timeout", "20", module="tests.server.elastic_faults",
                        timeout=300) as proc:
        base = proc.base_url
        ranks = {rank_of(pid): pid for pid in children_of(proc.pid)}
        pids = list(ranks.values())
        try:
            for _ in range(3):  # bounded: a round whose timing made no such move is sent again
                with ThreadPoolExecutor(3) as pool:
                    got = list(pool.map(sse_stream, [base] * len(prompts), prompts, tokens, [None] * len(prompts),
                                        [tag for _, tag in domains]))
                assert [g["text"] for g in got] == want and {g["end"] for g in got} == {"done"}, got
                if died.exists():
                    break
            assert died.exists(), f"{fault}: no such move happened in 3 rounds of {len(prompts)} streams"
            identity, *ends = (int(x) for x in died.read_text().split())  # the dead rank, the move's survivors
            stats = httpx.get(f"{base}/ep/stats").json()
            assert [r["lost_ranks"] for r in stats["recoveries"]] == [[identity]] and stats["ranks"] == 3
            assert not alive(ranks[identity]) and identity not in ends
            assert all(end == 0 or alive(ranks[end]) for end in ends)
            assert fault == "die-after-move" or (ends[0] == 0) == fault.endswith("-0")
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) == 0
        finally:
            kill_all(pids)
    assert not any(alive(pid) for pid in pids) and children_of(proc.pid) == []
