"""Many multi-rank cases in one launch of rank processes: spawning a rank (a fresh interpreter importing
torch and locus) costs seconds on a 2-core machine, more than a small case's work, so a parametrized
test's cases run in one set of processes, one case after another, each in a process group of its own
(a file rendezvous: no port to pick), and each test then reads its case's files.

A case that raises on a rank writes the traceback to its folder and the ranks go on to the next case;
`failures` gives it to the test of that case, which fails with it."""

from __future__ import annotations

import os
import sys
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# A rank waits this long at a case's rendezvous (while the ranks of a smaller case still run it) and
# in a collective whose peer failed; far above any case's run time here.
RENDEZVOUS_TIMEOUT = timedelta(seconds=300)


def end_rank() -> None:
    """A worker whose results are written leaves without interpreter finalisation, as the server's
    ranks do (locus/server/cli.py): tearing down a gloo rank's C++ threads at exit can abort the
    process ("terminate called without an active exception", about one case in 60 here), which
    would fail a run that already succeeded. An exception never gets here: it still fails the rank."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _rank_main(rank: int, run: Callable, cases: list[tuple[int, tuple]], out: str) -> None:
    torch.set_num_threads(1)
    for index, (world, args) in enumerate(cases):
        if rank >= world:
            continue
        folder = Path(out) / str(index)
        dist.init_process_group("gloo", init_method=f"file://{out}/store{index}", rank=rank, world_size=world,
                                timeout=RENDEZVOUS_TIMEOUT)
        try:
            run(rank, world, *args, out=str(folder))
        except Exception:
            (folder / f"error{rank}.txt").write_text(traceback.format_exc())
        finally:
            dist.destroy_process_group()
    end_rank()


def run_cases(run: Callable, cases: Sequence[tuple[int, tuple]], out: Path) -> list[Path]:
    """Run `run(rank, world, *args, out=folder)` on ranks 0..world-1 of each (world, args) case, in one
    launch of max(world) processes; returns each case's folder (under `out`), in the order given."""
    folders = [out / str(i) for i in range(len(cases))]
    for folder in folders:
        folder.mkdir(parents=True)
    if cases:
        mp.spawn(_rank_main, args=(run, list(cases), str(out)), nprocs=max(w for w, _ in cases), join=True)
    return folders


def failures(folder: Path) -> str:
    """The tracebacks the case's ranks wrote ('' when none failed)."""
    return "\n".join(f"{p.name}:\n{p.read_text()}" for p in sorted(folder.glob("error*.txt")))


def selected_params(request, test_name: str, names: Sequence[str]) -> list[tuple]:
    """The parameter tuples of `test_name`'s cases collected in this session, in collection order (so a
    `-k` run launches only the cases it runs)."""
    seen = []
    for item in request.session.items:
        if getattr(item, "originalname", None) == test_name and item.module is request.module:
            params = tuple(item.callspec.params[n] for n in names)
            if params not in seen:
                seen.append(params)
    return seen
