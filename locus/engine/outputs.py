"""What the engine reports per request after each step (incremental) and at the end."""

from __future__ import annotations

from dataclasses import dataclass, field

from locus.engine.sampling import TokenLogprob
from locus.engine.sequence import RequestMetrics


@dataclass
class CompletionOutput:
    index: int
    text: str  # all output text so far
    token_ids: list[int]  # all output ids so far
    delta_text: str  # new since the previous report
    delta_token_ids: list[int]
    delta_logprobs: list[TokenLogprob] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None  # all so far, when requested
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
