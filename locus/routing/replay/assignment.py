"""Request -> rank assignment: the rank where a request's attention runs, where its tokens start at
every MoE layer.

Policies:
  balanced     each request, in trace order, to the rank with the fewest tokens assigned so far
               (ties: lowest rank), as a load-balancing DP-attention front end would do;
  round_robin  request i of the replayed range to rank i % R;
  a file       JSON {request_id: rank} (what `--save-assignment` writes), or the assignment log
               `locus route` writes (locus/traces/route_log.py: each trace request takes the rank its
               logged request was sent to, matched by id); either must name every replayed request;
  grouper      the plan's micro-batch grouper run online over the replayed requests
               (grouper_simulation.py): a request may run its prefill on one rank and, moved after it,
               its decode on another; `decode_ranks` then says where, and the KV cache that moved is
               counted apart from the dispatch traffic.
An assignment covers the replayed request range only; `save_assignment` writes the file form (the
prefill rank of every request).
"""

from __future__ import annotations

import heapq
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from locus.errors import LocusError
from locus.files import write_text_atomic
from locus.traces.format import TraceFormatError
from locus.traces.route_log import is_route_log, read_route_log


@dataclass(frozen=True)
class Assignment:
    policy: str
    request_start: int  # first request index (in trace order) covered
    ranks: np.ndarray  # [requests] int64: rank of request request_start + i (its prefill rank)
    decode_ranks: np.ndarray | None = None  # [requests] rank of its decode rows; None: same as ranks
    migrations: int = 0  # requests moved between prefill and decode
    migrated_kv_bytes: int = 0  # KV cache bytes those moves sent between nodes
    # [requests] the position from which a request's rows ran on its decode rank (a live move sends
    # the KV cache of the positions its source had computed); None: its prompt length
    split_at: np.ndarray | None = None

    @property
    def request_stop(self) -> int:
        return self.request_start + len(self.ranks)

    @property
    def splits(self) -> bool:
        return self.decode_ranks is not None

    def row_ranks(self, request: np.ndarray, position: np.ndarray, prompt_tokens: np.ndarray | None) -> np.ndarray:
        """Rank of every row: request [T] (index relative to request_start), position [T] in its
        request, prompt_tokens [requests] (needed only when the assignment splits requests)."""
        ranks = np.asarray(self.ranks, dtype=np.int64)
        if self.decode_ranks is None:
            return ranks[request]
        decode = np.asarray(self.decode_ranks, dtype=np.int64)
        split = np.asarray(prompt_tokens if self.split_at is None else self.split_at)
        return np.where(position < split[request], ranks[request], decode[request])


def assign_balanced(tokens, num_ranks: int, request_start: int = 0) -> Assignment:
    """tokens [requests]: token count of each request, in trace order."""
    heap = [(0, rank) for rank in range(num_ranks)]  # (tokens so far, rank): the minimum is the target
    ranks = np.empty(len(tokens), dtype=np.int64)
    for i, n in enumerate(np.asarray(tokens, dtype=np.int64).tolist()):
        load, rank = heapq.heappop(heap)
        ranks[i] = rank
        heapq.heappush(heap, (load + n, rank))
    return Assignment("balanced", request_start, ranks)


def assign_round_robin(num_requests: int, num_ranks: int, request_start: int = 0) -> Assignment:
    return Assignment("round_robin", request_start, np.arange(num_requests, dtype=np.int64) % num_ranks)


