"""CPU-time accounting for bench/serve.py (Linux /proc): the machine's, one process's, everyone else's."""

from __future__ import annotations

import os
from pathlib import Path


def machine_busy_seconds() -> float | None:
    """CPU seconds spent busy by the whole machine since boot, from /proc/stat (Linux); None elsewhere."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def others_cpu(busy0: float | None, busy1: float | None, *ours: float | None) -> float | None:
    """What other processes used meanwhile: the machine's busy time less our own processes'."""
    if busy0 is None or busy1 is None or any(v is None for v in ours):
        return None
    return max(0.0, busy1 - busy0 - sum(ours))


def process_cpu_seconds(pid: int) -> float | None:
    """utime + stime of a process, from /proc (Linux); None elsewhere."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
