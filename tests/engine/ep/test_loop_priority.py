"""gloo's event-loop threads at a lower priority (locus/engine/ep/loop_priority.py): `make_groups`
lowers every loop thread its groups started, leaves them alone at 0, and `--ep-loop-nice` refuses a
value it cannot honour. Each check runs in its own process (a process group per process; a thread's
lowered priority cannot be raised back without privileges)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from locus.engine.ep.ranks.launch import setup_from
from locus.errors import LocusError

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread priorities are read from /proc")

PROBE = textwrap.dedent("""
    import json, os, sys, tempfile
    import torch.distributed as dist
    from locus.engine.ep.groups import make_groups

    dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
    groups = make_groups(1, 1, lanes=2, loop_nice=int(sys.argv[1]))
    loops, others = [], []
    for tid in os.listdir("/proc/self/task"):
        name = open(f"/proc/self/task/{tid}/comm").read().strip()
        (loops if name == "gloo_tcp_loop" else others).append(os.getpriority(os.PRIO_PROCESS, int(tid)))
    print(json.dumps({"kept": groups.loop_nice, "loops": loops, "others": others}))
""")


def probe(nice: int) -> dict:
    done = subprocess.run([sys.executable, "-c", PROBE, str(nice)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow  # a subprocess with gloo groups
def test_every_loop_thread_of_the_groups_is_lowered_and_nothing_else():
    seen = probe(11)
    assert seen["kept"] == 11  # kept for a regroup's new groups
    assert len(seen["loops"]) >= 2, "the default group and the new groups run gloo event loops"
    assert set(seen["loops"]) == {11}
    assert set(seen["others"]) == {0}, "the rank's own threads (main, gloo workers) keep their priority"


@pytest.mark.slow  # a subprocess with gloo groups
def test_zero_leaves_the_loop_threads_alone():
    seen = probe(0)
    assert (seen["kept"], set(seen["loops"]), set(seen["others"])) == (0, {0}, {0})


@pytest.mark.parametrize("value", [-1, 20])
def test_a_nice_value_out_of_range_is_refused_by_name(value):
    with pytest.raises(LocusError, match="--ep-loop-nice must be between 0"):
        setup_from(4, 2, 60.0, None, loop_nice=value)
