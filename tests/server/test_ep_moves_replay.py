"""--ep-moves live: an expert-parallel server whose plan's grouper moves requests after their prefill
(the plan's move_margin set to 0: every move that saves any decode byte, so that moves happen on the
random-weight `small`) keeps every greedy token, counts the KV cache it moved in /ep/stats, and the
replay of the trace it recorded gives the measured bytes to the byte, migrations included: with the
rank each row ran on (`--assign recorded`), and with the grouper re-deciding every admission and
every move where the server's log says it did (`--assign grouper --moves`)."""

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
def test_moves_after_prefill_keep_tokens_and_the_replay_counts_their_bytes(tmp_path):
    from locus.traces.reader import TraceReader

    plan_path = locality_plan(tmp_path, slots=6, requests=24)
    plan = json.loads(plan_path.read_text())
    plan["grouping"]["move_margin"] = 0.0
    plan_path.write_text(json.dumps(plan))

    families = list(FAMILIES)
    work = [(domain_prompt(families[i % len(families)], 400 + i), 4 + i % 4) for i in range(12)]
    want = [o.outputs[0].text for o in LLM("small").generate(
        [p for p, _ in work], [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for _, n in work])]

    trace = tmp_path / "trace"
    with running_server("--model", "small", "--ep-ranks", "4", "--gpus-per-node", "2", "--plan", str(plan_path),
                        "--ep-moves", "--record-trace", str(trace), "--ep-timeout", "120", timeout=300) as proc:
        def send(i: int) -> str:  # untagged: placed by the prompt predictor, then moved by the prefill
            prompt, max_tokens = work[i]
            body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
            r = httpx.post(f"{proc.base_url}/v1/completions", json=body, timeout=300)
            r.raise_for_status()
            return r.json()["choices"][0]["text"]

        with ThreadPoolExecutor(4) as pool:
            got = list(pool.map(send, range(len(work))))
        stats = httpx.get(f"{proc.base_url}/ep/stats").json()
        metrics = httpx.get(f"{proc.base_url}/metrics").text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    assert got == want
    assert stats["migrations"] > 0 and stats["migrated_kv_bytes"] > 0
    assert f'tier="migration_inter_node"' in metrics

    records = TraceReader(trace).requests
    moved = [r for r in records if r.decode_rank is not None]
    assert len(moved) == stats["migrations"] and all(r.observed is not None for r in records)
    for assign in (["--assign", "recorded"], ["--assign", "grouper", "--moves"]):
        out = tmp_path / f"replay-{assign[1]}.json"
        done = subprocess.run([sys.executable, "-m", "locus.cli", "replay", str(trace), "--plan", str(plan_path),
                               *assign, "--json", str(out)], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        replayed = json.loads(out.read_text())
        assert (replayed["inter_node_bytes"], replayed["intra_node_bytes"], replayed["tokens"],
                replayed["migrations"], replayed["migrated_kv_bytes"]) == (
            stats["inter_node_bytes"], stats["intra_node_bytes"], stats["tokens"], stats["migrations"],
            stats["migrated_kv_bytes"]), assign
