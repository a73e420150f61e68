"""How `locus serve` starts listening and how it stops.

The listening sockets are bound before the model starts loading, so a busy port or a bad host ends
the command in one line: bound later by uvicorn, the failure would come after the load thread had
started, and uvicorn's `sys.exit` would then run interpreter finalisation under a running C++
thread (an abort). Stopping: SIGTERM drains (requests in flight go on until shortly before
--graceful-timeout), SIGINT interrupts (every open request ends with an error at once), and a
SIGINT while already stopping exits on the spot.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading

import uvicorn

from locus.engine.frontend.async_engine import ShuttingDownError
from locus.listen import ListenError, address, bind_listeners, bound_port  # noqa: F401 (cli.py binds through here)

log = logging.getLogger("locus.server")

INTERRUPT_GRACE_S = 2.0  # after SIGINT: how long the error frames get to reach clients that read slowly
FORCED_EXIT = 130  # a second SIGINT: the shell's code for "interrupted"


def cut_at_deadline(engine, graceful_timeout: float) -> None:
    """Shortly before uvicorn's drain deadline, end every request still running with an error, so
    that each open stream closes with an SSE error frame (and a whole response with a 503) instead
    of being cut mid-body by uvicorn's cancellation."""
    margin = min(1.0, graceful_timeout / 2)
    timer = threading.Timer(max(0.0, graceful_timeout - margin), engine.fail_all,
                            [ShuttingDownError("the server shut down before this request finished")])
    timer.daemon = True
    timer.start()


class LocusServer(uvicorn.Server):
    """uvicorn's server with Locus's start line and signals. Unlike uvicorn's own handler, this one
    does not re-raise the signal after stopping, so a stop that finishes exits 0."""

    def __init__(self, config: uvicorn.Config, state, graceful_timeout: float, children: list):
        super().__init__(config)
        self.locus_state, self.graceful_timeout, self.children = state, graceful_timeout, children
        self.stopped_by: int | None = None  # the signal that stopped the server (None: a load failure, a dead engine)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and sockets:  # uvicorn logs no start line for sockets it is handed
            log.info("running on http://%s (press CTRL+C to quit)",
                     address(self.config.host, bound_port(sockets)))

    def handle_exit(self, sig: int, frame) -> None:
        # Runs on the main thread between two bytecodes of whatever it was doing (the event loop):
        # only flags here; the engine is told in `shutdown`, on the loop, where no lock can be held.
        if self.should_exit:
            if sig == signal.SIGINT:
                self.exit_now()
            return
        engine = self.locus_state.engine
        if engine is not None:
            engine.stop_admitting()
        self.stopped_by = sig
        self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        engine = self.locus_state.engine  # it may have finished loading since the signal
        if engine is not None and self.stopped_by is not None:
            engine.stop_admitting()
            if self.stopped_by == signal.SIGINT:
                engine.fail_all(ShuttingDownError("the server was interrupted (SIGINT) before this request finished"))
                self.config.timeout_graceful_shutdown = min(INTERRUPT_GRACE_S, self.graceful_timeout)
            else:
                cut_at_deadline(engine, self.graceful_timeout)
        await super().shutdown(sockets)

    def exit_now(self) -> None:
        """A second SIGINT: end the ranks and this process on the spot, nothing drained or written."""
        for child in self.children:
            child.kill()
        os.write(2, b"locus: interrupted again: exiting now\n")
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - interrupted in the middle of a write to it: its rest is lost
                pass
        os._exit(FORCED_EXIT)
