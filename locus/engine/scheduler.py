"""Continuous-batching scheduler: which sequences run in the next step, and with how many tokens.

Each step is either a prefill batch or a decode batch (as vLLM's original scheduler does):
- prefill: sequences with more than one uncomputed token (partially prefilled ones first, then
  waiting ones in arrival order), within `max_num_batched_tokens`; a prompt that does not fit the
  remaining budget is prefilled in chunks over several steps. Waiting sequences first take any
  cached prefix blocks.
- decode: every running sequence whose only uncomputed token is its last sampled one, one token each.
When the pool runs out of blocks, the most recently admitted running sequence is preempted: its
blocks are freed and it goes back to the front of the queue, to be recomputed (prompt + output so
far) when there is room. Prefills go first when sequences are waiting, which keeps TTFT low.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from locus.engine.block_manager import BlockManager, chain_hash
from locus.engine.grouping import FirstComeGrouping, GroupingPolicy, ScheduledSeq
from locus.engine.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    num_micro_batches: int = 1

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1 or self.num_micro_batches < 1:
            raise ValueError("max_num_seqs, max_num_batched_tokens and num_micro_batches must be >= 1")


@dataclass
class ScheduledBatch:
    kind: str  # "prefill" | "decode"
    micro_batches: list[list[ScheduledSeq]]

    @property
    def items(self) -> list[ScheduledSeq]:
        return [i for mb in self.micro_batches for i in mb]

    @property
    def num_tokens(self) -> int:
        return sum(i.num_tokens for i in self.items)


class Scheduler:
    def __init__(self, blocks: BlockManager, config: SchedulerConfig, grouping: GroupingPolicy | None = None):
        self.blocks, self.config = blocks, config
        self.grouping = grouping or FirstComeGrouping()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order
        self.num_preemptions = 0
        self.num_chunked_prefills = 0  # prefill pieces shorter than what the sequence still needed
        self._admissions = 0

    # --- queue management ---------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A forked child: it already holds blocks."""
        seq.status = SequenceStatus.RUNNING
        seq.admitted_order = self._next_admission()
        self.running.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Release a sequence that finished or was aborted, whatever queue it is in."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq.block_table)
        seq.block_hashes.clear()
        seq.status = SequenceStatus.FINISHED

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _next_admission(self) -> int:
        self._admissions += 1
        return self._admissions

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq.block_table)
        seq.block_hashes.clear()
        seq.num_computed = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def make_room(self, blocks_needed: int, protect: set[int]) -> bool:
        """Preempt the latest-admitted running sequences not in `protect` until enough blocks are free."""
        while self.blocks.num_free_blocks < blocks_needed:
            victims = [s for s in self.running if s.seq_id not in protect]
            if not victims:
                return False
            self.preempt(max(victims, key=lambda s: s.admitted_order))
        return True

    # --- scheduling ---------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch | None:
        items = self._schedule_prefill()
        kind = "prefill"
        if not items:
            items, kind = self._schedule_decode(), "decode"
        if not items:
            return None
        now = time.monotonic()
        for item in items:
            if item.seq.request.metrics.first_scheduled_time is None:
                item.seq.request.metrics.first_scheduled_time = now
        return ScheduledBatch(kind, self.grouping.group(items, self.config.num_micro_batches))

    def _grow(self, seq: Sequence, num_tokens: int) -> None:
        need = self.blocks.blocks_for(seq.num_computed + num_tokens) - len(seq.block_table)
        for _ in range(need):
            seq.block_table.append(self.blocks.allocate())

    def _schedule_prefill(self) -> list[ScheduledSeq]:
        budget = self.config.max_num_batched_tokens
        chosen: list[ScheduledSeq] = []
        # 1. admitted sequences whose prefill is unfinished (their blocks were allocated at admission)
        for seq in self.running:
            if budget > 0 and seq.num_uncomputed > 1:
                n = min(seq.num_uncomputed, budget)
                self.num_chunked_prefills += n < seq.num_uncomputed
                chosen.append(ScheduledSeq(seq, n))
                budget -= n
        # 2. new admissions, first come first served. A sequence is admitted only when blocks for all
        # its tokens are free, so an admitted prefill never has to preempt older running sequences.
        bs = self.blocks.block_size
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            tokens = seq.prompt_ids + seq.output_ids
            # a cached prefix saves its blocks' compute; keep >= 1 token to compute for the logits
            hit, parent = self.blocks.match_prefix(tokens, (seq.num_tokens - 1) // bs)
            if self.blocks.blocks_for(seq.num_tokens) - len(hit) > self.blocks.num_free_blocks:
                self.blocks.free(hit)  # wait for blocks to come back
                break
            self.waiting.popleft()
            seq.block_table, seq.num_computed = hit, len(hit) * bs
            seq.block_hashes = self._hashes_of(tokens, len(hit), parent)
            seq.status = SequenceStatus.RUNNING
            seq.admitted_order = self._next_admission()
            self.running.append(seq)
            self._grow(seq, seq.num_uncomputed)
            n = min(seq.num_uncomputed, budget)
            self.num_chunked_prefills += n < seq.num_uncomputed
            chosen.append(ScheduledSeq(seq, n))
            budget -= n
        return chosen

    def _hashes_of(self, tokens: list[int], num_blocks: int, last: int | None) -> list[int]:
        """Chained hashes of the first num_blocks full blocks (match_prefix returns only the last)."""
        hashes: list[int] = []
        parent, bs = None, self.blocks.block_size
        for i in range(num_blocks):
            parent = chain_hash(parent, tuple(tokens[i * bs:(i + 1) * bs]))
            hashes.append(parent)
        assert not hashes or hashes[-1] == last
        return hashes

    def _schedule_decode(self) -> list[ScheduledSeq]:
        chosen: list[ScheduledSeq] = []
        scheduled: set[int] = set()
        for seq in sorted(self.running, key=lambda s: s.admitted_order):
            if seq not in self.running or seq.num_uncomputed != 1:
                continue
            if len(chosen) == self.config.max_num_seqs:
                break
            need = self.blocks.blocks_for(seq.num_computed + 1) - len(seq.block_table)
            if need > self.blocks.num_free_blocks and not self.make_room(need, scheduled | {seq.seq_id}):
                self.preempt(seq)  # nothing else to take from: this one waits
                continue
            self._grow(seq, 1)
            chosen.append(ScheduledSeq(seq, 1))
            scheduled.add(seq.seq_id)
        return chosen
