"""The replay's grouper is the live server's: an expert-parallel server admits tagged, untagged and
wrongly tagged requests arriving concurrently, records the trace, and `locus replay --assign grouper`
on that trace (the grouper simulated through the admissions and releases the server logged) assigns
every request to the rank the server chose, so the replayed bytes are the measured ones. A wrong tag
changes where a request runs, never what it generates."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from locus.engine.frontend.llm import LLM
from locus.engine.sampling.sampler import SamplingParams
from locus.traces.prompt_families import FAMILIES
from tests.server.server_process import running_server
from tests.server.test_expert_parallel_serving import domain_prompt, locality_plan


@pytest.mark.slow
def test_the_replayed_grouper_assigns_what_the_live_server_did(tmp_path):
    from locus.routing.plan.grouping_spec import spec_of
    from locus.routing.plan.placement import load_plan
    from locus.traces.reader import TraceReader

    plan_path = locality_plan(tmp_path, slots=6, requests=30)
    assert spec_of(load_plan(plan_path)).predictor is not None  # learned from the planning trace's token ids

    families = list(FAMILIES)
    swapped = {d: families[(i + 1) % len(families)] for i, d in enumerate(families)}
    # (prompt, header tag or None, max_tokens): tagged, untagged, and tagged with another family's name
    work = []
    for i in range(18):
        domain = families[i % len(families)]
        tag = [domain, None, swapped[domain]][i % 3]
        work.append((domain_prompt(domain, 300 + i), tag, 3 + i % 5))
    greedy = {i for i, (_, tag, _) in enumerate(work) if tag is not None and tag != families[i % len(families)]}
    want = {i: out.outputs[0].text for i, out in zip(sorted(greedy), LLM("small").generate(
        [work[i][0] for i in sorted(greedy)], [SamplingParams(temperature=0, max_tokens=work[i][2], ignore_eos=True)
                                               for i in sorted(greedy)]))}

    trace = tmp_path / "trace"
    with running_server("--model", "small", "--ep-ranks", "4", "--gpus-per-node", "2", "--plan", str(plan_path),
                        "--record-trace", str(trace), "--ep-timeout", "120", timeout=300) as proc:
        def send(i: int) -> str:
            prompt, tag, max_tokens = work[i]
            body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0 if i in greedy else 0.8, "seed": i,
                    "ignore_eos": True}
            headers = {"x-locus-domain": tag} if tag else {}
            r = httpx.post(f"{proc.base_url}/v1/completions", json=body, headers=headers, timeout=300)
            r.raise_for_status()
            return r.json()["choices"][0]["text"]

        with ThreadPoolExecutor(5) as pool:  # arrivals and finishes interleave: the order is what is replayed
            got = list(pool.map(send, range(len(work))))
        stats = httpx.get(f"{proc.base_url}/ep/stats").json()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    assert {i: got[i] for i in greedy} == want  # a wrong tag moves a request, its tokens stay the same
    assert stats["assignment"] == "grouper"

    records = TraceReader(trace).requests
    assert len(records) == len(work) and all(r.admitted is not None and r.released is not None for r in records)
    assert [r.admitted for r in records] == sorted(r.admitted for r in records)  # merged in admission order
    out, saved = tmp_path / "replay.json", tmp_path / "assignment.json"
    done = subprocess.run([sys.executable, "-m", "locus.cli", "replay", str(trace), "--plan", str(plan_path),
                           "--assign", "grouper", "--save-assignment", str(saved), "--json", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "arrivals as the server recorded them" in done.stderr and "untagged, placed by the plan's prompt predictor" in done.stderr
    assert json.loads(saved.read_text()) == {r.id: r.rank for r in records}
    replayed = json.loads(out.read_text())
    assert (replayed["inter_node_bytes"], replayed["intra_node_bytes"], replayed["tokens"]) == (
        stats["inter_node_bytes"], stats["intra_node_bytes"], stats["tokens"])
