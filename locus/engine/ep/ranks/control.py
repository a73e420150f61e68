"""The control plane of an expert-parallel server: one gloo group of every rank, two collectives an
iteration at most.

1. `all_gather_single` of a small fixed header from every rank (`Header`): whether it has work, an upper
   bound on the tokens its next step may run, the length of the report it has for rank 0, the digest
   of the placement it will step under (invariant.py), and, from rank 0, stop, the length of the
   commands it sends each rank and the prompt tokens they add. From the headers every rank derives the
   same decisions: whether the placements agree, whether anyone steps, and the step's largest token
   count (the fixed-capacity exchange's block size).
2. One batch of point-to-point messages (`batch_isend_irecv`) of exactly the announced bytes:
   commands from rank 0 to each rank that has some, each rank's report (its previous step's outputs
   and counters) to rank 0. Only the announced messages travel: an all-to-all would also send an
   empty message between every other pair of ranks, and each message costs ~400 bytes on the wire
   (gloo's framing and acknowledgements; bench/ep_wire.py), most of them over the inter-node link.
   Skipped when nobody has anything to say.

No step-count agreement, no separate "any work?" vote, no object broadcast with its own size
collective: that is what the header is for.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from locus.engine.ep.invariant import BROKEN
from locus.engine.ep.transport import sparse_all_to_all

WORK, PENDING, REPORT, STOP, DIGEST = 0, 1, 2, 3, 4
FIXED_FIELDS = 5  # then, from rank 0: command bytes for each rank, then prompt tokens added on each rank


@dataclass
class Header:
    work: bool  # unfinished requests on this rank
    pending_tokens: int  # tokens this rank's next step may run at most (before new adds)
    report_bytes: int  # length of the report this rank sends rank 0 this iteration
    stop: bool = False  # rank 0: every rank leaves its loop after this iteration
    command_bytes: tuple[int, ...] = ()  # rank 0: per rank, the commands it sends there
    incoming_tokens: tuple[int, ...] = ()  # rank 0: per rank, prompt tokens those commands add
    digest: int = 0  # the placement this rank will step under (invariant.BROKEN: its weights do not match it)

    def encode(self, world: int) -> torch.Tensor:
        out = torch.zeros(FIXED_FIELDS + 2 * world, dtype=torch.int64)
        out[:FIXED_FIELDS] = torch.tensor([int(self.work), self.pending_tokens, self.report_bytes, int(self.stop),
                                           self.digest])
        if self.command_bytes:
            out[FIXED_FIELDS:FIXED_FIELDS + world] = torch.tensor(self.command_bytes)
            out[FIXED_FIELDS + world:] = torch.tensor(self.incoming_tokens)
        return out


@dataclass
class Agreement:
    """What every rank reads from the gathered headers (the same on every rank)."""

    headers: np.ndarray  # [world, fields]

    @property
    def world(self) -> int:
        return self.headers.shape[0]

    @property
    def stop(self) -> bool:
        return bool(self.headers[0, STOP])

    def disagreement(self) -> str | None:
        """None when every rank will step under the same placement; else which ranks differ from rank 0."""
        digests = self.headers[:, DIGEST]
        if (digests == digests[0]).all() and digests[0] != BROKEN:
            return None
        broken = [r for r in range(self.world) if digests[r] == BROKEN]
        other = [r for r in range(self.world) if digests[r] != digests[0] and digests[r] != BROKEN]
        parts = [f"rank(s) {broken} hold weights that do not match their placement"] if broken else []
        if other:
            parts.append(f"rank(s) {other} hold a placement other than rank 0's")
        return "; ".join(parts)

    def command_bytes(self, rank: int) -> int:
        return int(self.headers[0, FIXED_FIELDS + rank])

    def incoming_tokens(self, rank: int) -> int:
        return int(self.headers[0, FIXED_FIELDS + self.world + rank])

    def report_bytes(self, rank: int) -> int:
        return int(self.headers[rank, REPORT])

    @property
    def any_work(self) -> bool:
        """Someone steps: a rank has unfinished requests, or commands add some."""
        return bool(self.headers[:, WORK].any()) or bool(self.headers[0, FIXED_FIELDS + self.world:].any())

    def capacity(self, step_budget: int) -> int:
        """The most tokens any rank's step can run: its pending tokens plus what the commands add,
        capped by what one step may schedule."""
        world = self.world
        tokens = self.headers[:, PENDING] + self.headers[0, FIXED_FIELDS + world:FIXED_FIELDS + 2 * world]
        return int(min(int(tokens.max()), step_budget))


class ControlPlane:
    def __init__(self, group, rank: int, world: int):
        self.group, self.rank, self.world = group, rank, world
        self.collectives = 0  # issued so far (tests count them)
        self.seconds = 0.0  # spent in them

    def exchange(self, header: Header, outgoing: dict[int, bytes]) -> tuple[Agreement, dict[int, bytes]]:
        """One iteration's control traffic: the headers, then the announced messages. `outgoing`:
        rank 0 -> {rank: commands}; another rank -> {0: report}. Returns what came in, by sender."""
        start = time.perf_counter()
        mine = header.encode(self.world)
        gathered = torch.empty(self.world * mine.shape[0], dtype=torch.int64)
        dist.all_gather_single(gathered, mine, group=self.group)
        self.collectives += 1
        agreement = Agreement(gathered.view(self.world, -1).numpy())
        if self.rank == 0:
            send = [0] + [len(outgoing.get(r, b"")) for r in range(1, self.world)]
            receive = [0] + [agreement.report_bytes(r) for r in range(1, self.world)]
        else:
            send = [len(outgoing.get(0, b""))] + [0] * (self.world - 1)
            receive = [agreement.command_bytes(self.rank)] + [0] * (self.world - 1)
        incoming: dict[int, bytes] = {}
        everything = int(agreement.headers[:, REPORT].sum()) + int(agreement.headers[0, FIXED_FIELDS:FIXED_FIELDS + self.world].sum())
        if everything:
            payload = b"".join(outgoing.get(r, b"") for r in range(self.world) if send[r])
            out_buf = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else torch.empty(0, dtype=torch.uint8)
            in_buf = torch.empty(sum(receive), dtype=torch.uint8)
            # a rank with nothing to send or receive takes no part in this iteration's messages
            self.collectives += sparse_all_to_all(out_buf, in_buf, send, receive, self.group)
            data, offset = in_buf.numpy().tobytes(), 0
            for r, n in enumerate(receive):
                if n:
                    incoming[r] = data[offset:offset + n]
                    offset += n
        self.seconds += time.perf_counter() - start
        return agreement, incoming
