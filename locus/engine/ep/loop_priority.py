"""The gloo transport's event-loop threads, run at a lower CPU priority than the ranks' own threads.

Why. gloo's TCP transport reads every socket on an event-loop thread (`gloo_tcp_loop`). When a
message arrives while a rank's own thread holds that connection's lock (it is posting a send or a
receive, which writes a small notification to the same socket), the loop cannot take the lock; it
skips the event and calls `epoll_wait` again, which returns at once (the socket is still readable):
it spins until the lock is free. Where ranks share cores (several ranks per machine, as in the
`ep_network` bench's virtual nodes, or a CPU-only deployment) the spinning loop competes for the
core with the very thread that holds the lock, so the lock is held longer and the loop spins
longer: measured on this project's 2-core machine, 4 ranks of `small` made ~1.1 million
`epoll_wait` calls a second during a decode wave, about a quarter of all CPU time. At a lower
priority the spinning loop yields to the lock holder; when it has real work (a message to read
while its rank waits for it) the rank's own thread is asleep, so it is not starved by its rank.

Threads get their own nice value on Linux (`setpriority` on a thread id); elsewhere nothing is done.
New loop threads (a new process group's device) start at the creator's priority, so this is
applied again after every set of groups is made.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

log = logging.getLogger(__name__)

LOOP_THREAD = "gloo_tcp_loop"


def lower_loop_threads(nice: int) -> int:
    """Set this process's gloo event-loop threads to `nice` (0: leave them); returns how many
    threads now run at that value. A thread that cannot be changed is logged and left as it is."""
    if nice == 0 or not hasattr(os, "setpriority"):
        return 0
    tasks = Path("/proc/self/task")
    if not tasks.is_dir():
        return 0
    lowered = 0
    for task in tasks.iterdir():
        try:
            if (task / "comm").read_text().strip() != LOOP_THREAD:
                continue
            tid = int(task.name)
            if os.getpriority(os.PRIO_PROCESS, tid) != nice:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
            lowered += 1
        except (OSError, ValueError) as exc:  # the thread ended meanwhile, or we may not lower it
            log.debug("could not set the priority of thread %s: %s", task.name, exc)
    return lowered
