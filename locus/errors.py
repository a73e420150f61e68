"""The one exception type for bad user input (a file, a flag, a request field).

It sits at the package root, below every layer, so any layer may raise it; the CLI prints its message
as one line without a traceback. (kernels/ and traces/ keep "imports nothing of ours" and raise
ValueError subclasses of their own, which their CLIs report the same way.)
"""


class LocusError(Exception):
    """An error caused by the user's input; the message names the file, tensor or field at fault."""


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
