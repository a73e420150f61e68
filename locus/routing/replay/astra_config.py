"""ASTRA-sim input files for a replay's Chakra traces: network, system and remote-memory configs.

    write_astra_configs(PREFIX, topology, AstraNetwork(...)) -> AstraFiles
    astra_command(binary, PREFIX, files) -> argv of the analytical backend

`locus replay ... --chakra PREFIX` writes the traces PREFIX.<rank>.et and, beside them,

    PREFIX.network.yml   the plan's topology as ASTRA-sim's analytical network backend reads it
                         (NetworkParser: keys topology, npus_count, bandwidth, latency, one entry per
                         dimension): dimension 0 a Switch over the GPUs of a node (intra-node links),
                         dimension 1 a Switch over the nodes (inter-node links). Ranks are node-major in
                         Locus and dimension 0 varies fastest in ASTRA-sim's multi-dimensional address, so
                         rank r is GPU r % G of node r // G in both. A one-node (or one-GPU-per-node)
                         plan is a single Switch dimension: the parser refuses a dimension of one NPU.
    PREFIX.system.json   Sys::initialize_sys's keys (scheduling-policy, endpoint-delay, collective
                         implementations per dimension, ...). Locus's traces hold only point-to-point
                         COMM_SEND / COMM_RECV and COMP nodes, so the collective settings are inert;
                         roofline-enabled 0 makes a COMP node take its duration_micros.
    PREFIX.memory.json   AnalyticalRemoteMemory's config: memory-type NO_MEMORY_EXPANSION.

Units, as the backend reads them: bandwidth in GB/s of 2**30 bytes (bw_GBps_to_Bpns), latency in ns
per link. Locus's link model counts GB/s as 10**9 bytes, so the files carry gbps * 1e9 / 2**30: the
same bytes per second as the replay's --intra-gbps / --inter-gbps. A Switch dimension charges two
links per message (NPU -> switch -> NPU), so a message sees twice the latency written here.

Which binary: the congestion-unaware analytical backend (AstraSim_Analytical_Congestion_Unaware)
takes the two-dimensional network; the congestion-aware one accepts a single dimension only. Locus's
tier-1 dispatch sends each row to the proxy with the sender's local GPU index, so every inter-node
message crosses dimension 1 only and every intra-node one dimension 0 only: the hierarchical
dispatch maps onto the two dimensions without rerouting.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path

from locus.errors import LocusError
from locus.routing.plan.topology import Topology

ASTRA_GB = 2**30  # bytes in ASTRA-sim's analytical "GB" (bw_GBps_to_Bpns)
REMOTE_MEMORY = {"memory-type": "NO_MEMORY_EXPANSION"}


@dataclass(frozen=True)
class AstraNetwork:
    """Per-link bandwidth (GB/s of 10**9 bytes, Locus's unit) and latency (ns) of the two levels."""

    intra_gbps: float = 450.0  # H100 NVLink 4, per GPU per direction
    inter_gbps: float = 50.0  # one 400 Gb/s NIC per GPU
    intra_latency_ns: float = 250.0
    inter_latency_ns: float = 1000.0

    def __post_init__(self) -> None:
        for name in ("intra_gbps", "inter_gbps"):
            value = getattr(self, name)
            if not 0 < value < float("inf"):
                raise LocusError(f"ASTRA-sim network: {name} must be a positive number, got {value}")
        for name in ("intra_latency_ns", "inter_latency_ns"):
            value = getattr(self, name)
            if not 0 <= value < float("inf"):
                raise LocusError(f"ASTRA-sim network: {name} must be a non-negative number, got {value}")


@dataclass(frozen=True)
class AstraFiles:
    network: Path
    system: Path
    remote_memory: Path


def network_config(topology: Topology, net: AstraNetwork) -> dict:
    """The analytical backend's network config as a dict (keys as NetworkParser reads them)."""
    dims = []  # (npus, GB/s in Locus's unit, latency ns)
    if topology.gpus_per_node > 1:
        dims.append((topology.gpus_per_node, net.intra_gbps, net.intra_latency_ns))
    if topology.nodes > 1:
        dims.append((topology.nodes, net.inter_gbps, net.inter_latency_ns))
    if not dims:
        raise LocusError("ASTRA-sim needs at least two NPUs; the plan's topology has one rank")
    return {
        "topology": ["Switch"] * len(dims),
        "npus_count": [n for n, _, _ in dims],
        "bandwidth": [_astra_gbps(gbps) for _, gbps, _ in dims],
        "latency": [float(lat) for _, _, lat in dims],
    }


def system_config(dims: int) -> dict:
    """Sys::initialize_sys's config for `dims` network dimensions (collective entries: one per dimension)."""
    impl = ["ring"] * dims
    return {
        "scheduling-policy": "LIFO",
        "endpoint-delay": 1,
        "active-chunks-per-dimension": 1,
        "preferred-dataset-splits": 1,
        "all-reduce-implementation": impl,
        "all-gather-implementation": impl,
        "reduce-scatter-implementation": impl,
        "all-to-all-implementation": impl,
        "collective-optimization": "localBWAware",
        "local-mem-bw": 3350,
        "boost-mode": 0,
        "roofline-enabled": 0,
    }


def network_yaml(config: dict) -> str:
    """The network config as YAML flow lists, the layout of ASTRA-sim's own inputs/network/*.yml."""
    lines = ["# ASTRA-sim analytical network, written by locus replay --chakra (locus/routing/replay/astra_config.py)",
             "# dimension 0: GPUs of a node, dimension 1: nodes; bandwidth in GB/s of 2**30 bytes, latency in ns per link"]
    for key in ("topology", "npus_count", "bandwidth", "latency"):
        lines.append(f"{key}: [ {', '.join(_yaml_scalar(v) for v in config[key])} ]")
    return "\n".join(lines) + "\n"


def write_astra_configs(prefix: str | Path, topology: Topology, net: AstraNetwork) -> AstraFiles:
    """Write PREFIX.network.yml, PREFIX.system.json and PREFIX.memory.json; returns their paths."""
    prefix = Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    network = network_config(topology, net)
    files = AstraFiles(network=prefix.parent / f"{prefix.name}.network.yml",
                       system=prefix.parent / f"{prefix.name}.system.json",
                       remote_memory=prefix.parent / f"{prefix.name}.memory.json")
    files.network.write_text(network_yaml(network))
    files.system.write_text(json.dumps(system_config(len(network["topology"])), indent=2) + "\n")
    files.remote_memory.write_text(json.dumps(REMOTE_MEMORY, indent=2) + "\n")
    return files


def astra_command(binary: str | Path, prefix: str | Path, files: AstraFiles,
                  logging_folder: str | Path | None = None) -> list[str]:
    """The analytical backend's argv for the traces PREFIX.<rank>.et (it appends .<rank>.et itself)."""
    argv = [str(binary), f"--workload-configuration={prefix}", f"--system-configuration={files.system}",
            f"--remote-memory-configuration={files.remote_memory}", f"--network-configuration={files.network}"]
    if logging_folder is not None:
        argv.append(f"--logging-folder={logging_folder}")
    return argv


def shell_command(argv: list[str]) -> str:
    return " ".join(shlex.quote(a) for a in argv)


def _astra_gbps(gbps: float) -> float:
    return round(gbps * 1e9 / ASTRA_GB, 6)


def _yaml_scalar(value) -> str:
    return value if isinstance(value, str) else repr(value)
