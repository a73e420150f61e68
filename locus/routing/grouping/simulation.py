"""Run the online grouper over recorded requests, in trace order: what the locality planner iterates on
(the planner's offline view of its grouper). It is not what a server admits: `locus replay --assign
grouper`, `locus plan evaluate` and `locus plan sweep` run the live admission (live.py), with the stream
cap and requests finishing.

Each request is admitted with its domain tag and token count (the same count the `balanced`
baseline assigns by), then, once its prompt's routing is known, offered to `observe_prefill` with its
prefill signature. The move decision itself sees only the spec's expected decode length, not the
request's real one. Requests are never finished: the replay measures tokens per rank over the whole
replayed range, so every request stays charged to the end. The outcome is an Assignment whose
`ranks` are the admission (prefill) ranks and `decode_ranks` the ranks after any move.

Shape legend: R requests, L MoE layers, E experts, N nodes.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import numpy as np

from locus.errors import LocusError
from locus.routing.replay.assignment import Assignment
from locus.routing.grouping.grouper import Grouper
from locus.routing.grouping.signatures import count_request_pairs
from locus.traces.reader import CHUNK_ROUTINGS

PrefillChunks = Iterable[tuple[int, int, np.ndarray]]  # (lo, hi, prefill counts [hi - lo, L, E]), in order


def run_grouper(grouper: Grouper, ids, domains, tokens, prompt_tokens, prefill_chunks: PrefillChunks,
                request_start: int = 0, policy: str = "grouper",
                chunk_bytes: Iterator[np.ndarray] | None = None) -> Assignment:
    """Admit and observe every request; chunks must cover 0..len(ids) in order. `chunk_bytes`: each chunk's
    grouper.cost.expected_bytes(counts), in chunk order, computed elsewhere (the planner's worker pool);
    None: computed here."""
    R = len(ids)
    ranks = np.empty(R, dtype=np.int64)
    decode = np.empty(R, dtype=np.int64)
    tokens = np.asarray(tokens)
    prompt_tokens = np.asarray(prompt_tokens)
    done = 0
    for lo, hi, counts in prefill_chunks:
        if lo != done:
            raise ValueError(f"prefill chunks must be consecutive: expected {done}, got {lo}")
        node_bytes = None
        if grouper.cost is not None and grouper.moves and hi > lo:
            node_bytes = grouper.cost.expected_bytes(counts) if chunk_bytes is None else next(chunk_bytes)
        for i in range(lo, hi):
            ranks[i] = grouper.admit(ids[i], domains[i], int(tokens[i]), int(prompt_tokens[i]))
            if node_bytes is not None and prompt_tokens[i] > 0:
                grouper.observe_prefill(ids[i], node_bytes=node_bytes[i - lo])
            decode[i] = grouper.rank_of(ids[i])
        done = hi
    if done != R:
        raise ValueError(f"prefill chunks cover {done} of {R} requests")
    moved = decode != ranks
    return Assignment(policy, request_start, ranks, decode if moved.any() else None,
                      migrations=int(grouper.stats.moves), migrated_kv_bytes=int(grouper.stats.migrated_kv_bytes))


def trace_prefill_chunks(reader, start: int, stop: int) -> Iterator[tuple[int, int, np.ndarray]]:
    """Prefill signatures of requests [start, stop), chunk by chunk (positions relative to start)."""
    meta = reader.meta
    offsets = np.asarray(reader.offsets, dtype=np.int64)
    max_rows = max(1, CHUNK_ROUTINGS // (len(meta.moe_layers) * meta.top_k))
    for chunk in reader.iter_chunks(max_rows, start, stop, copy=True):
        lo, hi = chunk.request_start, chunk.request_stop
        prompt = np.fromiter((r.prompt_tokens for r in reader.requests[lo:hi]), dtype=np.int64, count=hi - lo)
        sizes = np.diff(offsets[lo : hi + 1])
        keep = np.minimum(prompt, sizes)
        # Only the prompt rows matter: gather them and count them all as phase 0.
        row_request = np.repeat(np.arange(hi - lo), keep)
        base = np.repeat(offsets[lo:hi] - offsets[lo], keep)
        position = np.arange(len(row_request)) - np.repeat(np.cumsum(keep) - keep, keep)
        ids = chunk.expert_ids[base + position]
        counts = count_request_pairs(ids, row_request, np.zeros_like(row_request), hi - lo, meta.num_experts)
        yield lo - start, hi - start, counts[:, 0]


def simulate_grouper(grouper: Grouper, reader, start: int, stop: int) -> Assignment:
    """The grouper run online over trace requests [start, stop) (see the module docstring)."""
    if grouper.cost is not None:
        L, E = grouper.cost.prior.shape
        meta = reader.meta
        if (L, E) != (len(meta.moe_layers), meta.num_experts):
            raise LocusError(f"the grouper's plan is for {L} MoE layers x {E} experts, the trace has "
                             f"{len(meta.moe_layers)} x {meta.num_experts}")
    requests = reader.requests[start:stop]
    return run_grouper(
        grouper,
        [r.id for r in requests],
        [r.domain for r in requests],
        [r.tokens for r in requests],
        [r.prompt_tokens for r in requests],
        trace_prefill_chunks(reader, start, stop),
        request_start=start,
    )


SIGNATURE_CHUNK = 256  # requests per signature_chunks chunk


def signature_chunks(prefill: np.ndarray, size: int = SIGNATURE_CHUNK) -> Iterator[tuple[int, int, np.ndarray]]:
    """Chunks over in-memory prefill counts [R, L, E]."""
    for lo, hi in chunk_bounds(prefill.shape[0], size):
        yield lo, hi, prefill[lo:hi]


def chunk_bounds(rows: int, size: int = SIGNATURE_CHUNK) -> list[tuple[int, int]]:
    """signature_chunks' (lo, hi) over `rows` requests, without reading the counts."""
    return [(lo, min(lo + size, rows)) for lo in range(0, rows, size)]
