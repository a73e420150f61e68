"""Expert-parallel serving across virtual nodes joined by a shaped network link: decode latency and
throughput of round_robin, eplb and locality (+ grouper) plans, with and without --ep-overlap.

Each virtual node is a Linux network namespace; the nodes are joined by one veth pair whose two
directions are shaped with `tc tbf` (netem is not available on this kernel). One `torchrun` agent per
namespace runs G ranks of `locus serve` (gloo over real TCP, GLOO_SOCKET_IFNAME = the node's link):
traffic between ranks of one node stays on that namespace's own stack, traffic between nodes crosses
the shaped link. Rank 0's HTTP server is reached from here through a second, unshaped veth pair.
The bench creates its namespaces, links and addresses itself and removes them on every exit path
(errors and signals included); no traffic leaves the machine. It needs root and `ip netns`; without
them it says so and exits 2.

Per plan and overlap setting the cluster is started once; the link rate is then changed in place
(`tc qdisc replace`) and, per rate, each workload runs --repeats times (the unshaped link
--unshaped-repeats times, if given):
- `wave`: --streams requests sent at once, --output-len tokens each, greedy (one decode wave);
- `mixed`: --mixed-requests requests arriving as a Poisson process at --mixed-rate per second,
  output lengths cycling 16/32/48/64.
Per run: TPOT p50 / p99, TTFT p50, output tokens per second (client side), the ranks' mean step time
and its split (compute / exchange / control, from /ep/stats), inter-node payload bytes per token, and
the bytes that crossed the link. The figures printed are medians over the repeats. After each
cluster, the trace it recorded is replayed (`locus replay --assign recorded`): the measured inter-node
bytes must equal the replay's, to the byte.

Rates: `--rates auto` (default) runs round_robin unshaped first and picks the three rates at which
the link's own time would be about 25%, 50% and 75% of its decode step (from the bytes one decode
step puts on the link, measured as the difference of a full and a short wave, and the unshaped TPOT);
or give them, e.g. `--rates 20mbit,5mbit,2mbit`. `--bucket packet` shapes with a one-frame token
bucket instead of the default 4 KiB or more: with the default a decode step's small messages, after
the compute between them refills the bucket, cross at line speed, so a slow link costs a decode step
less than a real link of that rate would (docs/formats.md, run 12).

Prompts: a random preset (`small`) is sent synthetic prompt families, which its random router tells
apart by alphabet; a trained model that ships held-out text (`mini`) is sent that text by domain
(`--corpus DIR` for the training corpus' held-out split; the plan is made from other prompts than
the measured ones). For `mini` (8 experts) give `--slots 3`: with 6 slots a node holds every expert.

`--untagged` sends the requests without their domain (as an ordinary client does): a locality
plan's grouper then places them by its prompt predictor.

`--dispatch-format model,mxfp8` runs every plan once per payload format (`--ep-dispatch-format` of the
servers; `D/C` also sets `--ep-combine-format C`, e.g. `mxfp8/mxfp8`): the table's format column, with
each format's inter-node payload bytes per token and decode TPOT (docs/formats.md).

`--pin-nodes` keeps each virtual node on its own share of the cores (taskset), so that one node's
compute cannot fill the time another node's messages spend on the link (by default all ranks share
every core, which real nodes do not).

    sudo python bench/ep_network.py --out results/ep_network.json
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from ep import add_prompt_args, locus, prompt_source, record_planning_trace, step_split, workload
from serve_lib.cpu import machine_busy_seconds, process_cpu_seconds
from serve_lib.domain_text import DomainText
from serve_lib.load import send_request
from serve_lib.table import print_table as markdown_table

PROG = "bench/ep_network.py"
PLANS = ("round_robin", "eplb", "locality")
PAYLOAD_FORMATS = ("model", "mxfp8", "mxint8")  # locus.kernels.formats.PAYLOAD_FORMATS
SHARES = (0.25, 0.5, 0.75)
WARM_UP = 4  # requests a new cluster serves before anything is measured


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="small")
    p.add_argument("--nodes", type=int, default=2, choices=(2,), help="virtual nodes (2: one shaped link)")
    p.add_argument("--gpus-per-node", type=int, default=2, help="ranks per virtual node (default: 2)")
    p.add_argument("--slots", type=int, default=6, help="expert slots per rank, every plan (default: 6)")
    p.add_argument("--plans", default=",".join(PLANS))
    p.add_argument("--pin-nodes", action="store_true",
                   help="run each virtual node on its own CPU cores (taskset; the cores split evenly between the "
                        "nodes): no node's compute can hide another node's wait on the link, as on real machines")
    p.add_argument("--overlap", default="off,on", help="comma-separated: off, on (default: both)")
    p.add_argument("--exchange", default="exact", choices=("exact", "fixed"), help="--ep-exchange of the servers")
    p.add_argument("--dispatch-format", default="model", metavar="F[,F...]",
                   help="payload formats, each a cluster per plan: model, mxfp8, mxint8 (--ep-dispatch-format), or "
                        "DISPATCH/COMBINE to set --ep-combine-format too, e.g. mxfp8/mxfp8 (default: model)")
    p.add_argument("--rates", default="auto", help="'auto', or comma-separated link rates (e.g. 20mbit,5mbit); "
                                                   "'unshaped' is always measured first")
    p.add_argument("--bucket", default="default",
                   help="tbf's bucket on the shaped link: 'default' (10 ms of the rate, at least 4 KiB), 'packet' "
                        "(one frame: every byte after a message's first frame waits for the rate, as on a real "
                        "link) or a byte count")
    p.add_argument("--workloads", default="wave,mixed")
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--output-len", type=int, default=48)
    p.add_argument("--mixed-requests", type=int, default=32)
    p.add_argument("--mixed-rate", type=float, default=4.0, help="mixed workload arrivals per second")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--unshaped-repeats", type=int, default=None, metavar="N",
                   help="repeats of the unshaped link (default: --repeats): the shaped rates' pairs are what a "
                        "paired comparison needs, and an unshaped wave is the quickest to repeat least")
    p.add_argument("--planning-requests", type=int, default=48)
    p.add_argument("--ep-timeout", type=float, default=300.0)
    p.add_argument("--moe-backend", default="auto", help="the servers' --moe-backend (default: auto, the C kernel on CPU)")
    p.add_argument("--untagged", action="store_true", help="send no domain with the requests (tags withheld)")
    p.add_argument("--extra-serve-args", default="", help="more `locus serve` flags, as one string")
    p.add_argument("--server-src", default=None, metavar="DIR",
                   help="run the servers from another checkout of Locus (e.g. a git worktree of an older commit), "
                        "for before/after figures taken with this same harness")
    p.add_argument("--out")
    p.add_argument("--keep", action="store_true")
    add_prompt_args(p)
    return p.parse_args(argv)


# --- the network --------------------------------------------------------------------------------
def run(*cmd: str, check: bool = True) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


def rate_bytes(rate: str) -> int:
    """A tc rate ('5mbit', '800kbit', '1gbit') in bytes per second."""
    units = {"kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8, "bit": 1 / 8}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return int(float(rate[: -len(unit)]) * scale)
    raise SystemExit(f"{PROG}: cannot read the rate {rate!r} (e.g. 5mbit, 800kbit)")


# One Ethernet frame on the veth link (1500 B of MTU, 14 of header) and a little slack: the smallest
# bucket through which tbf passes every packet.
PACKET_BUCKET = 1600


def bucket_bytes(rate: str, bucket: str = "default") -> int:
    """tbf's bucket for `rate`. 'default': 10 ms of the rate, at least 4 KiB (the old rule of thumb
    for a kernel timer of 100 Hz); a step's messages up to that size pass at line speed after an idle
    spell, so on a slow link most decode-step messages cross in no time. 'packet': one frame
    (PACKET_BUCKET), so every message but its first frame waits for the rate, as on a real link of that
    rate; tbf on a high-resolution timer holds the rate with it. A number: that many bytes (at least
    one frame)."""
    check_bucket(bucket)
    if bucket == "default":
        return max(4096, rate_bytes(rate) // 100)
    if bucket == "packet":
        return PACKET_BUCKET
    return int(bucket)


def check_bucket(bucket: str) -> None:
    """Exit with the reason when --bucket is none of 'default', 'packet' or a byte count of a frame or more."""
    if bucket not in ("default", "packet") and (not bucket.isdigit() or int(bucket) < PACKET_BUCKET):
        raise SystemExit(f"{PROG}: --bucket {bucket!r}: give 'default', 'packet' or a byte count of at least "
                         f"{PACKET_BUCKET} (one frame)")


def require_namespaces(prog: str = PROG) -> None:
    """Exit 2 with the reason when this machine cannot build the network."""
    def unable(reason: str) -> None:
        print(f"{prog}: needs {reason}", file=sys.stderr)
        sys.exit(2)

    if os.geteuid() != 0:
        unable("root (network namespaces, veth pairs, tc)")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            unable(f"`{tool}` (iproute2)")
    probe = f"locus-probe-{os.getpid()}"
    try:
        run("ip", "netns", "add", probe)
    except RuntimeError as exc:
        unable(f"network namespaces, which this machine refuses: {exc}")
    run("ip", "netns", "del", probe, check=False)


@dataclass
class Network:
    """Two namespaces on one shaped veth link, plus one unshaped veth from here to node 0 (the client's)."""

    nodes: int = 2
    prefix: str = field(default_factory=lambda: f"lcs{os.getpid() % 100000}")
    base: int = field(default_factory=lambda: 200 + os.getpid() % 50)  # 10.<base>.x.y
    created: list[str] = field(default_factory=list)
    links: list[tuple[str, str]] = field(default_factory=list)  # (namespace, device) shaped egresses
    rate: str | None = None
    bucket: str = "default"  # --bucket: 'default', 'packet' or a byte count

    def ns(self, node: int) -> str:
        return f"{self.prefix}n{node}"

    def address(self, node: int) -> str:
        """The node's address on the inter-node link."""
        return f"10.{self.base}.1.{node + 1}"

    @property
    def client_address(self) -> str:
        return f"10.{self.base}.250.1"

    def device(self, node: int) -> str:
        return f"{self.prefix}l{node}"

    def create(self) -> None:
        for node in range(self.nodes):
            run("ip", "netns", "add", self.ns(node))
            self.created.append(self.ns(node))
            run("ip", "-n", self.ns(node), "link", "set", "lo", "up")
        a, b = self.device(0), self.device(1)
        run("ip", "link", "add", a, "type", "veth", "peer", "name", b)
        for node, dev in ((0, a), (1, b)):
            run("ip", "link", "set", dev, "netns", self.ns(node))
            run("ip", "-n", self.ns(node), "addr", "add", f"{self.address(node)}/24", "dev", dev)
            run("ip", "-n", self.ns(node), "link", "set", dev, "up")
            self.links.append((self.ns(node), dev))
        here, there = f"{self.prefix}c0", f"{self.prefix}c1"
        run("ip", "link", "add", here, "type", "veth", "peer", "name", there)
        run("ip", "link", "set", there, "netns", self.ns(0))
        run("ip", "addr", "add", f"10.{self.base}.250.2/24", "dev", here)
        run("ip", "link", "set", here, "up")
        run("ip", "-n", self.ns(0), "addr", "add", f"{self.client_address}/24", "dev", there)
        run("ip", "-n", self.ns(0), "link", "set", there, "up")
        self.created.append(here)

    def shape(self, rate: str | None) -> None:
        """Shape both directions of the inter-node link to `rate` (a tc rate, e.g. 5mbit); None: unshaped.
        The bucket (`bucket_bytes`) is small, so the link holds its rate even over one step's few
        kilobytes instead of passing them at line speed; the queue is long enough for a whole prefill
        exchange (tbf drops what exceeds it)."""
        for ns, dev in self.links:
            if rate is None:
                run("ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root", check=False)
            else:
                run("ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate,
                    "burst", str(bucket_bytes(rate, self.bucket)), "limit", "16mb")
        self.rate = rate

    def link_bytes(self) -> list[int]:
        """Bytes each node has sent over the inter-node link so far."""
        out = []
        for ns, dev in self.links:
            text = run("ip", "-n", ns, "-s", "link", "show", "dev", dev)
            lines = text.splitlines()
            i = next(k for k, line in enumerate(lines) if line.strip().startswith("TX:"))
            out.append(int(lines[i + 1].split()[0]))
        return out

    def kill_everything(self) -> None:
        for ns in self.created:
            if not ns.startswith(f"{self.prefix}n"):
                continue
            for pid in run("ip", "netns", "pids", ns, check=False).split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass

    def remove(self) -> None:
        self.kill_everything()
        for name in reversed(self.created):
            if name.startswith(f"{self.prefix}n"):
                run("ip", "netns", "del", name, check=False)
            else:
                run("ip", "link", "del", name, check=False)
        self.created.clear()


# --- the cluster -------------------------------------------------------------------------------
@dataclass
class Cluster:
    agents: list[subprocess.Popen]
    base_url: str
    logs: list[Path]


def node_cpus(node: int, args: argparse.Namespace) -> list[str]:
    """The `taskset` prefix that keeps a virtual node on its share of the cores (--pin-nodes), else
    nothing."""
    if not args.pin_nodes:
        return []
    cpus = sorted(os.sched_getaffinity(0))
    per = len(cpus) // args.nodes
    if per == 0:
        raise SystemExit(f"{PROG}: --pin-nodes needs at least one CPU per node ({len(cpus)} CPUs, {args.nodes} nodes)")
    return ["taskset", "-c", ",".join(str(c) for c in cpus[node * per:(node + 1) * per])]


def payload_formats(spec: str) -> list[tuple[str, str]]:
    """'model,mxfp8,mxfp8/mxfp8' -> [(dispatch, combine), ...]."""
    out = []
    for item in (x.strip() for x in spec.split(",")):
        if not item:
            continue
        dispatch, _, combine = item.partition("/")
        for fmt in (dispatch, combine or "model"):
            if fmt not in PAYLOAD_FORMATS:
                raise SystemExit(f"{PROG}: --dispatch-format {item!r}: {fmt!r} is not one of {', '.join(PAYLOAD_FORMATS)}")
        out.append((dispatch, combine or "model"))
    return out


def format_name(fmt: tuple[str, str]) -> str:
    return fmt[0] if fmt[1] == "model" else f"{fmt[0]}/{fmt[1]}"


def start_cluster(net: Network, args: argparse.Namespace, plan: Path, trace: Path, overlap: bool, work: Path, tag: str,
                  fmt: tuple[str, str] = ("model", "model")) -> Cluster:
    port, master = 8000, 29500
    serve = ["-m", "locus.cli", "serve", "--model", args.model, "--plan", str(plan), "--record-trace", str(trace),
             "--moe-backend", args.moe_backend, "--ep-timeout", str(args.ep_timeout), "--host", "0.0.0.0",
             "--port", str(port), "--log-level", "warning"]
    if args.exchange != "exact":
        serve += ["--ep-exchange", args.exchange]
    if overlap:
        serve.append("--ep-overlap")
    if fmt != ("model", "model"):
        serve += ["--ep-dispatch-format", fmt[0], "--ep-combine-format", fmt[1]]
    serve += args.extra_serve_args.split()
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                                            "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"  # one torch thread per rank: the ranks share this machine's cores
    if args.server_src:
        env["PYTHONPATH"] = str(Path(args.server_src).resolve())
    agents, logs = [], []
    for node in range(args.nodes):
        log = work / f"{tag}-node{node}.log"
        cmd = [*node_cpus(node, args), "ip", "netns", "exec", net.ns(node), "env",
               f"GLOO_SOCKET_IFNAME={net.device(node)}", torchrun,
               "--nnodes", str(args.nodes), "--nproc-per-node", str(args.gpus_per_node), "--node-rank", str(node),
               "--master-addr", net.address(0), "--master-port", str(master), *serve]
        with open(log, "wb") as f:
            agents.append(subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                                           cwd=args.server_src or None))
        logs.append(log)
    cluster = Cluster(agents, f"http://{net.client_address}:{port}", logs)
    deadline = time.monotonic() + 600
    with httpx.Client(timeout=5.0, trust_env=False) as client:
        while True:
            if any(a.poll() is not None for a in agents):
                raise RuntimeError(f"an agent exited before the server was ready; see {logs}")
            try:
                if client.get(f"{cluster.base_url}/health").status_code == 200:
                    return cluster
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the cluster did not become healthy; see {logs}")
            time.sleep(0.5)


