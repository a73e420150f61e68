"""`locus serve` with one fault injected into the engine step: a step that runs a request whose
prompt contains FAULT raises, as a bug in the forward pass would. Run as
`python -m tests.server.faulty_serve serve ...` (see running_server's `module`)."""

from __future__ import annotations

import sys

from locus.cli import main
from locus.engine.core import engine_core

FAULT = b"inject an engine fault"


def _faulty_step(step):
    def wrapped(self):
        for request in self.requests.values():
            if bytes(t for t in request.prompt_ids if t < 256).find(FAULT) >= 0:
                raise RuntimeError("injected fault in the engine step")
        return step(self)
    return wrapped


if __name__ == "__main__":
    engine_core.EngineCore.step = _faulty_step(engine_core.EngineCore.step)
    sys.exit(main())
