"""What the engine reports per request after each step (incremental) and at the end."""

from __future__ import annotations

from dataclasses import dataclass, field

from locus.engine.sampling.sampler import TokenLogprob
from locus.engine.requests.sequence import RequestMetrics


@dataclass
class CompletionOutput:
    """One choice. The delta_* fields hold what is new since the request's previous output; the
    whole text, token_ids and logprobs are filled in the request's last output only (finished)."""

    index: int
    text: str  # the whole output text (last output only; "" before)
    token_ids: list[int]  # the whole output ids (last output only; [] before)
    delta_text: str  # new since the previous report
    delta_token_ids: list[int]
    delta_logprobs: list[TokenLogprob] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None  # None: not requested; else all of them in the last output
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    error: Exception | None = None  # set when the request failed (RequestFailedError); finished is True
    # the first and the last output, when asked for: one entry per prompt token (None for the first), as vLLM's
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_cached_tokens: int | None = None  # prompt tokens the prefix cache served (None: not admitted yet)


def merge_outputs(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """One output that reports what both did: `later`'s state with both steps' deltas. A stream
    that fell behind the engine sends one frame for its backlog instead of one per step."""
    merged = []
    for a, b in zip(earlier.outputs, later.outputs, strict=True):
        merged.append(CompletionOutput(
            index=b.index, text=b.text, token_ids=b.token_ids, delta_text=a.delta_text + b.delta_text,
            delta_token_ids=a.delta_token_ids + b.delta_token_ids,
            delta_logprobs=a.delta_logprobs + b.delta_logprobs, logprobs=b.logprobs,
            finish_reason=b.finish_reason, stop_reason=b.stop_reason))
    prompt_logprobs = later.prompt_logprobs if later.prompt_logprobs is not None else earlier.prompt_logprobs
    cached = later.num_cached_tokens if later.num_cached_tokens is not None else earlier.num_cached_tokens
    return RequestOutput(later.request_id, later.prompt_token_ids, merged, later.finished, later.metrics, later.error,
                         prompt_logprobs, cached)