def rank_zero_pid(agent: subprocess.Popen) -> int | None:
    """The worker torchrun started as RANK=0 (a child of node 0's agent)."""
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            ppid = next(line.split()[1] for line in status.read_text().splitlines() if line.startswith("PPid:"))
            if int(ppid) != agent.pid:
                continue
            environ = (status.parent / "environ").read_bytes().split(b"\0")
        except (OSError, StopIteration):
            continue
        if b"RANK=0" in environ:
            return int(status.parent.name)
    return None


def stop_cluster(cluster: Cluster, grace: float = 180.0) -> int:
    """SIGTERM to rank 0 (it drains, merges the recorded trace, tells the other ranks to stop): every
    rank then exits 0 and so do the agents. Whatever is still running after `grace` is killed."""
    pid = rank_zero_pid(cluster.agents[0])
    if pid is not None:
        os.kill(pid, signal.SIGTERM)
    codes = []
    for agent in cluster.agents:
        try:
            codes.append(agent.wait(grace))
        except subprocess.TimeoutExpired:
            os.killpg(agent.pid, signal.SIGKILL)
            codes.append(agent.wait())
    return max(abs(c) for c in codes)


# --- workloads ---------------------------------------------------------------------------------
@dataclass
class Job:
    family: str
    prompt: str
    output_len: int
    delay: float  # seconds after the run starts