def assign_recorded(requests, num_ranks: int, request_start: int = 0, kv_bytes_per_token: int | None = None,
                    gpus_per_node: int | None = None) -> Assignment:
    """The ranks the requests ran on, as an expert-parallel server recorded them in the trace: a request
    it moved after its prefill (`decode_rank`) ran its rows before `moved_tokens` on `rank` and the rest
    on `decode_rank`, and its move sent `moved_tokens * kv_bytes_per_token` bytes of KV cache (counted
    when source and target are on different nodes of `gpus_per_node` ranks)."""
    ranks = np.empty(len(requests), dtype=np.int64)
    decode = np.empty(len(requests), dtype=np.int64)
    split = np.zeros(len(requests), dtype=np.int64)
    migrations = migrated = 0
    for i, r in enumerate(requests):
        if r.rank is None:
            raise LocusError(f"request {r.id!r} has no recorded rank: the trace was not recorded by an "
                             "expert-parallel server (use another --assign)")
        for rank in (r.rank, r.decode_rank):
            if rank is not None and not 0 <= rank < num_ranks:
                raise LocusError(f"request {r.id!r} ran on rank {rank}, but the plan has {num_ranks} ranks")
        ranks[i], decode[i], split[i] = r.rank, r.rank, r.tokens
        if r.decode_rank is not None and r.moved_tokens is not None:
            if kv_bytes_per_token is None:
                raise LocusError(f"request {r.id!r} moved after its prefill, and the trace does not say how many KV "
                                 "cache bytes a token takes (meta.json kv_bytes_per_token)")
            decode[i], split[i] = r.decode_rank, r.moved_tokens
            migrations += 1
            if gpus_per_node is None or r.rank // gpus_per_node != r.decode_rank // gpus_per_node:
                migrated += r.moved_tokens * kv_bytes_per_token
    if not migrations:
        return Assignment("recorded", request_start, ranks)
    return Assignment("recorded", request_start, ranks, decode, migrations, int(migrated), split)


def load_assignment(path: str | Path, request_ids, num_ranks: int, request_start: int = 0) -> Assignment:
    """Ranks for `request_ids` (the replayed requests, in order) from a {request_id: rank} JSON file or a
    router's assignment log."""
    path = Path(path)
    if is_route_log(path):
        return _routed_assignment(path, request_ids, num_ranks, request_start)
    try:
        mapping = json.loads(path.read_text())
    except OSError as exc:
        raise LocusError(f"cannot read assignment {path}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise LocusError(f"{path}: not valid JSON (line {exc.lineno}: {exc.msg})") from None
    if not isinstance(mapping, dict):
        raise LocusError(f"{path}: an assignment must be a JSON object {{request_id: rank}}")
    ranks = np.empty(len(request_ids), dtype=np.int64)
    for i, rid in enumerate(request_ids):
        if rid not in mapping:
            raise LocusError(f"{path}: request {rid!r} (index {request_start + i}) has no rank")
        rank = mapping[rid]
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < num_ranks:
            raise LocusError(f"{path}: request {rid!r} has rank {rank!r}, expected an integer in 0..{num_ranks - 1}")
        ranks[i] = rank
    return Assignment(f"file:{path.name}", request_start, ranks)


def _routed_assignment(path: Path, request_ids, num_ranks: int, request_start: int) -> Assignment:
    """The ranks `locus route` logged for the trace's requests."""
    try:
        log = read_route_log(path)
    except TraceFormatError as exc:
        raise LocusError(str(exc)) from None
    ranks = np.empty(len(request_ids), dtype=np.int64)
    for i, rid in enumerate(request_ids):
        found = log.match(rid)
        if found is None:
            raise LocusError(f"{path}: the router logged no request for trace request {rid!r} (index "
                             f"{request_start + i})")
        if not 0 <= found.rank < num_ranks:
            raise LocusError(f"{path}: request {found.id!r} went to rank {found.rank}, but the plan has {num_ranks} ranks")
        ranks[i] = found.rank
    return Assignment(f"route-log:{path.name}", request_start, ranks)


def save_assignment(assignment: Assignment, request_ids, path: str | Path) -> None:
    """Write {request_id: rank} atomically (the form `load_assignment` reads)."""
    if len(request_ids) != len(assignment.ranks):
        raise ValueError(f"{len(request_ids)} request ids for {len(assignment.ranks)} assigned requests")
    path = Path(path)
    text = json.dumps({str(rid): int(r) for rid, r in zip(request_ids, assignment.ranks)}, indent=0) + "\n"
    write_text_atomic(path, text)
