"""What AsyncEngine drives: an engine backend, one process's engine or rank 0 of several.

`AsyncEngine` runs one loop over this interface (apply adds and aborts, step, hand the outputs
over, wait) and never asks which backend it has. Two implement it:
- `LocalBackend` (below): the single-process `EngineCore`;
- `EPDriver` (ep/ranks/driver.py): rank 0 of an expert-parallel server, whose step is one lockstep
  iteration of every rank and whose adds are assigned to a rank.
The hooks past the five verbs (add, abort, step, stats, has_unfinished) are the loop's policy: how
long it may wait, what it does with a failure and at shutdown. `build_engine` (frontend/build.py) makes one.
"""

from __future__ import annotations

from typing import Protocol

from locus.engine.core.engine_core import EngineCore, EngineStats, ValidatedRequest
from locus.engine.core.outputs import RequestOutput

IDLE_POLL_S = 0.5  # an idle single-process engine re-checks its stopping flag this often


class EngineBackend(Protocol):
    core: EngineCore  # this process's engine: tokenizer, validation, recording, calls between steps

    def add(self, request_id: str, request: ValidatedRequest, domain: str | None) -> object:
        """Take a validated request, unchecked (a LocusError refuses it now; `take_refused` refuses it later)."""

    def abort(self, request_id: str) -> RequestOutput | None:
        """Abort a request: its aborted output now, or None when it comes back from a later step."""

    def step(self) -> list[RequestOutput]:
        """Run one step (under expert parallelism, one iteration of every rank): the outputs."""

    def stats(self) -> EngineStats:
        """Counters as of the last step (summed over ranks under expert parallelism)."""

    def has_unfinished(self) -> bool: ...

    def requests(self) -> list[str]:
        """The request ids still in the backend."""

    def wait_s(self) -> float:
        """How long the loop may wait for a command before the next step (0: step now)."""

    def take_refused(self) -> list[tuple[str, str]]:
        """(request id, why) of the requests refused since the last call, after `add` had taken them."""

    def recoverable(self, exc: BaseException) -> bool:
        """Whether the backend may survive the step failure `exc` (`recover` then tries)."""

    def recover(self, exc: BaseException) -> bool:
        """Survive `exc` (elastic EP regroups with the surviving ranks); False when it cannot."""

    def explain(self, exc: BaseException) -> BaseException:
        """The error that ends the engine for `exc`."""

    def close(self) -> list[RequestOutput]:
        """The loop is stopping: end what runs; the outputs of requests aborted on the way."""

    def interrupt(self) -> None:
        """From any thread: the server stops or fails every request, so a long operation under way (an
        elastic regroup) gives up instead of holding the engine thread."""


class LocalBackend:
    """The single-process engine as an engine backend: `EngineCore` does the work; a step with nothing
    to run is not taken, and an idle engine waits for commands (polling for shutdown)."""

    def __init__(self, core: EngineCore):
        self.core = core

    def add(self, request_id: str, request: ValidatedRequest, domain: str | None) -> None:
        self.core.admit(request_id, request, domain)

    def abort(self, request_id: str) -> RequestOutput | None:
        return self.core.abort(request_id)

    def step(self) -> list[RequestOutput]:
        if self.core.has_unfinished():
            return self.core.step()
        # idle: a step still in flight (overlapped) holds only rows of ended requests: let it go
        return self.core.drain()

    def stats(self) -> EngineStats:
        return self.core.stats()

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def requests(self) -> list[str]:
        return list(self.core.requests)

    def wait_s(self) -> float:
        return 0.0 if self.core.has_unfinished() else IDLE_POLL_S

    def take_refused(self) -> list[tuple[str, str]]:
        return []  # add_request refuses at once

    def recoverable(self, exc: BaseException) -> bool:
        return False

    def recover(self, exc: BaseException) -> bool:
        return False

    def explain(self, exc: BaseException) -> BaseException:
        return exc

    def close(self) -> list[RequestOutput]:
        outputs = [self.core.abort(request_id) for request_id in list(self.core.requests)]
        return [out for out in outputs if out is not None]

    def interrupt(self) -> None:
        pass  # a step ends on its own

    @property
    def expert_load(self):
        return self.core.expert_load