def wave_jobs(args: argparse.Namespace, offset: int, text: DomainText | None) -> list[Job]:
    return [Job(f, p, args.output_len, 0.0) for f, p in workload(args.streams, offset, text=text)]


def unseen_jobs(text: DomainText | None, count: int, output_len: int, skip: int = 0) -> list[Job]:
    """Jobs whose prompts no measured run sends (warm-up, calibration): the planning pool's for text
    (recorded offline, never sent to a cluster), offsets far past the measured ones for the families."""
    pairs = text.take(count, skip, planning=True) if text is not None else workload(count, 80_000 + skip)
    return [Job(f, p, output_len, 0.0) for f, p in pairs]


def mixed_jobs(args: argparse.Namespace, offset: int, seed: int, text: DomainText | None) -> list[Job]:
    import random

    rng = random.Random(seed)
    t, jobs = 0.0, []
    for i, (f, p) in enumerate(workload(args.mixed_requests, offset, text=text)):
        jobs.append(Job(f, p, (16, 32, 48, 64)[i % 4], t))
        t += rng.expovariate(args.mixed_rate)
    return jobs


async def run_jobs(base_url: str, model: str, jobs: list[Job], untagged: bool = False) -> tuple[list, float]:
    """`untagged`: send no domain (tags withheld: the grouper places requests by its prompt predictor)."""
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30.0, sock_read=900.0)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout) as session:
        start = time.perf_counter()

        async def one(job: Job):
            await asyncio.sleep(job.delay)
            body = {"model": model, "prompt": job.prompt, "max_tokens": job.output_len, "temperature": 0,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
                    **({} if untagged else {"domain": job.family})}
            return await send_request(session, f"{base_url}/v1/completions", body, False, None)

        results = await asyncio.gather(*(one(j) for j in jobs))
        return results, time.perf_counter() - start


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    k = (len(values) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def measure(net: Network, cluster: Cluster, model: str, jobs: list[Job], untagged: bool = False) -> dict:
    stats0 = httpx.get(f"{cluster.base_url}/ep/stats", timeout=30).json()
    link0 = net.link_bytes()
    busy0, own0 = machine_busy_seconds(), process_cpu_seconds(os.getpid())
    results, seconds = asyncio.run(run_jobs(cluster.base_url, model, jobs, untagged))
    busy1, own1 = machine_busy_seconds(), process_cpu_seconds(os.getpid())
    stats1 = httpx.get(f"{cluster.base_url}/ep/stats", timeout=30).json()
    link1 = net.link_bytes()
    failed = [r.error for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} requests failed, e.g. {failed[0]}")
    tokens = stats1["tokens"] - stats0["tokens"]
    steps = max(r1["steps"] - r0["steps"] for r0, r1 in zip(stats0["per_rank"], stats1["per_rank"]))
    link = [b - a for a, b in zip(link0, link1)]
    return {
        "tpot_p50_ms": 1e3 * percentile([r.tpot for r in results if r.tpot is not None], 0.5),
        "tpot_p99_ms": 1e3 * percentile([r.tpot for r in results if r.tpot is not None], 0.99),
        "ttft_p50_ms": 1e3 * percentile([r.ttft for r in results], 0.5),
        "out_tok_s": sum(r.output_tokens for r in results) / seconds, "seconds": seconds,
        "inter_per_token": (stats1["inter_node_bytes"] - stats0["inter_node_bytes"]) / max(tokens, 1),
        "wire_per_token": (stats1["wire_bytes"] - stats0["wire_bytes"]) / max(tokens, 1) if "wire_bytes" in stats1 else None,
        "link_bytes_per_step": max(link) / max(steps, 1), "link_bytes": link, "steps": steps,
        **cpu_use(busy0, busy1, own0, own1, seconds, steps),
        **step_split(stats1, stats0),
        "per_rank_ms": per_rank_split(stats1, stats0),
    }


def cpu_use(busy0: float | None, busy1: float | None, own0: float | None, own1: float | None, seconds: float,
            steps: int) -> dict:
    """The machine's CPU during a run: `cpu_busy_cores`, how many cores were busy on average (all of
    them: the cluster's steps are CPU-bound, a lockstep step cannot be shorter than its CPU over the
    cores), and `cpu_ms_per_step`, what every process but this bench's client spent per step (the
    ranks, their agents, the kernel's network stack). Linux /proc; empty elsewhere."""
    if None in (busy0, busy1, own0, own1):
        return {}
    busy = busy1 - busy0
    return {"cpu_busy_cores": busy / seconds, "cpu_ms_per_step": 1e3 * max(0.0, busy - (own1 - own0)) / max(steps, 1)}


def per_rank_split(stats: dict, before: dict) -> list[dict]:
    """Each rank's ms per step in compute / exchange / control: in lockstep the slowest rank's compute
    is every other rank's exchange wait, so this shows which rank a step waits for."""
    rows = []
    for now, then in zip(stats["per_rank"], before["per_rank"]):
        steps = max(now["steps"] - then["steps"], 1)
        row = {part: round(1e3 * (now[f"{part}_s"] - then[f"{part}_s"]) / steps, 2) for part in ("compute", "exchange", "control")}
        for load in ("token_layers", "expert_pairs"):  # own tokens entering an exchange; pairs its experts computed
            if load in now:
                row[load] = now[load] - then[load]
        rows.append(row)
    return rows


def medians(runs: list[dict]) -> dict:
    out = {}
    for key, value in runs[0].items():
        if isinstance(value, (int, float)) and value is not None:
            out[key] = statistics.median(r[key] for r in runs)
    out["runs"] = runs
    return out


def decode_calibration(net: Network, cluster: Cluster, model: str, args: argparse.Namespace, text: DomainText | None,
                       long_wave: dict) -> dict:
    """What one decode step of a wave puts on the link, unshaped: a second, short wave (a quarter of
    the output length, prompts of the same kind that the cluster has not seen) has the long wave's
    prefill and fewer decode steps, so the difference of the two is decode alone. A run's average
    per step would be mostly its prefill's bytes, which decode latency does not pay."""
    short_len = max(2, args.output_len // 4)
    short = measure(net, cluster, model, unseen_jobs(text, args.streams, short_len, skip=WARM_UP), args.untagged)
    long_runs = long_wave["runs"]
    long = min(long_runs, key=lambda r: abs(r["tpot_p50_ms"] - long_wave["tpot_p50_ms"]))
    steps = long["steps"] - short["steps"]
    if steps <= 0:
        raise RuntimeError(f"calibration: the {args.output_len}-token wave took {long['steps']} steps, the "
                           f"{short_len}-token wave {short['steps']}: cannot separate decode from prefill")
    per_step = max(max(b - a, 0) for a, b in zip(short["link_bytes"], long["link_bytes"])) / steps
    cpu = {}
    if "cpu_ms_per_step" in long and "cpu_ms_per_step" in short:  # the same difference, of the machine's CPU
        cpu["decode_cpu_ms_per_step"] = (long["cpu_ms_per_step"] * long["steps"] - short["cpu_ms_per_step"] * short["steps"]) / steps
    return {"decode_link_bytes_per_step": per_step, "decode_step_ms": long_wave["tpot_p50_ms"], **cpu, "short_wave": short,
            "long_wave_steps": long["steps"], "short_wave_steps": short["steps"]}


def auto_rates(calibration: dict) -> list[str]:
    """Rates at which the link's own time would be about 25/50/75% of round_robin's decode step:
    link time X per step with X / (S0 + X) = s, S0 the unshaped decode step (its TPOT p50), X = the
    bytes one decode step puts on the link (per direction, framing and control included) / rate.
    (The unshaped step's own "exchange" share is mostly waiting for other ranks' compute on shared
    cores, not the link, so the share the link adds is what the rates are chosen by.)"""
    step_s = calibration["decode_step_ms"] / 1e3
    per_step = calibration["decode_link_bytes_per_step"]
    rates = []
    for share in SHARES:
        link_s = share / (1 - share) * step_s
        rates.append(f"{max(1, int(8 * per_step / link_s / 1000))}kbit")
    return rates


# --- main --------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    check_bucket(args.bucket)  # a bad --bucket fails before anything is built
    if args.unshaped_repeats is not None and args.unshaped_repeats < 1:
        raise SystemExit(f"{PROG}: --unshaped-repeats {args.unshaped_repeats}: give at least 1 (the unshaped link is "
                         f"always measured first)")
    require_namespaces()
    plans = [p.strip() for p in args.plans.split(",") if p.strip()]
    overlaps = [o.strip() == "on" for o in args.overlap.split(",") if o.strip()]
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    formats = payload_formats(args.dispatch_format)
    if bad := [p for p in plans if p not in PLANS]:
        raise SystemExit(f"{PROG}: unknown plan(s) {bad}")
    if args.rates == "auto" and (plans[0] != "round_robin" or overlaps[0]):
        raise SystemExit(f"{PROG}: --rates auto calibrates on round_robin without overlap: list them first")
    if args.rates == "auto" and "wave" not in workloads:
        raise SystemExit(f"{PROG}: --rates auto calibrates on the wave workload: include it in --workloads")
    if bad := [w for w in workloads if w not in ("wave", "mixed")]:
        raise SystemExit(f"{PROG}: unknown workload(s) {bad}")
    work = Path(tempfile.mkdtemp(prefix="locus-bench-epnet-"))
    net = Network(args.nodes, bucket=args.bucket)
    atexit.register(net.remove)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda s, f: sys.exit(128 + s))  # runs the finally blocks and atexit
    topology = f"{args.nodes}x{args.gpus_per_node}"
    text = prompt_source(args)
    print(f"{PROG}: {args.model} on {topology} ranks ({args.nodes} network namespaces), {args.slots} slots per rank, "
          f"exchange {args.exchange}; prompts: {text.source if text is not None else 'synthetic families'}; "
          f"work dir {work}", flush=True)
    planning = work / "planning-trace"
    record_planning_trace(args.model, planning, args.planning_requests, args.output_len, text=text)
    results, sessions, calibration = [], [], None
    rates = None if args.rates == "auto" else [r.strip() for r in args.rates.split(",") if r.strip() not in ("", "unshaped")]
    try:
        net.create()
        for name in plans:
            plan = work / f"{name}.json"
            locus("plan", str(planning), "--topology", topology, "--slots", str(args.slots), "--planner", name, "-o", str(plan))
            for fmt, overlap in [(f, o) for f in formats for o in overlaps]:
                suffix = "" if fmt == ("model", "model") else "-" + format_name(fmt).replace("/", "-")
                tag = f"{name}{suffix}{'-overlap' if overlap else ''}"
                trace = work / f"{tag}-trace"
                net.shape(None)
                cluster = start_cluster(net, args, plan, trace, overlap, work, tag, fmt)
                try:
                    model = httpx.get(f"{cluster.base_url}/v1/models", timeout=30).json()["data"][0]["id"]
                    asyncio.run(run_jobs(cluster.base_url, model, unseen_jobs(text, WARM_UP, args.output_len)))  # warm-up
                    for index, rate in enumerate([None, *(rates or [])]):  # before calibration: unshaped only
                        results += measure_rate(net, cluster, model, args, name, overlap, rate, index, text, fmt)
                    if rates is None:  # calibrate on the first cluster (round_robin, unshaped)
                        wave = next(r for r in results if r["plan"] == name and r["workload"] == "wave")
                        calibration = decode_calibration(net, cluster, model, args, text, wave)
                        rates = auto_rates(calibration)
                        print(f"a decode step puts {calibration['decode_link_bytes_per_step'] / 1e3:.1f} KB on the link "
                              f"(TPOT {calibration['decode_step_ms']:.1f} ms unshaped); rates at which the link would "
                              f"take ~25/50/75% of round_robin's decode step: {', '.join(rates)}", flush=True)
                        for index, rate in enumerate(rates, start=1):
                            results += measure_rate(net, cluster, model, args, name, overlap, rate, index, text, fmt)
                    final = httpx.get(f"{cluster.base_url}/ep/stats", timeout=30).json()
                finally:
                    net.shape(None)
                    code = stop_cluster(cluster)
                if code != 0:
                    raise RuntimeError(f"{tag}: the cluster exited with {code}; see {cluster.logs}")
                sessions.append(check_replay(work, tag, plan, trace, final, fmt))
    finally:
        net.remove()
    print_table(results)
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"bench": "ep_network", "args": vars(args), "rates": rates, "calibration": calibration, "machine": {
            "cpus": os.cpu_count(), "python": platform.python_version()}, "results": results, "sessions": sessions},
            indent=1) + "\n")
        print(f"wrote {out}")
    ok = all(s["equal"] for s in sessions)
    if ok and not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"kept {work}")
    return 0 if ok else 1


