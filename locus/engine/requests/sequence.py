"""Requests and their sequences, as the scheduler and engine track them, and a sequence scheduled for a step.

A request with `n` choices has `n` sequences. Only the first exists until the prompt is prefilled;
then it forks, the children sharing the prompt's KV blocks (see EngineCore._fork).

A sequence's tokens are prompt + output. `num_computed` of them have KV in the cache; the rest are
computed by the next scheduled step(s). When all are computed, the last position's logits give the
next token. So a prefill, a chunk of a long prefill, a decode step, and the recompute of a
preempted sequence are the same operation with different token counts.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from locus.engine.sampling.sampler import SamplingParams, SequenceSamplingState, TokenLogprob


@dataclass
class Resumed:
    """Output a request already streamed from another engine (a lost expert-parallel rank's): the
    new engine takes it as the sequence's first output tokens, recomputes their KV with the prompt's
    and goes on, so ids, text, logprobs, penalties, grammar and limits continue where they were."""

    token_ids: list[int]
    logprobs: list[TokenLogprob] = field(default_factory=list)  # empty when none were asked for


class SequenceStatus(enum.Enum):
    WAITING = "waiting"  # holds no KV blocks
    RUNNING = "running"  # holds blocks; prefilling or decoding
    FINISHED = "finished"


@dataclass
class RequestMetrics:
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    inter_token_latencies: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    def note_token(self, now: float) -> None:
        if self.first_token_time is None:
            self.first_token_time = now
        elif self.last_token_time is not None:
            self.inter_token_latencies.append(now - self.last_token_time)
        self.last_token_time = now


@dataclass(eq=False)  # identity: the scheduler's `seq in queue` checks must not compare every field
class Sequence:
    seq_id: int
    request: "Request"
    index: int  # choice index within the request, 0..n-1
    sampling: SequenceSamplingState
    detokenizer: object  # IncrementalDetokenizer
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)  # chained hashes of the registered full blocks
    admitted_order: int = -1  # larger = admitted later (preempted first)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # what the next RequestOutput reports as new
    pending_text: str = ""
    pending_ids: list[int] = field(default_factory=list)
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)

    @property
    def prompt_ids(self) -> list[int]:
        return self.sampling.prompt_ids

    @property
    def output_ids(self) -> list[int]:
        return self.sampling.output_ids

    @property
    def num_tokens(self) -> int:
        """Prompt and output tokens known on the host (not those in flight)."""
        sampling = self.sampling
        return len(sampling.prompt_ids) + len(sampling.output_ids)

    def token_slice(self, start: int, stop: int) -> list[int]:
        p = len(self.prompt_ids)
        if stop <= p:
            return self.prompt_ids[start:stop]
        if start >= p:
            return self.output_ids[start - p:stop - p]
        return self.prompt_ids[start:] + self.output_ids[:stop - p]

    @property
    def last_token(self) -> int:
        """The newest token known on the host (what a decode step feeds the model unless one is in flight)."""
        outputs = self.output_ids
        return outputs[-1] if outputs else self.prompt_ids[-1]

    @property
    def in_flight(self) -> int:
        """Tokens sampled on the device but not yet appended (the overlapped schedule): they follow
        output_ids, and the device, not the host, feeds the newest one to the next step."""
        return self.sampling.in_flight

    @property
    def num_uncomputed(self) -> int:
        """Tokens (those in flight included) whose KV the model has not been asked to compute."""
        sampling = self.sampling
        return len(sampling.prompt_ids) + len(sampling.output_ids) + sampling.in_flight - self.num_computed

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED


@dataclass
class ScheduledSeq:
    """A sequence the scheduler chose for a step, with the tokens it computes in it."""

    seq: Sequence
    num_tokens: int  # tokens computed for it this step


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    domain: str | None = None
    seqs: list[Sequence] = field(default_factory=list)
    forked: bool = False  # True once all n sequences exist
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    error: Exception | None = None  # why the engine failed this request (it is then finished)
    # when params.prompt_logprobs is set: one entry per prompt token scored so far (the first, None)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prompt_logprobs_reported: bool = False  # in an output already (they go with the first and the last)
    # prompt tokens whose KV the prefix cache gave at its first admission (vLLM's num_cached_tokens;
    # a re-admission after preemption does not count: the client's prompt was served once)
    num_cached_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None]  # the first token has no context to be scored from

    @property
    def prompt_positions_scored(self) -> int | None:
        """Prompt positions whose next-token logprob is known (position p scores token p + 1);
        None when no prompt logprobs were asked for."""
        return None if self.prompt_logprobs is None else len(self.prompt_logprobs) - 1

    @property
    def needs_prompt_logits(self) -> bool:
        """Prompt logprobs asked for and not complete: its prompt must be computed, not taken
        from the prefix cache."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_ids)

    @property
    def finished(self) -> bool:
        # Before the fork only the first sequence exists; it can finish early only by abort.
        return bool(self.seqs) and all(s.is_finished for s in self.seqs)
