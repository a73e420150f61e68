"""Request expert signatures: how often each request routed to each expert, per MoE layer and phase.

A request's prefill signature is what the micro-batch grouper sees once its prefill has run (it
predicts the request's decode); its decode counts are what the planner must place well. Both come
from one streaming pass over a request range, one `np.bincount` per chunk of whole requests.

Shape legend: R requests, L MoE layers, E experts, K top-k, T rows of a chunk.
    prefill [R, L, E] float32   (token, k) pairs of the request's prompt rows routed to e at layer l
    decode  [R, L, E] float32   the same for its generated rows
float32 counts are exact up to 2^24, far above any request's length; they feed BLAS matmuls directly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from locus.traces.reader import CHUNK_ROUTINGS



@dataclass
class RequestSignatures:
    start: int  # trace index of the first request
    ids: list[str]
    domains: list[str]
    prompt_tokens: np.ndarray  # [R] int64
    tokens: np.ndarray  # [R] int64
    prefill: np.ndarray  # [R, L, E] float32
    decode: np.ndarray  # [R, L, E] float32
    top_k: int

    @property
    def num_requests(self) -> int:
        return len(self.ids)

    @property
    def total(self) -> np.ndarray:
        """All pairs of each request, [R, L, E]."""
        return self.prefill + self.decode



def count_request_pairs(expert_ids: np.ndarray, row_request: np.ndarray, row_phase: np.ndarray,
                        num_requests: int, num_experts: int) -> np.ndarray:
    """Per-(request, phase, layer, expert) pair counts of a block of rows, [Rc, 2, L, E] float32.

    expert_ids [T, L, K] (-1 = none), row_request [T] in 0..Rc-1, row_phase [T] (0 prefill, 1 decode).
    """
    T, L, _ = expert_ids.shape
    E = num_experts
    ids = np.asarray(expert_ids, dtype=np.int64)
    row_key = (row_request * 2 + row_phase)[:, None] * L + np.arange(L)  # [T, L]
    keys = row_key[:, :, None] * E + ids
    valid = ids >= 0
    # Most blocks hold no -1: counting the keys as they are spares the masked copy.
    counts = np.bincount(keys.ravel() if valid.all() else keys[valid], minlength=num_requests * 2 * L * E)
    return counts.reshape(num_requests, 2, L, E).astype(np.float32)


def collect_signatures(reader, start: int, stop: int) -> RequestSignatures:
    """Signatures of requests [start, stop) of a trace reader (memory-mapped; read chunk by chunk)."""
    meta = reader.meta
    L, E, K = len(meta.moe_layers), meta.num_experts, meta.top_k
    R = stop - start
    prefill = np.zeros((R, L, E), dtype=np.float32)
    decode = np.zeros((R, L, E), dtype=np.float32)
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
        counts = count_request_pairs(chunk.expert_ids, row_request, row_phase, hi - lo, E)
        prefill[lo - start : hi - start] = counts[:, 0]
        decode[lo - start : hi - start] = counts[:, 1]
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


def group_demand(signatures: RequestSignatures, prefill_node: np.ndarray, decode_node: np.ndarray,
                 nodes: int) -> np.ndarray:
    """Pairs each node's requests route to each expert, [L, N, E] float64.

    A request's prefill pairs count on prefill_node [R], its decode pairs on decode_node [R] (the
    grouper may move a request after its prefill).
    """
    R, L, E = signatures.prefill.shape
    demand = np.zeros((nodes, L * E), dtype=np.float64)
    for counts, node in ((signatures.prefill, prefill_node), (signatures.decode, decode_node)):
        onehot = np.zeros((nodes, R), dtype=np.float32)
        onehot[np.asarray(node), np.arange(R)] = 1.0
        demand += onehot @ counts.reshape(R, L * E)
    return demand.reshape(nodes, L, E).transpose(1, 0, 2).copy()
