"""Requests moved between ranks after their prefill: the wire side (docs/planner.md, "Moving a request
after prefill"; the engine side is locus/engine/core/migration.py).

Rank 0 sends the source `Move` in `moves_out` and the target the same move in `moves_in`, in one
iteration; after that iteration's control exchange, before the step, every rank runs its moves in
move-number order, each one point to point between its two ranks:
    header  int64 [2]: the pickled state's length, the KV positions that follow (0, 0: not here)
    state   uint8: the pickled Migrant without its KV cache (control group, gloo)
    kv      [layers, T, W] (migration.py) in the cache's dtype, on the cache's device (over the default group
            when that is NCCL and the cache on a GPU, else the control group)
Blocking sends and receives in one global order cannot deadlock: the lowest-numbered move not done
yet has both of its ranks ready for it. The source counts the KV bytes as migration bytes,
inter-node or intra-node by where the target is, apart from the dispatch bytes.

Elastic EP: the source keeps what it sent until the next iteration whose exchange succeeds has run
its moves (every rank then got past this one, and a move of a failed iteration is resent, `retry`, in
the first iteration after the regroup); a resent move sends it again if the request has left the
engine, and the target drops a copy of a request it already holds.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from locus.engine.ep.ranks.messages import Move, decode, encode
from locus.engine.core.migration import Migrant, kv_shape, take_in, take_out

log = logging.getLogger("locus.engine")


class RequestMover:
    def __init__(self, worker):
        self.worker = worker
        self.sent: dict[str, tuple[int, Migrant]] = {}  # request id -> (iteration, what was sent)

    def settle(self, iteration: int) -> None:
        """Every rank got past the iterations before `iteration`, and `iteration` ran its moves (a resent
        one included): forget what the earlier ones sent."""
        self.sent = {k: v for k, v in self.sent.items() if v[0] >= iteration}

    def run(self, outs: list[Move], ins: list[Move], iteration: int) -> list[tuple[str, int]]:
        """This rank's moves of the iteration; returns (request id, KV positions sent, -1: not here)
        for each move out."""
        sent = []
        for number, out, move in sorted([(m.number, True, m) for m in outs] + [(m.number, False, m) for m in ins],
                                        key=lambda x: x[0]):
            if out:
                sent.append((move.request_id, self._send(move, iteration)))
            else:
                self._receive(move)
        return sent

    # --- the source --------------------------------------------------------------------------------
    def _send(self, move: Move, iteration: int) -> int:
        core = self.worker.core
        migrant = take_out(core, move.request_id)
        if migrant is None and move.retry and move.request_id in self.sent:
            migrant = self.sent[move.request_id][1]
        control = self.worker.control.group
        if migrant is None:  # finished or aborted before the move reached it
            dist.send(torch.zeros(2, dtype=torch.int64), move.peer, group=control)
            return -1
        self.sent[move.request_id] = (iteration, migrant)
        state = encode(migrant.state())
        tokens = migrant.kv_tokens
        dist.send(torch.tensor([len(state), tokens], dtype=torch.int64), move.peer, group=control)
        dist.send(torch.frombuffer(bytearray(state), dtype=torch.uint8), move.peer, group=control)
        if tokens:
            kv = migrant.kv.contiguous()
            dist.send(kv, move.peer, group=self._kv_group(kv))
            self._count(move.peer, kv.numel() * kv.element_size())
        return tokens

    def _count(self, peer: int, nbytes: int) -> None:
        runtime = self.worker.runtime
        G = runtime.placement.plan.topology.gpus_per_node
        counters = runtime.lanes[0].counters
        if peer // G == self.worker.rank // G:
            counters.migration_intra_node += nbytes
        else:
            counters.migration_inter_node += nbytes
        counters.migrations += 1

    # --- the target --------------------------------------------------------------------------------
    def _receive(self, move: Move) -> None:
        core = self.worker.core
        control = self.worker.control.group
        header = torch.zeros(2, dtype=torch.int64)
        dist.recv(header, move.peer, group=control)
        size, tokens = int(header[0]), int(header[1])
        if size == 0:
            return  # the source no longer had it: rank 0 learns so from the source's report
        buf = torch.empty(size, dtype=torch.uint8)
        dist.recv(buf, move.peer, group=control)
        migrant: Migrant = decode(buf.numpy().tobytes())
        if tokens:
            cache = core.cache.keys[0]
            kv = torch.empty(kv_shape(core, tokens), dtype=cache.dtype, device=cache.device)
            dist.recv(kv, move.peer, group=self._kv_group(kv))
            migrant.kv = kv
        if move.request_id in core.requests:
            if not move.retry:
                log.error("request %s moved in, but this rank holds it already: the copy is dropped", move.request_id)
            return
        take_in(core, migrant)

    def _kv_group(self, kv: torch.Tensor):
        """The default group when it is NCCL and the KV cache is on a GPU, else the control group (gloo)."""
        if kv.is_cuda and dist.get_backend() == "nccl":
            return None
        return self.worker.control.group


def drop(core, request_id: str) -> None:
    """Forget a request without an output (elastic EP: rank 0 resumes it elsewhere)."""
    request = core.requests.pop(request_id, None)
    if request is None:
        return
    for seq in request.seqs:
        if not seq.is_finished:
            if core.recorder is not None:
                core.recorder.hand_over(seq)
            core.scheduler.finish(seq)