def measure_rate(net: Network, cluster: Cluster, model: str, args: argparse.Namespace, plan: str, overlap: bool,
                 rate: str | None, index: int, text: DomainText | None,
                 fmt: tuple[str, str] = ("model", "model")) -> list[dict]:
    """The workloads at one link rate, --repeats times each. Every run sends prompts this cluster has
    not seen (consecutive request offsets by rate and repeat), so no run's prefill is served from the
    prefix cache of an earlier one (text prompts: until a domain's pool wraps around, which the corpus'
    pools do not in a default run); every plan gets the same prompts at the same rate."""
    net.shape(rate)
    rows = []
    for name in [w.strip() for w in args.workloads.split(",") if w.strip()]:
        runs = []
        repeats = args.unshaped_repeats if rate is None and args.unshaped_repeats is not None else args.repeats
        for repeat in range(repeats):  # the offsets stay --repeats' so that any N sends the same prompts
            offset = (repeat + args.repeats * index) * (args.streams + args.mixed_requests) + \
                (args.streams if name == "mixed" else 0)
            jobs = wave_jobs(args, offset, text) if name == "wave" else mixed_jobs(args, offset, repeat, text)
            runs.append(measure(net, cluster, model, jobs, args.untagged))
        row = {"plan": plan, "format": format_name(fmt), "dispatch_format": fmt[0], "combine_format": fmt[1],
               "overlap": overlap, "rate": rate or "unshaped", "workload": name, "untagged": args.untagged,
               **medians(runs)}
        rows.append(row)
        print(f"{plan} ({row['format']}){' +overlap' if overlap else ''} @ {row['rate']} {name}: TPOT p50 {row['tpot_p50_ms']:.1f} ms, "
              f"{row['out_tok_s']:.0f} tok/s, step {row['step_ms']:.1f} ms (exchange {row['exchange']:.0%}), "
              f"CPU {row.get('cpu_ms_per_step', float('nan')):.1f} ms/step on {row.get('cpu_busy_cores', float('nan')):.2f} busy cores",
              flush=True)
    return rows


