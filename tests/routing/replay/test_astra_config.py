"""ASTRA-sim configs written beside the Chakra traces (`locus replay --chakra`): the network YAML, the
system and remote-memory JSON, with the keys ASTRA-sim's parsers read (NetworkParser:
topology/npus_count/bandwidth/latency; Sys::initialize_sys; AnalyticalRemoteMemory: memory-type)."""

import json

import numpy as np
import pytest

from locus.cli import main
from locus.errors import LocusError
from locus.routing.plan.topology import Topology
from locus.routing.replay.astra_config import (
    ASTRA_GB,
    AstraNetwork,
    astra_command,
    network_config,
    network_yaml,
    system_config,
    write_astra_configs,
)
from locus.traces.format import TraceMeta
from locus.traces.writer import TraceWriter

yaml = pytest.importorskip("yaml")

NETWORK_KEYS = {"topology", "npus_count", "bandwidth", "latency"}  # NetworkParser::parse_network_config_yml
BASIC_TOPOLOGIES = {"Ring", "FullyConnected", "Switch"}  # NetworkParser::parse_topology_name


def test_two_level_switch_matches_the_plan_topology(tmp_path):
    net = AstraNetwork(intra_gbps=450, inter_gbps=50, intra_latency_ns=250, inter_latency_ns=1000)
    files = write_astra_configs(tmp_path / "et" / "run", Topology(8, 4, 2), net)
    assert files.network == tmp_path / "et" / "run.network.yml"
    doc = yaml.safe_load(files.network.read_text())
    assert set(doc) == NETWORK_KEYS
    assert doc["topology"] == ["Switch", "Switch"]
    assert doc["npus_count"] == [4, 8]  # dimension 0 (fastest-varying address) = GPUs of a node
    # ASTRA-sim's GB is 2**30 bytes; the files carry Locus's 10**9-byte GB/s in that unit
    assert doc["bandwidth"] == pytest.approx([450e9 / ASTRA_GB, 50e9 / ASTRA_GB])
    assert doc["latency"] == [250.0, 1000.0]
    assert all(isinstance(v, float) for v in doc["bandwidth"] + doc["latency"])


def test_dimension_zero_address_is_the_local_gpu():
    """ASTRA-sim's multi-dimensional address puts dimension 0 fastest: rank r -> (r % G, r // G),
    which is Locus's node-major numbering (node r // G), so a tier-1 send to the proxy with the same
    local index crosses dimension 1 only."""
    topo = Topology(3, 4, 1)
    G, N = network_config(topo, AstraNetwork())["npus_count"]
    for r in range(topo.ranks):
        local, node = r % G, r // G
        assert node == topo.node_of(r) and node * G + local == r and node < N


@pytest.mark.parametrize("shape, npus, gbps", [((1, 8), [8], 450.0), ((6, 1), [6], 50.0)])
def test_one_level_topologies_have_one_dimension(shape, npus, gbps):
    doc = network_config(Topology(*shape, 2), AstraNetwork())
    assert doc["topology"] == ["Switch"] and doc["npus_count"] == npus  # the parser refuses a 1-NPU dimension
    assert doc["bandwidth"] == pytest.approx([gbps * 1e9 / ASTRA_GB])
    assert system_config(1)["all-to-all-implementation"] == ["ring"]


def test_single_rank_and_bad_links_are_refused():
    with pytest.raises(LocusError, match="at least two NPUs"):
        network_config(Topology(1, 1, 4), AstraNetwork())
    with pytest.raises(LocusError, match="inter_gbps must be a positive"):
        AstraNetwork(inter_gbps=0)
    with pytest.raises(LocusError, match="intra_latency_ns must be a non-negative"):
        AstraNetwork(intra_latency_ns=float("nan"))


def test_system_and_memory_files(tmp_path):
    files = write_astra_configs(tmp_path / "run", Topology(2, 4, 2), AstraNetwork())
    system = json.loads(files.system.read_text())
    # keys Sys::initialize_sys and CollectiveImplLookup read; one collective entry per dimension
    assert system["scheduling-policy"] in ("LIFO", "FIFO")
    assert system["collective-optimization"] in ("baseline", "localBWAware")
    for key in ("all-reduce-implementation", "all-gather-implementation", "reduce-scatter-implementation",
                "all-to-all-implementation"):
        assert system[key] == ["ring", "ring"]
    for key in ("endpoint-delay", "active-chunks-per-dimension", "preferred-dataset-splits", "local-mem-bw"):
        assert isinstance(system[key], int) and system[key] > 0
    assert system["roofline-enabled"] == 0  # COMP nodes take their duration_micros
    assert json.loads(files.remote_memory.read_text()) == {"memory-type": "NO_MEMORY_EXPANSION"}


def test_yaml_is_flow_lists_like_astra_sims_inputs():
    text = network_yaml(network_config(Topology(2, 4, 2), AstraNetwork()))
    assert "topology: [ Switch, Switch ]" in text and "npus_count: [ 4, 2 ]" in text
    assert all(line.startswith("#") or ": [ " in line for line in text.splitlines())


def test_command_names_every_config(tmp_path):
    files = write_astra_configs(tmp_path / "run", Topology(2, 2, 2), AstraNetwork())
    argv = astra_command("/opt/astra", tmp_path / "run", files, logging_folder=tmp_path / "log")
    assert argv[0] == "/opt/astra"
    flags = dict(a.removeprefix("--").split("=", 1) for a in argv[1:])
    assert flags == {"workload-configuration": str(tmp_path / "run"),  # ASTRA-sim appends .<rank>.et
                     "system-configuration": str(files.system),
                     "remote-memory-configuration": str(files.remote_memory),
                     "network-configuration": str(files.network),
                     "logging-folder": str(tmp_path / "log")}


def _trace(path):
    meta = TraceMeta("toy", num_experts=8, top_k=2, moe_layers=(0, 1), hidden_size=4, dtype_bytes=2)
    rng = np.random.default_rng(0)
    with TraceWriter(path, meta) as writer:
        for i in range(6):
            writer.add_request(f"r{i}", "code", 1, np.stack([rng.permutation(8)[:2] for _ in range(6)]).reshape(3, 2, 2))


def test_cli_writes_configs_beside_the_traces(tmp_path, capsys):
    _trace(tmp_path / "trace")
    prefix = tmp_path / "out" / "run"
    assert main(["replay", str(tmp_path / "trace"), "--plan", "round_robin", "--topology", "2x2", "--slots", "2",
                 "--batch-tokens", "8", "--chakra", str(prefix), "--intra-gbps", "300", "--inter-gbps", "25",
                 "--astra-inter-latency-ns", "2000"]) == 0
    out = capsys.readouterr().out
    doc = yaml.safe_load((tmp_path / "out" / "run.network.yml").read_text())
    assert doc["npus_count"] == [2, 2]
    assert doc["bandwidth"] == pytest.approx([300e9 / ASTRA_GB, 25e9 / ASTRA_GB])
    assert doc["latency"] == [250.0, 2000.0]
    assert (tmp_path / "out" / "run.system.json").exists() and (tmp_path / "out" / "run.memory.json").exists()
    assert "${ASTRA_SIM_BIN:-AstraSim_Analytical_Congestion_Unaware}" in out
    assert f"--workload-configuration={prefix}" in out and f"--network-configuration={prefix}.network.yml" in out
    assert main(["replay", str(tmp_path / "trace"), "--plan", "round_robin", "--topology", "2x2",
                 "--chakra", str(prefix), "--astra-intra-latency-ns", "-1"]) == 2
    assert "intra_latency_ns must be a non-negative" in capsys.readouterr().err
