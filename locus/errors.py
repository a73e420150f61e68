"""The one exception type for bad user input (a file, a flag, a request field).

It sits at the package root, below every layer, so any layer may raise it; the CLI prints its message
as one line without a traceback. (kernels/ and traces/ keep "imports nothing of ours" and raise
ValueError subclasses of their own, which their CLIs report the same way.)

`locus --debug` (anywhere on the command line) sets LOCUS_DEBUG=1, which processes the command
starts inherit: where an error would otherwise be reported in one line, its traceback is shown too.
"""

import os

DEBUG_ENV = "LOCUS_DEBUG"


class LocusError(Exception):
    """An error caused by the user's input; the message names the file, tensor or field at fault."""


def debug_enabled() -> bool:
    """`locus --debug`: show tracebacks, not only the one-line error."""
    return os.environ.get(DEBUG_ENV) == "1"


def one_line(exc: BaseException, bad_input: tuple[type, ...] = (LocusError,)) -> str:
    """An error as one line: a bad input's own message (`bad_input` types); anything else named by
    its type too, since its message alone may not say what failed (a bare MemoryError has none)."""
    text = " ".join(str(exc).split())
    if isinstance(exc, bad_input) and text:
        return text
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def forget_frames(exc: BaseException) -> None:
    """Let go of a failure's stack frames (and those of the exceptions it chains): they keep every
    local of the failed calls alive, e.g. a process group whose connections must close for its peers
    to notice (elastic expert parallelism)."""
    import traceback

    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        tb, exc.__traceback__ = exc.__traceback__, None
        if tb is not None:
            traceback.clear_frames(tb)
        exc = exc.__cause__ or exc.__context__
