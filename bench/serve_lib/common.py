"""What the parts of bench/serve.py share: the program name for messages, and the setup error."""

from __future__ import annotations

PROG = "bench serve"


class BenchError(Exception):
    """A setup problem the user can fix (server unreachable, bad file): one line, exit 2."""
