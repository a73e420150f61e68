"""Randomised stress of the engine: n = 1..4, a tiny KV pool (constant preemption), chunked prefill,
requests arriving and aborted at random steps. Whatever happens, no step raises, every request ends
(finished or aborted), every block comes back, and each surviving greedy choice equals what the same
request produces in an unconstrained engine.

Seeded and bounded: `LOCUS_STRESS_TRIALS` raises the number of seeds for a long run."""

from __future__ import annotations

import os
import random

import pytest

from locus.engine.core.engine_core import EngineConfig, EngineCore
from locus.engine.core.outputs import RequestOutput
from locus.engine.sampling.sampler import SamplingParams

TRIALS = int(os.environ.get("LOCUS_STRESS_TRIALS", "6"))
MAX_STEPS = 5_000  # far above what any trial needs: reaching it means the engine is wedged


def random_request(rng: random.Random, vocab: int) -> tuple[list[int], SamplingParams]:
    prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 40))]
    greedy = rng.random() < 0.5
    params = SamplingParams(
        n=rng.randint(1, 4), temperature=0.0 if greedy else rng.uniform(0.5, 1.5),
        top_k=rng.choice([0, 5, 50]), seed=None if greedy else rng.randrange(1 << 30),
        max_tokens=rng.randint(1, 24), ignore_eos=rng.random() < 0.8,
        logprobs=rng.choice([None, None, 2]))
    return prompt, params


def finals_of(core: EngineCore, outputs: list[RequestOutput], into: dict[str, RequestOutput],
              deltas: dict | None = None) -> None:
    for out in outputs:
        assert out.request_id not in into, f"{out.request_id}: an output after its final one"
        if deltas is not None:
            for c in out.outputs:
                deltas.setdefault((out.request_id, c.index), []).extend(c.delta_token_ids)
        if out.finished:
            into[out.request_id] = out


def run_unconstrained(model, tok, requests) -> dict[str, RequestOutput]:
    core = EngineCore(model, tok, EngineConfig(block_size=8, num_kv_blocks=4096, max_num_seqs=512))
    for rid, prompt, params in requests:
        core.add_request(rid, prompt, params)
    finals: dict[str, RequestOutput] = {}
    while core.has_unfinished():
        finals_of(core, core.step(), finals)
    return finals


def run_stressed(model, tok, requests, rng: random.Random, overlap: bool = False,
                 deltas: dict | None = None) -> tuple[dict[str, RequestOutput], set[str], EngineCore]:
    core = EngineCore(model, tok, EngineConfig(block_size=8, num_kv_blocks=16, max_num_seqs=8,
                                               max_num_batched_tokens=24, async_scheduling=overlap))
    pending = list(requests)
    finals: dict[str, RequestOutput] = {}
    aborted: set[str] = set()
    for _ in range(MAX_STEPS):
        for _ in range(rng.choice([0, 0, 1, 2])):
            if pending:
                rid, prompt, params = pending.pop(0)
                core.add_request(rid, prompt, params)
        live = [rid for rid in core.requests if rid not in finals]
        if live and rng.random() < 0.04:
            rid = rng.choice(live)
            out = core.abort(rid)
            aborted.add(rid)
            finals_of(core, [out], finals, deltas)
        finals_of(core, core.step(), finals, deltas)
        if not pending and not core.has_unfinished():
            finals_of(core, core.drain(), finals, deltas)  # a step in flight delivers nothing now
            return finals, aborted, core
    raise AssertionError(f"engine wedged: {len(core.requests)} requests unfinished after {MAX_STEPS} steps")


@pytest.mark.parametrize("seed", range(TRIALS))
def test_random_mixed_load_on_a_tiny_pool_never_breaks_the_engine(tiny, tok, seed):
    check_stressed(tiny, tok, seed, overlap=False)


@pytest.mark.parametrize("seed", range(max(TRIALS // 2, 1)))
def test_the_overlapped_schedule_under_random_load_matches_the_serial_engine(tiny, tok, seed):
    """The same trials with the host finishing step N while step N + 1 is queued (launched_step.py):
    preemption, aborts and stops between the halves; every client sees exactly its final tokens."""
    check_stressed(tiny, tok, seed, overlap=True)


def check_stressed(tiny, tok, seed: int, overlap: bool) -> None:
    rng = random.Random(seed)
    requests = [(f"r{i}", *random_request(rng, tok.vocab_size)) for i in range(40)]
    deltas: dict = {}
    finals, aborted, core = run_stressed(tiny, tok, requests, rng, overlap, deltas)
    for rid, out in finals.items():  # what was streamed is the final output: nothing extra, nothing lost
        assert all(deltas.get((rid, c.index), []) == c.token_ids for c in out.outputs), rid
    stats = core.stats()
    assert stats.num_preemptions > 0, "the pool was meant to be too small"
    assert stats.num_free_blocks == stats.num_blocks and not core.requests
    assert set(finals) == {rid for rid, _, _ in requests}, "every request ends"
    reference = run_unconstrained(tiny, tok, [r for r in requests if r[0] not in aborted])
    for rid, prompt, params in requests:
        out = finals[rid]
        if rid in aborted:
            assert all(c.finish_reason in ("abort", "stop", "length") for c in out.outputs)
            continue
        want = reference[rid]
        assert len(out.outputs) == params.n and all(c.finish_reason in ("stop", "length") for c in out.outputs)
        if params.greedy:
            assert [c.token_ids for c in out.outputs] == [c.token_ids for c in want.outputs], rid
            assert [c.finish_reason for c in out.outputs] == [c.finish_reason for c in want.outputs], rid
        # Seeded rows are batch-invariant too, but only up to float rounding: on this random-weight
        # model two tokens' logits can differ by 1e-7, and a batch of another shape sorts them the
        # other way (seen once in 80 seeds), so they are checked for completeness, not token by token.
