"""Request expert signatures: how often each request routed to each expert, per MoE layer and phase.

A request's prefill signature is what the micro-batch grouper sees once its prefill has run (it
predicts the request's decode); its decode counts are what the planner must place well. Both come
from one streaming pass over a request range, one `np.bincount` per chunk of whole requests.

Shape legend: R requests, L MoE layers, E experts, K top-k, T rows of a chunk, G groups.
    prefill [R, L, E] PairCounts   (token, k) pairs of the request's prompt rows routed to e at layer l
    decode  [R, L, E] PairCounts   the same for its generated rows
PairCounts (pair_counts.py) holds a count in one byte (exact counts beside it where they reach 255) and
reads rows back as float32, so 10M planning tokens fit where float32 arrays would take 2.8 GB. Sums over
requests (group_pairs, all_pairs) are built block by block: the planner never holds prefill + decode
as a third [R, L, E] array.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from locus.routing.grouping.pair_counts import SATURATED, PairCounts
from locus.routing.plan.grouping_spec import tagged_domains
from locus.traces.reader import CHUNK_ROUTINGS


@dataclass
class RequestSignatures:
    start: int  # trace index of the first request
    ids: list[str]
    domains: list[str]
    prompt_tokens: np.ndarray  # [R] int64
    tokens: np.ndarray  # [R] int64
    prefill: PairCounts  # [R, L, E]
    decode: PairCounts  # [R, L, E]
    top_k: int

    @property
    def num_requests(self) -> int:
        return len(self.ids)

    def group_pairs(self, group: np.ndarray, groups: int) -> np.ndarray:
        """All pairs (prefill and decode) of each group's requests, [G, L, E] float32 (exact integers below
        2^24); group [R] in 0..G-1, -1 = none."""
        return (self.prefill.group_sums(group, groups) + self.decode.group_sums(group, groups)).astype(np.float32)

    def all_pairs(self) -> np.ndarray:
        """All pairs of every request, [L, E] float32: each expert's load over the planning requests."""
        return self.group_pairs(np.zeros(self.num_requests, dtype=np.int64), 1)[0]

    def domain_pairs(self) -> np.ndarray:
        """All pairs of each tagged domain's requests, [D, L, E] float32, domains in tagged_domains' order."""
        names = tagged_domains(self.domains)
        index = {name: i for i, name in enumerate(names)}
        group = np.fromiter((index.get(d, -1) for d in self.domains), dtype=np.int64, count=self.num_requests)
        return self.group_pairs(group, len(names))

    def total_rows(self, rows: np.ndarray) -> "TotalRows":
        """All pairs of the requests `rows` [n], as a [n, L, E] float32 view read a row slice at a time."""
        return TotalRows(self, np.asarray(rows, dtype=np.int64))


@dataclass(frozen=True)
class TotalRows:
    """Prefill + decode pairs of some requests, [n, L, E] float32, computed when a row slice is read
    (`view[a:b]`), so a caller that reads block by block never holds all n rows."""

    signatures: RequestSignatures
    rows: np.ndarray  # [n] request positions

    @property
    def shape(self) -> tuple[int, int, int]:
        return (len(self.rows), *self.signatures.prefill.shape[1:])

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index) -> np.ndarray:
        rows = self.rows[index]
        return self.signatures.prefill.rows(rows) + self.signatures.decode.rows(rows)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = self[:]
        return out if dtype is None else out.astype(dtype, copy=False)


def count_request_pairs(expert_ids: np.ndarray, row_request: np.ndarray, row_phase: np.ndarray,
                        num_requests: int, num_experts: int) -> np.ndarray:
    """Per-(request, phase, layer, expert) pair counts of a block of rows, [Rc, 2, L, E] float32.

    expert_ids [T, L, K] (-1 = none), row_request [T] in 0..Rc-1, row_phase [T] (0 prefill, 1 decode).
    """
    return _count_pairs(expert_ids, row_request, row_phase, num_requests, num_experts).astype(np.float32)


def _count_pairs(expert_ids: np.ndarray, row_request: np.ndarray, row_phase: np.ndarray,
                 num_requests: int, num_experts: int) -> np.ndarray:
    """count_request_pairs as int64 [Rc, 2, L, E]."""
    T, L, _ = expert_ids.shape
    E = num_experts
    ids = np.asarray(expert_ids, dtype=np.int64)
    row_key = (row_request * 2 + row_phase)[:, None] * L + np.arange(L)  # [T, L]
    keys = row_key[:, :, None] * E + ids
    valid = ids >= 0
    # Most blocks hold no -1: counting the keys as they are spares the masked copy.
    counts = np.bincount(keys.ravel() if valid.all() else keys[valid], minlength=num_requests * 2 * L * E)
    return counts.reshape(num_requests, 2, L, E)


def collect_signatures(reader, start: int, stop: int) -> RequestSignatures:
    """Signatures of requests [start, stop) of a trace reader (read chunk by chunk with plain file reads, so
    the trace's pages are not mapped into the process)."""
    meta = reader.meta
    L, E, K = len(meta.moe_layers), meta.num_experts, meta.top_k
    R = stop - start
    low = [np.zeros((R, L, E), dtype=np.uint8) for _ in range(2)]  # prefill, decode
    over: list[list[tuple[np.ndarray, np.ndarray]]] = [[], []]  # per phase, per chunk: (flat positions, counts)
    requests = reader.requests[start:stop]
    prompt = np.fromiter((r.prompt_tokens for r in requests), dtype=np.int64, count=R)
    tokens = np.fromiter((r.tokens for r in requests), dtype=np.int64, count=R)
    offsets = np.asarray(reader.offsets, dtype=np.int64)
    max_rows = max(1, CHUNK_ROUTINGS // (L * K))
    for chunk in reader.iter_chunks(max_rows, start, stop, copy=True):
        lo, hi = chunk.request_start, chunk.request_stop
        sizes = np.diff(offsets[lo : hi + 1])
        row_request = np.repeat(np.arange(hi - lo), sizes)
        position = np.arange(len(row_request)) - np.repeat(offsets[lo:hi] - offsets[lo], sizes)
        row_phase = (position >= prompt[row_request + lo - start]).astype(np.int64)
        counts = _count_pairs(chunk.expert_ids, row_request, row_phase, hi - lo, E)
        for phase in range(2):
            part = counts[:, phase]  # [hi - lo, L, E]
            low[phase][lo - start : hi - start] = np.minimum(part, SATURATED)
            flat = np.flatnonzero(part >= SATURATED)
            if flat.size:
                over[phase].append((flat + (lo - start) * L * E, part.reshape(-1)[flat]))
    prefill, decode = (PairCounts.from_parts(low[p], *_joined(over[p])) for p in range(2))
    return RequestSignatures(
        start=start,
        ids=[r.id for r in requests],
        domains=[r.domain for r in requests],
        prompt_tokens=prompt,
        tokens=tokens,
        prefill=prefill,
        decode=decode,
        top_k=K,
    )


def _joined(parts: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    if not parts:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    return np.concatenate([p for p, _ in parts]), np.concatenate([v for _, v in parts])


def group_demand(signatures: RequestSignatures, prefill_node: np.ndarray, decode_node: np.ndarray,
                 nodes: int) -> np.ndarray:
    """Pairs each node's requests route to each expert, [L, N, E] float64.

    A request's prefill pairs count on prefill_node [R], its decode pairs on decode_node [R] (the
    grouper may move a request after its prefill).
    """
    demand = signatures.prefill.group_sums(prefill_node, nodes) + signatures.decode.group_sums(decode_node, nodes)
    return demand.transpose(1, 0, 2).copy()
