"""The one exception type for bad user input (a file, a flag, a request field).

It sits at the package root, below every layer, so any layer may raise it; the CLI prints its message
as one line without a traceback. (kernels/ and traces/ keep "imports nothing of ours" and raise
ValueError subclasses of their own, which their CLIs report the same way.)
"""


class LocusError(Exception):
    """An error caused by the user's input; the message names the file, tensor or field at fault."""
