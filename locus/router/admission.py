"""Which rank each request goes to: the plan's grouper as an expert-parallel server's rank 0 runs it
(locus/routing/grouping/live.py's `live_grouper`: domain tag, else the prompt predictor, else least
loaded; under the stream cap and the plan's attention cap, overflowing to the least-loaded rank), with
the ranks of backends that are down taken out, and every admission and release written to the
assignment log in the order the grouper saw them.

What a request is charged is what rank 0 charges (locus/engine/ep/ranks/driver.py `charge_of`): its
prompt plus n times its output bound, the context limit less the prompt when it has none; a request
with several prompts (a completion's list) is one admission, charged for all of them, with n times
as many streams.
"""

from __future__ import annotations

from dataclasses import dataclass

from locus.routing.grouping.grouper import Grouper
from locus.traces.route_log import RouteLogWriter


@dataclass(frozen=True)
class RoutedRequest:
    """What the grouper is told of one request."""

    request_id: str
    domain: str | None
    prompts: list[list[int]]  # token ids of each prompt
    n: int
    max_tokens: int | None  # None: until the context limit

    def charge(self, max_model_len: int) -> int:
        bound = lambda p: self.max_tokens if self.max_tokens is not None else max(0, max_model_len - len(p))  # noqa: E731
        return sum(len(p) + bound(p) * self.n for p in self.prompts)

    @property
    def streams(self) -> int:
        return self.n * len(self.prompts)


@dataclass(frozen=True)
class Placement:
    rank: int
    how: str  # "tagged", "predicted" or "least-loaded" (AdmissionChoice.how)
    domain: str | None  # the domain that placed it (the tag, or the predicted one)
    overflowed: bool


class Admissions:
    def __init__(self, grouper: Grouper, max_model_len: int, log: RouteLogWriter | None = None):
        self.grouper, self.max_model_len, self.log = grouper, max_model_len, log

    def admit(self, request: RoutedRequest, unavailable=()) -> Placement:
        """Place the request on a rank not in `unavailable` (LocusError: all are)."""
        g = self.grouper
        charge, first = request.charge(self.max_model_len), request.prompts[0]
        rank = g.admit(request.request_id, request.domain, charge, prompt_tokens=len(first), streams=request.streams,
                       prompt_ids=first if not g.knows(request.domain) else None, unavailable=unavailable)
        choice = g.last_choice
        if self.log is not None:
            self.log.admit(request.request_id, rank, choice.domain, choice.how, charge, len(first), request.streams)
        return Placement(rank, choice.how, choice.domain, choice.overflowed)

    def release(self, request_id: str) -> None:
        if request_id in self.grouper.live:
            self.grouper.finish(request_id)
            if self.log is not None:
                self.log.release(request_id)

    def in_flight(self, request_id: str) -> bool:
        return request_id in self.grouper.live
