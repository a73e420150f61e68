"""Continuous-batching scheduler: which sequences run in the next step, and with how many tokens.

Each step is either a prefill batch or a decode batch (as vLLM's original scheduler does):
- prefill: sequences with more than one uncomputed token (partially prefilled ones first, then
  waiting ones in arrival order), within `max_num_batched_tokens`; a prompt that does not fit the
  remaining budget is prefilled in chunks over several steps. Waiting sequences first take any
  cached prefix blocks.
- decode: every running sequence whose only uncomputed token is its last sampled one, one token each
  (that token may still be on the device, `Sequence.in_flight`: the overlapped schedule, launched_step.py;
  a sequence whose token in flight is its last, by max_tokens, is not scheduled again).
When the pool runs out of blocks, the most recently admitted running sequence is preempted: its
blocks are freed and it goes back to the front of the queue, to be recomputed (prompt + output so
far) when there is room. Prefills go first when sequences are waiting, which keeps TTFT low.

Forks (the n - 1 extra choices of a request) never allocate: a child takes a reference to every
block of its parent, the partly filled last one included. A sequence about to write into a block
that others still hold gets its own copy first (copy-on-write), and that copy is a block like any
other the decode step needs: it is found by `schedule`, under the same preemption rule, and the
engine performs the batch's `block_copies` before the forward. So only `schedule` ever preempts,
and nothing that was sampled in a step can lose its blocks before the step is over.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

from locus.engine.core.block_manager import BlockManager, chain_hash
from locus.engine.policies.grouping import FirstComeGrouping, GroupingPolicy
from locus.engine.requests.sequence import ScheduledSeq, Sequence, SequenceStatus


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
    micro_batches: list[list[ScheduledSeq]]
    block_copies: list[tuple[int, int]]  # (source, destination) KV blocks to copy before the forward


class Scheduler:
    def __init__(self, blocks: BlockManager, config: SchedulerConfig, grouping: GroupingPolicy | None = None):
        self.blocks, self.config = blocks, config
        self.grouping = grouping or FirstComeGrouping()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order
        self.num_preemptions = 0
        self.num_chunked_prefills = 0  # prefill pieces shorter than what the sequence still needed
        self._admissions = 0
        self._copies: list[tuple[int, int]] = []  # copy-on-write of the step being scheduled

    # --- queue management ---------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Start `child` where `parent` stands, sharing all of its blocks (none is allocated here:
        a shared block is copied when first written, see _grow)."""
        for block in parent.block_table:
            self.blocks.take(block)
        child.block_table = list(parent.block_table)
        child.block_hashes = list(parent.block_hashes)
        child.num_computed = parent.num_computed
        child.status = SequenceStatus.RUNNING
        child.admitted_order = self._next_admission()
        self.running.append(child)

    def finish(self, seq: Sequence) -> None:
        """Release a sequence that finished or was aborted, whatever queue it is in."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq.block_table)
        seq.block_hashes.clear()
        seq.status = SequenceStatus.FINISHED

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
        self._copies: list[tuple[int, int]] = []
        items = self._schedule_prefill() or self._schedule_decode()
        if not items:
            return None
        now = time.monotonic()
        for item in items:
            if item.seq.request.metrics.first_scheduled_time is None:
                item.seq.request.metrics.first_scheduled_time = now
        return ScheduledBatch(self.grouping.group(items, self.config.num_micro_batches), self._copies)

    def _blocks_to_write(self, seq: Sequence, num_tokens: int) -> int:
        """Blocks that writing the next num_tokens needs: new ones, plus one if the first write
        lands in a block shared with another sequence (a fork's tail)."""
        new = self.blocks.blocks_for(seq.num_computed + num_tokens) - len(seq.block_table)
        return new + self._shared_tail(seq)

    def _shared_tail(self, seq: Sequence) -> int:
        first = seq.num_computed // self.blocks.block_size
        return int(first < len(seq.block_table) and self.blocks.ref_count[seq.block_table[first]] > 1)

    def _grow(self, seq: Sequence, num_tokens: int) -> None:
        """Make the next num_tokens writable: copy a shared tail block, allocate the new ones."""
        if self._shared_tail(seq):
            first = seq.num_computed // self.blocks.block_size
            shared, own = seq.block_table[first], self.blocks.allocate()
            self._copies.append((shared, own))
            self.blocks.free([shared])  # drop this sequence's reference; the others keep the block
            seq.block_table[first] = own
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
            if seq.in_flight:  # preempted with a token still on the device: recomputed once it is known
                break
            tokens = seq.prompt_ids + seq.output_ids
            # a cached prefix saves its blocks' compute; keep >= 1 token to compute for the logits
            # (and every prompt token, for a request that wants its prompt scored)
            hit, parent = self.blocks.match_prefix(tokens, 0 if seq.request.needs_prompt_logits else (seq.num_tokens - 1) // bs)
            if self.blocks.blocks_for(seq.num_tokens) - len(hit) > self.blocks.num_free_blocks:
                self.blocks.free(hit)  # wait for blocks to come back
                break
            self.waiting.popleft()
            seq.block_table, seq.num_computed = hit, len(hit) * bs
            if seq.request.num_cached_tokens is None:
                seq.request.num_cached_tokens = seq.num_computed
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
        bs = self.blocks.block_size
        for seq in sorted(self.running, key=lambda s: s.admitted_order):
            # (preempted earlier in this loop: its status is no longer RUNNING)
            if seq.status is not SequenceStatus.RUNNING or seq.num_uncomputed != 1:
                continue
            limit = seq.request.params.max_tokens
            if seq.in_flight and limit is not None and seq.sampling.generated >= limit:
                continue  # its token in flight is its last: nothing more to compute
            if len(chosen) == self.config.max_num_seqs:
                break
            # the common case, first: the token lands in the sequence's own last block
            if seq.num_computed // bs < len(seq.block_table) and not self._shared_tail(seq):
                chosen.append(ScheduledSeq(seq, 1))
                scheduled.add(seq.seq_id)
                continue
            need = self._blocks_to_write(seq, 1)
            if need > self.blocks.num_free_blocks and not self.make_room(need, scheduled | {seq.seq_id}):
                self.preempt(seq)  # nothing else to take from: this one waits
                continue
            self._grow(seq, 1)
            chosen.append(ScheduledSeq(seq, 1))
            scheduled.add(seq.seq_id)
        return chosen
