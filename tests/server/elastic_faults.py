"""`locus serve` with faults injected into elastic expert parallelism, chosen by LOCUS_TEST_FAULTS
(comma-separated), so that a test can land a loss exactly where it wants one:
- `slow-plan=S`: rank 0's re-planner takes S seconds longer to make a plan (its state stays `planning`);
- `die-joining=I@G`: the rank whose identity is I kills itself (SIGKILL) once generation G's survivors
  are decided (it is one of them), before it joins them: a second loss inside the regroup window;
- `die-in-join=I@G`: the same, later: at the call that joins generation G's process group (torch's own
  rendezvous), every member having said it is ready;
- `bad-refill=I@N`: in its N-th regroup, the rank whose identity is I fills one expert slot with
  another expert's weights: a placement the ranks must not answer with;
- `die-moving-out=PATH` / `die-moving-in=PATH` (--ep-moves): in the first move between two ranks
  other than 0, the source (out) / the target (in) kills itself as the request's KV rows are about to
  go / come (the move's header and sampler state have crossed); it first creates PATH (exclusively:
  one rank of the launch dies) and writes into it its identity and the move's peer.
  `die-moving-out-to-0=PATH` / `die-moving-in-from-0=PATH`: the same in the first move whose other
  end is rank 0;
- `die-after-move=PATH` (--ep-moves): once a move between two ranks other than 0 has reached its
  target, a third rank other than 0 kills itself at its next MoE layer (the iteration's step, which
  the target has not finished): both ends survive a loss in the iteration that moved the request.
Run as `python -m tests.server.elastic_faults serve ...` (running_server's `module`); the ranks that
`--ep-ranks` starts run the same wrapper."""

from __future__ import annotations

import os
import signal
import sys
import time

from locus.cli import main
from locus.engine.ep.ranks import migrate
from locus.engine.ep.ranks import elastic
from locus.engine.ep.rebalance import replan

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
    for key, side, peer_is_0 in (("die-moving-out", "out", False), ("die-moving-in", "in", False),
                                 ("die-moving-out-to-0", "out", True), ("die-moving-in-from-0", "in", True)):
        if key in faults:
            _die_moving(side, peer_is_0, faults[key])
    if "die-after-move" in faults:
        _die_after_move(faults["die-after-move"])


def _die_after_move(path: str) -> None:
    from locus.engine.ep import layer

    moved = path + ".moved"  # "source target": a move between them has reached the target
    receive = migrate.RequestMover._receive

    def receiving(self, move):
        out = receive(self, move)
        if move.peer != 0 and _identity() != 0 and move.request_id in self.worker.core.requests:
            with open(moved + ".tmp", "w") as f:
                f.write(f"{move.peer} {_identity()}")
            if not os.path.exists(moved):
                os.replace(moved + ".tmp", moved)
        return out

    migrate.RequestMover._receive = receiving
    if _identity() == 0:
        return

    def check():
        if not os.path.exists(moved) or _identity() in (int(x) for x in open(moved).read().split()):
            return
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return
        os.write(fd, f"{_identity()} {open(moved).read()}".encode())
        os.close(fd)
        os.kill(os.getpid(), signal.SIGKILL)

    for name in ("route_and_exchange", "exchange_nothing"):
        original = getattr(layer.ExpertParallelMoE, name)

        def checked(self, *args, _original=original, **kwargs):
            check()
            return _original(self, *args, **kwargs)

        setattr(layer.ExpertParallelMoE, name, checked)


def _die_moving(side: str, peer_is_0: bool, path: str) -> None:
    """Kill this rank as the rows of its first move `side` whose peer is (`peer_is_0`) or is not rank 0
    are about to go (out) or come (in): migrate.py sends and receives a header, the pickled state, then
    the rows, the only floating-point tensor."""
    if _identity() == 0:  # rank 0 is the server: its loss is not survivable
        return
    import torch.distributed as dist

    method = "_send" if side == "out" else "_receive"
    original, moving = getattr(migrate.RequestMover, method), []

    def tracked(self, move, *args, **kwargs):
        moving[:] = [move]
        try:
            return original(self, move, *args, **kwargs)
        finally:
            moving.clear()

    class DyingDist:
        """torch.distributed as migrate.py sees it, its rows' send or receive fatal."""

        def __getattr__(self, name):
            return getattr(dist, name)

        def _maybe_die(self, tensor):
            if not moving or (moving[0].peer == 0) != peer_is_0 or not tensor.is_floating_point():
                return
            try:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                return  # another rank died already
            os.write(fd, f"{_identity()} {moving[0].peer}".encode())
            os.close(fd)
            os.kill(os.getpid(), signal.SIGKILL)

        def send(self, tensor, *args, **kwargs):
            if side == "out":
                self._maybe_die(tensor)
            return dist.send(tensor, *args, **kwargs)

        def recv(self, tensor, *args, **kwargs):
            if side == "in":
                self._maybe_die(tensor)
            return dist.recv(tensor, *args, **kwargs)

    setattr(migrate.RequestMover, method, tracked)
    migrate.dist = DyingDist()


if __name__ == "__main__":
    install()
    sys.exit(main())
