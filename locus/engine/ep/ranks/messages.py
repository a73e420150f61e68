"""What travels on the control plane, and its compact encoding.

Commands go from rank 0 to one rank: the requests assigned to it, the aborts of its requests, and the
moves of requests after their prefill (a request's KV cache then goes from rank to rank directly).
A report goes from a rank to rank 0 after its step: for every request it touched only what is new
(delta text and ids, finish reason; the whole output once, when it finishes), the adds it refused,
its counters, and its expert-load increments. Prompt ids and timings are not sent back: rank 0 keeps
the prompt and measures a request's timings itself, when its tokens arrive (which is what the
client sees). A decode step's report is a few dozen bytes per request, whatever the request's length.
"""

from __future__ import annotations

import pickle
from dataclasses import astuple, dataclass, field

import numpy as np

from locus.engine.core.engine_core import EngineStats, RequestFailedError, ValidatedRequest
from locus.engine.ep.counters import ExchangeCounters, StepTimes
from locus.engine.ep.rebalance.replan import Replan
from locus.engine.core.outputs import CompletionOutput, RequestOutput
from locus.engine.sampling.sampler import SamplingParams
from locus.engine.requests.sequence import RequestMetrics, Resumed


@dataclass
class Add:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    domain: str | None
    resumed: Resumed | None = None  # a lost rank's request: what it had streamed there
    retry: bool = False  # resent after a regroup: the rank may have it already (then it is ignored)

    @property
    def request(self) -> ValidatedRequest:
        """The request as rank 0's engine validated it: an Add is made only of a validated request (EPDriver.add
        takes a ValidatedRequest; a lost rank's request is resent as admitted), and the ranks' engines are alike
        (one EngineConfig: the same vocabulary, context and KV pool), so the rank admits it unchecked."""
        return ValidatedRequest(self.prompt_ids, self.params)


@dataclass
class Move:
    """One side of a request's move after its prefill (docs/planner.md): the source sends its KV cache
    and sampler state to `peer`, the target receives them from `peer`, in the iteration the command
    arrives, before the step. `number`: rank 0's count of moves, the order every rank runs its moves in."""

    request_id: str
    peer: int
    number: int
    retry: bool = False  # resent after a regroup: the target may hold the request already
    tokens: int = 0  # target: the most tokens the request may add to its next step (all of them, if recomputed)


@dataclass
class Commands:
    adds: list[Add] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    send_window: bool = False  # put the routing window in the next report (a re-plan is being made)
    replan: Replan | None = None
    moves_out: list[Move] = field(default_factory=list)  # this rank is the source
    moves_in: list[Move] = field(default_factory=list)  # this rank is the target
    drops: list[str] = field(default_factory=list)  # elastic EP: forget these requests without an output

    def __bool__(self) -> bool:
        return bool(self.adds or self.aborts or self.send_window or self.replan or self.moves_out or self.moves_in
                    or self.drops)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(a.prompt_ids) for a in self.adds) + sum(m.tokens for m in self.moves_in)


@dataclass
class Report:
    outputs: list[tuple]  # compact outputs (pack_output)
    errors: list[tuple[str, str]]  # (request id, message) of adds this rank refused
    stats: EngineStats
    counters: ExchangeCounters
    times: StepTimes
    expert_bytes: int
    load: tuple[np.ndarray, np.ndarray] | None  # expert-load increments: flat [layer * E + expert] index, count
    epochs: dict[int, ExchangeCounters] = field(default_factory=dict)  # counters of each placement epoch
    window: object | None = None  # window.WindowTokens, when rank 0 asked for it
    move: object | None = None  # move.MoveStats of the last or current placement move
    seq: int = 0  # the sender's report number: a report resent after a regroup is recognised (elastic EP)
    prefills: list = field(default_factory=list)  # (request id, flat index, count): prefill signatures completed
    moved: list = field(default_factory=list)  # (request id, KV positions sent; -1: it was not here) per move out


def encode(message) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def decode(data: bytes):
    return pickle.loads(data)


def encode_report(report: Report) -> bytes:
    epochs = {e: astuple(c) for e, c in report.epochs.items()}
    return encode((report.outputs, report.errors, astuple(report.stats), astuple(report.counters),
                   astuple(report.times), report.expert_bytes, report.load, epochs, report.window, report.move,
                   report.seq, report.prefills, report.moved))


def decode_report(data: bytes) -> Report:
    outputs, errors, stats, counters, times, expert_bytes, load, epochs, window, move, seq, prefills, moved = decode(data)
    return Report(outputs, errors, EngineStats(*stats), ExchangeCounters(*counters), StepTimes(*times), expert_bytes,
                  load, {e: ExchangeCounters(*c) for e, c in epochs.items()}, window, move, seq, prefills, moved)


def pack_reports(packed: list[bytes]) -> bytes:
    """One rank's payload to rank 0: its reports (each from encode_report), oldest first."""
    return encode(tuple(packed))


def unpack_reports(data: bytes) -> list[Report]:
    return [decode_report(r) for r in decode(data)]


def pack_output(out: RequestOutput) -> tuple:
    """The part of a step's output rank 0 cannot know: what is new, and the whole output at the end."""
    choices = []
    for c in out.outputs:
        final = (c.text, c.token_ids, c.logprobs) if out.finished else None
        choices.append((c.index, c.delta_text, c.delta_token_ids, c.delta_logprobs or None, c.finish_reason,
                        c.stop_reason, final))
    queued = None
    m = out.metrics
    if out.finished and m.first_scheduled_time is not None:
        queued = m.first_scheduled_time - m.arrival_time
    error = str(out.error) if out.error is not None else None
    return (out.request_id, out.finished, error, choices, out.prompt_logprobs, queued,
            out.num_cached_tokens)


def unpack_output(packed: tuple, prompt_ids: list[int], metrics: RequestMetrics, now: float) -> RequestOutput:
    """A RequestOutput on rank 0, its timings measured there (`metrics` is rank 0's for the request)."""
    request_id, finished, error, choices, prompt_logprobs, queued, num_cached_tokens = packed
    outs = []
    for index, delta_text, delta_ids, delta_logprobs, finish_reason, stop_reason, final in choices:
        text, token_ids, logprobs = final if final is not None else ("", [], None)
        outs.append(CompletionOutput(index=index, text=text, token_ids=token_ids, delta_text=delta_text,
                                     delta_token_ids=delta_ids, delta_logprobs=delta_logprobs or [],
                                     logprobs=logprobs, finish_reason=finish_reason, stop_reason=stop_reason))
    if any(c.delta_token_ids for c in outs) and error is None:
        metrics.note_token(now)
    if finished:
        metrics.finished_time = now
        if queued is not None and metrics.first_scheduled_time is None:
            metrics.first_scheduled_time = metrics.arrival_time + queued
    return RequestOutput(request_id, prompt_ids, outs, finished, metrics,
                         RequestFailedError(error) if error is not None else None, prompt_logprobs,
                         num_cached_tokens)


