"""A tiny stderr progress line for long CLI runs (no dependency)."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """Call with (done, total); redraws at most every `interval` seconds and once at the end."""

    def __init__(self, label: str, stream: TextIO | None = None, interval: float = 1.0):
        self.label = label
        self.stream = stream or sys.stderr
        self.interval = interval
        self.start = time.monotonic()
        self._last = 0.0

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if done < total and now - self._last < self.interval:
            return
        self._last = now
        elapsed = now - self.start
        pct = 100.0 * done / total if total else 100.0
        eta = f", eta {elapsed / done * (total - done):.0f}s" if 0 < done < total else ""
        end = "\n" if done >= total else ""
        self.stream.write(f"\r{self.label}: {done}/{total} ({pct:.0f}%) {elapsed:.0f}s{eta}   {end}")
        self.stream.flush()
