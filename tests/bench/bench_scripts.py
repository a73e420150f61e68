"""Run a bench/ script as its own process, the way a user does, and return its stdout."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def run_bench(script: str, *args: str, timeout: float = 600) -> str:
    """`timeout` only ends a hung script: make test runs these beside another test worker, and a script
    that compiles (profile_decode.py) takes minutes on a busy 2-core machine."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, str(BENCH / script), *args], capture_output=True, text=True,
                          env=env, timeout=timeout)
    assert done.returncode == 0, done.stderr
    return done.stdout
