"""What each kind of gloo collective the expert-parallel runtime issues puts on the inter-node link,
framing included: the fixed per-step cost that a shaped link charges on top of the payload.

Two network namespaces joined by a veth pair (bench/ep_network.py's Network), 2 ranks in each as in a
2x2 launch, plain gloo process groups (the control group of all 4 ranks; the tier-1 groups {0, 2}
and {1, 3}; the tier-2 groups of a node). Each collective runs --iterations times between barriers;
ranks 0 and 2 read their link device's tx_bytes before the loop and after a barrier that follows it,
so a row is the bytes one node sends over the link per call (both tier-1 groups run at once, as in
a step; the one barrier adds a few bytes a call).

    sudo python bench/ep_wire.py [--out results/ep_wire.json]

Needs root and `ip netns` (exits 2 without them, as bench/ep_network.py does).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

PROG = "bench/ep_wire.py"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iterations", type=int, default=200)
    p.add_argument("--payload", type=int, default=4096, help="bytes each tier-1 member sends its peer (default 4096)")
    p.add_argument("--out")
    p.add_argument("--rank", type=int, help=argparse.SUPPRESS)  # a worker process (started by the bench itself)
    p.add_argument("--device", help=argparse.SUPPRESS)
    p.add_argument("--master", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=29611, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# --- one rank -------------------------------------------------------------------------------------
def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    rank, dev = args.rank, args.device
    os.environ["GLOO_SOCKET_IFNAME"] = dev
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}:{args.port}", rank=rank, world_size=4,
                            timeout=timedelta(seconds=60))
    tier1 = [dist.new_group([0, 2]), dist.new_group([1, 3])][rank % 2]
    tier2 = [dist.new_group([0, 1]), dist.new_group([2, 3])][rank // 2]
    stats = Path(f"/sys/class/net/{dev}/statistics/tx_bytes")
    rows = []

    def measure(name: str, fn) -> None:
        dist.barrier()
        time.sleep(0.2)  # the barrier's own packets and acknowledgements leave the link
        dist.barrier()
        time.sleep(0.2)
        before = int(stats.read_text())
        for _ in range(args.iterations):
            fn()
        dist.barrier()  # every rank's calls are done (the other tier-1 group's too); a barrier is ~1 KB
        after = int(stats.read_text())
        rows.append({"collective": name, "bytes_per_call": (after - before) / args.iterations})

    header, gathered = torch.zeros(12, dtype=torch.int64), torch.empty(48, dtype=torch.int64)
    empty = torch.empty(0, dtype=torch.uint8)
    report, got = torch.zeros(500, dtype=torch.uint8), torch.empty(1500, dtype=torch.uint8)
    counts, counts_in = torch.zeros(2, dtype=torch.int64), torch.empty(2, dtype=torch.int64)
    rows_out, rows_in = torch.zeros(2 * args.payload, dtype=torch.uint8), torch.empty(2 * args.payload, dtype=torch.uint8)
    measure("control: header all_gather_single (12 int64 a rank, 4 ranks)", lambda: dist.all_gather_single(gathered, header))
    measure("control: messages all_to_all_single, nothing to send (4 ranks)",
            lambda: dist.all_to_all_single(empty, empty, [0] * 4, [0] * 4))

    def reports() -> None:  # ranks 1..3 send rank 0 a 500-byte report
        if rank == 0:
            dist.all_to_all_single(got, empty, [0, 500, 500, 500], [0] * 4)
        else:
            dist.all_to_all_single(empty, report, [0] * 4, [500, 0, 0, 0])
    measure("control: messages all_to_all_single, 500-byte reports to rank 0 (4 ranks)", reports)
    measure("tier 1: counts all_to_all_single (2 int64, 2 ranks)", lambda: dist.all_to_all_single(counts_in, counts, group=tier1))
    measure(f"tier 1: rows all_to_all_single ({args.payload} B each way, 2 ranks)",
            lambda: dist.all_to_all_single(rows_in, rows_out, group=tier1))
    measure("tier 1: rows all_to_all_single (0 B each way, 2 ranks)",
            lambda: dist.all_to_all_single(empty, empty, [0, 0], [0, 0], group=tier1))
    measure("tier 2: all_to_all_single inside a node (2 int64)", lambda: dist.all_to_all_single(counts_in, counts, group=tier2))
    if rank in (0, 2):
        print(json.dumps({"rank": rank, "rows": rows}), flush=True)
    dist.destroy_process_group()


# --- the bench ------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.rank is not None:
        worker(args)
        return 0
    from ep_network import Network, require_namespaces

    require_namespaces(PROG)
    net = Network(2)
    outputs, procs = [], []
    try:
        net.create()
        for rank in range(4):
            node = rank // 2
            cmd = ["ip", "netns", "exec", net.ns(node), sys.executable, str(Path(__file__).resolve()), "--rank", str(rank),
                   "--device", net.device(node), "--master", net.address(0), "--iterations", str(args.iterations),
                   "--payload", str(args.payload)]
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=dict(os.environ, OMP_NUM_THREADS="1")))
        for p in procs:
            out, _ = p.communicate(timeout=600)
            if p.returncode != 0:
                raise SystemExit(f"{PROG}: a rank exited with {p.returncode}")
            outputs += [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    finally:
        for p in procs:  # a rank still running after another failed (or timed out) ends here too
            if p.poll() is None:
                p.kill()
                p.wait()
        net.remove()
    by_rank = {o["rank"]: o["rows"] for o in outputs}
    print(f"bytes a node sends over the inter-node link per call (framing, gloo's protocol and TCP acknowledgements "
          f"included), mean of {args.iterations} calls\n")
    print("| collective | node 0 -> 1 | node 1 -> 0 |")
    print("|---|---|---|")
    for a, b in zip(by_rank[0], by_rank[2]):
        print(f"| {a['collective']} | {a['bytes_per_call']:.0f} | {b['bytes_per_call']:.0f} |")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"bench": "ep_wire", "args": vars(args), "nodes": by_rank}, indent=1) + "\n")
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
