"""`locus serve` with faults injected into elastic expert parallelism, chosen by LOCUS_TEST_FAULTS
(comma-separated), so that a test can land a loss exactly where it wants one:
- `slow-plan=S`: rank 0's re-planner takes S seconds longer to make a plan (its state stays `planning`);
- `die-joining=I@G`: the rank whose identity is I kills itself (SIGKILL) once generation G's survivors
  are decided (it is one of them), before it joins them: a second loss inside the regroup window;
- `die-in-join=I@G`: the same, later: at the call that joins generation G's process group (torch's own
  rendezvous), every member having said it is ready;
- `bad-refill=I@N`: in its N-th regroup, the rank whose identity is I fills one expert slot with
  another expert's weights: a placement the ranks must not answer with.
Run as `python -m tests.server.elastic_faults serve ...` (running_server's `module`); the ranks that
`--ep-ranks` starts run the same wrapper."""

from __future__ import annotations

import os
import signal
import sys
import time

from locus.cli import main
from locus.engine.ep import elastic, replan

FAULTS = "LOCUS_TEST_FAULTS"


def _faults() -> dict[str, str]:
    return dict(item.split("=", 1) for item in os.environ.get(FAULTS, "").split(",") if "=" in item)


def _identity() -> int:
    return int(os.environ.get("RANK", "0"))


def install() -> None:
    faults = _faults()
    if "slow-plan" in faults:
        delay, decide = float(faults["slow-plan"]), replan.Replanner._decide

        def slow_decide(self, *args, **kwargs):
            time.sleep(delay)
            return decide(self, *args, **kwargs)

        replan.Replanner._decide = slow_decide
    # both hooks are module functions that regroup calls by (store, generation, identity, ...), before
    # and after this ready barrier alike, so a test lands its loss at the same point on any version
    if "die-joining" in faults:
        who, generation = (int(x) for x in faults["die-joining"].split("@"))
        members_of = elastic.rendezvous_members

        def dying_member(store, gen, identity, *args, **kwargs):
            decided = members_of(store, gen, identity, *args, **kwargs)
            if identity == who and gen == generation:
                os.kill(os.getpid(), signal.SIGKILL)
            return decided

        elastic.rendezvous_members = dying_member
    if "die-in-join" in faults:
        who, generation = (int(x) for x in faults["die-in-join"].split("@"))
        join = elastic.join_group

        def dying_join(store, gen, members, identity, *args, **kwargs):
            if identity == who and gen == generation:
                os.kill(os.getpid(), signal.SIGKILL)
            return join(store, gen, members, identity, *args, **kwargs)

        elastic.join_group = dying_join
    if "bad-refill" in faults:
        who, nth = (int(x) for x in faults["bad-refill"].split("@"))
        refill, calls = elastic.refill_experts, []

        def bad_refill(runtime, plan, new_rank, read_experts):
            read = refill(runtime, plan, new_rank, read_experts)
            calls.append(1)
            if _identity() == who and len(calls) == nth:
                held = [int(e) for e in plan.slots[0][new_rank]]
                j = next(j for j in range(1, len(held)) if held[j] != held[0])
                layer = runtime.layers[0]
                layer.gate_up_proj.data[0].copy_(layer.gate_up_proj.data[j])
                layer.down_proj.data[0].copy_(layer.down_proj.data[j])
            return read

        elastic.refill_experts = bad_refill


if __name__ == "__main__":
    install()
    sys.exit(main())
