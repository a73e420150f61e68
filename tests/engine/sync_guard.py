"""A CPU stand-in for `torch.cuda.set_sync_debug_mode("error")`: record every call our code makes that
would make the host wait for a GPU (read a value back, or size a tensor by its data).

On CPU nothing waits, so the calls are found by intercepting them: Tensor.item / tolist / numpy /
cpu / bool / int / float / index conversions, indexing with a boolean mask, the ops whose output size
depends on the data (nonzero, unique, masked_select, single-argument where, bincount,
repeat_interleave without output_size), and `torch.tensor(values, device=...)` (on a GPU a blocking
copy from pageable memory; host_transfer.to_device is the copy that does not wait). Only calls made
directly from `locus/` count: torch's and Triton's interpreter's own conversions of CPU tensors are
not what a GPU would wait for. A host array read with numpy (never a tensor method) is not a call
here: that is how the engine keeps the host's own values on the host.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import torch

LOCUS = str(Path(__file__).resolve().parents[2] / "locus")

METHODS = ("item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__", "nonzero", "unique")
FUNCTIONS = ("nonzero", "unique", "masked_select", "bincount", "argwhere")


def _is_mask(index) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)


@contextlib.contextmanager
def record_syncs():
    """Yields a list that fills with (what, file:line) for each host-syncing call from locus/."""
    found: list[tuple[str, str]] = []

    def note(what: str) -> None:
        frame = sys._getframe(2)
        if frame.f_code.co_filename.startswith(LOCUS):
            found.append((what, f"{frame.f_code.co_filename}:{frame.f_lineno}"))

    saved = []

    def patch(owner, name, wrapper_of):
        original = getattr(owner, name)
        saved.append((owner, name, original))
        setattr(owner, name, wrapper_of(original))

    def plain(name):
        def wrap(original):
            def wrapper(*args, **kwargs):
                note(name)
                return original(*args, **kwargs)
            return wrapper
        return wrap

    def getitem(original):
        def wrapper(self, index):
            if _is_mask(index):
                note("boolean-mask index")
            return original(self, index)
        return wrapper

    def setitem(original):
        def wrapper(self, index, value):
            if _is_mask(index):
                note("boolean-mask assignment")
            return original(self, index, value)
        return wrapper

    def where(original):
        def wrapper(*args, **kwargs):
            if len(args) + len(kwargs) == 1:
                note("where(condition)")
            return original(*args, **kwargs)
        return wrapper

    def tensor(original):
        def wrapper(*args, **kwargs):
            if kwargs.get("device") is not None:
                note("torch.tensor(..., device=...)")
            return original(*args, **kwargs)
        return wrapper

    def repeat_interleave(original):
        def wrapper(*args, **kwargs):
            repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
            if isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None:
                note("repeat_interleave without output_size")
            return original(*args, **kwargs)
        return wrapper

    try:
        for name in METHODS:
            patch(torch.Tensor, name, plain(f"Tensor.{name}"))
        for name in FUNCTIONS:
            patch(torch, name, plain(f"torch.{name}"))
        patch(torch.Tensor, "__getitem__", getitem)
        patch(torch.Tensor, "__setitem__", setitem)
        patch(torch, "where", where)
        patch(torch, "repeat_interleave", repeat_interleave)
        patch(torch, "tensor", tensor)
        yield found
    finally:
        for owner, name, original in reversed(saved):
            setattr(owner, name, original)