def check_replay(work: Path, tag: str, plan: Path, trace: Path, final: dict,
                 fmt: tuple[str, str] = ("model", "model")) -> dict:
    """The cluster's measured bytes (its /ep/stats just before it stopped) against the replay of the
    trace it recorded, in the payload formats it served with: equal, to the byte, or the bench fails."""
    replay = work / f"{tag}-replay.json"
    locus("replay", str(trace), "--plan", str(plan), "--assign", "recorded", "--json", str(replay),
          "--dispatch-format", fmt[0], "--combine-format", fmt[1])
    replayed = json.loads(replay.read_text())
    session = {"tag": tag, "measured": {k: final[k] for k in ("inter_node_bytes", "intra_node_bytes", "tokens")},
               "replayed": {k: replayed[k] for k in ("inter_node_bytes", "intra_node_bytes", "tokens")}}
    session["equal"] = session["measured"] == session["replayed"]
    print(f"{tag}: measured {session['measured']} / replayed {session['replayed']}: "
          f"{'equal' if session['equal'] else 'NOT EQUAL'}", flush=True)
    return session


def print_table(results: list[dict]) -> None:
    head = ("plan", "format", "overlap", "link", "workload", "TPOT p50", "TPOT p99", "TTFT p50", "out tok/s", "step ms",
            "compute", "exchange", "control", "CPU ms/step", "cores busy", "inter B/tok", "link KB/step")
    rows = [(r["plan"], r.get("format", "model"), "on" if r["overlap"] else "off", r["rate"], r["workload"], f"{r['tpot_p50_ms']:.1f}",
             f"{r['tpot_p99_ms']:.1f}", f"{r['ttft_p50_ms']:.0f}", f"{r['out_tok_s']:.1f}", f"{r['step_ms']:.1f}",
             f"{r['compute']:.0%}", f"{r['exchange']:.0%}", f"{r['control']:.0%}",
             f"{r['cpu_ms_per_step']:.1f}" if "cpu_ms_per_step" in r else "-",
             f"{r['cpu_busy_cores']:.2f}" if "cpu_busy_cores" in r else "-", f"{r['inter_per_token']:.0f}",
             f"{r['link_bytes_per_step'] / 1e3:.1f}") for r in results]
    markdown_table(head, rows)


if __name__ == "__main__":
    sys.exit(main())
