"""Block sizes for the fused-MoE kernels: a table of tuned configs per expert shape, and a default.

The best tiles depend on the expert shape (E, I, H), the dtype, the GPU, and the batch: a decode batch
gives each expert a handful of rows (small BLOCK_M, wide weight tiles, memory-bound), a prefill batch
gives it hundreds (large square tiles, compute-bound). `bench/tune_moe.py` times candidates on a GPU
and writes one JSON file per (E, I, H, weights, device) under `configs/`, named like
`E128_I8192_H5120_bfloat16_NVIDIA_H200.json`, where the weights field is the float dtype of the
expert weights (and activations), or the narrow format they are held in (`..._fp8_NVIDIA_H200.json`,
`_mxfp8_`, `_mxfp4_`: moe_quantized.py; the bytes per weight change the best tiles):

    {"format": "locus-moe-configs", "version": 2,
     "E": 128, "I": 8192, "H": 5120, "dtype": "bfloat16", "weights": "fp8", "device": "NVIDIA H200",
     "configs": {"1": {"block_m": 16, ..., "split_k": 4}, "64": {...}, "4096": {...}},   # keyed by T
     "provenance": {...}}

("dtype" is the activations' dtype; files written before narrow weights have no "weights" field and
mean weights in that dtype.)

Version 2 added `split_k`; a table whose entries all have split_k 1 is written as version 1 (without
the field), so older readers still load it, and version 1 files load with split_k 1.
A lookup takes the entry whose T is nearest (on a log scale) to the batch's; without a file it falls
back to `default_config`, which is reasonable everywhere and tuned nowhere. Lookups depend only on
shapes (never on routing), so a captured CUDA graph keeps the config it was captured with.
"""

from __future__ import annotations

import functools
import json
import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

CONFIG_DIR = Path(__file__).with_name("configs")
CONFIG_FORMAT = "locus-moe-configs"
CONFIG_VERSIONS = (1, 2)  # 2 added MoeConfig.split_k
GPU_SMS = 132  # streaming multiprocessors the untuned GPU default plans for (H100/H200 SXM)


@dataclass(frozen=True)
class MoeConfig:
    """Meta-parameters of one fused-MoE launch (both GEMMs share BLOCK_M through the align step)."""

    block_m: int = 64
    block_n: int = 64
    block_k: int = 64
    group_m: int = 8  # BLOCK_M-row blocks that share a weight tile in L2 before moving along N
    num_warps: int = 4
    num_stages: int = 3
    # Slices of the reduction dimension run by separate programs (fp32 partial sums, then a reduce
    # pass): spreads a small batch's weight read over every SM (docs/kernels.md). 1 = no split.
    split_k: int = 1

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"{name} must be a power of two >= 16 (tl.dot needs it), got {value}")
        if self.group_m < 1 or self.num_warps < 1 or self.num_stages < 1 or self.split_k < 1:
            raise ValueError(f"group_m, num_warps, num_stages and split_k must be positive: {self}")

    def to_json(self) -> dict:
        data = asdict(self)
        if self.split_k == 1:  # version 1 files have no split_k: keep those entries readable by old code
            del data["split_k"]
        return data

    @classmethod
    def from_json(cls, data: dict) -> "MoeConfig":
        return cls(**{k: int(v) for k, v in data.items()})


def device_name(device: torch.device) -> str:
    """Name used in config file names: the CUDA device's name, or "cpu" (the Triton interpreter)."""
    if device.type == "cuda":
        return _cuda_device_name(torch.cuda.current_device() if device.index is None else device.index)
    return device.type


@functools.lru_cache(maxsize=16)
def _cuda_device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def config_file_name(E: int, I: int, H: int, dtype: torch.dtype | str, device: str) -> str:
    """`dtype`: the float weights' dtype, or the narrow weight format's name ("fp8", "mxfp4", ...)."""
    dtype = dtype if isinstance(dtype, str) else dtype_name(dtype)
    safe_device = re.sub(r"[^A-Za-z0-9.-]+", "_", device)
    return f"E{E}_I{I}_H{H}_{dtype}_{safe_device}.json"


def weights_key(dtype: torch.dtype, weights: str | None) -> str:
    """What a table is keyed by: the narrow weight format, else the (weights' and activations') dtype."""
    return weights if weights and weights != "float" else dtype_name(dtype)


def default_config(num_tokens: int, top_k: int, num_experts: int, dtype: torch.dtype, device: str,
                   I: int | None = None, H: int | None = None) -> MoeConfig:
    """Untuned but sane tiles, chosen by how many rows each expert gets on average.

    With the expert shape (I, H) known, a decode batch that touches too few experts to give every SM
    a tile gets its reduction split (see `decode_split_k`)."""
    if device == "cpu":
        # The interpreter runs programs one by one: fewer, larger tiles are faster; BLOCK_M stays
        # small because padding each expert's run to it is work the interpreter really does.
        return MoeConfig(block_m=16, block_n=64, block_k=64, group_m=1)
    rows_per_expert = num_tokens * top_k / max(num_experts, 1)
    # fp32 tiles take twice the shared memory per pipeline stage.
    block_k = 64 if dtype in (torch.float16, torch.bfloat16) else 32
    if rows_per_expert <= 16:  # decode: weight-bandwidth bound, few rows
        split = 1
        if I and H:
            split = decode_split_k(min(num_experts, num_tokens * top_k), I, H, 64, 2 * block_k)
        return MoeConfig(block_m=16, block_n=64, block_k=2 * block_k, group_m=1, num_warps=4, num_stages=3,
                         split_k=split)
    if rows_per_expert <= 128:
        return MoeConfig(block_m=32, block_n=64, block_k=block_k, group_m=8, num_warps=4, num_stages=4)
    return MoeConfig(block_m=64, block_n=128, block_k=block_k, group_m=8, num_warps=8, num_stages=3)


def decode_split_k(experts: int, I: int, H: int, block_n: int, block_k: int, sms: int = GPU_SMS) -> int:
    """Reduction slices so that the GEMM with fewer output tiles (`experts` x min(I, H) / block_n)
    gives every SM about two programs: one program per SM cannot keep enough loads in flight to
    stream weights at HBM speed. Each slice of either GEMM keeps at least 4 BLOCK_K steps."""
    narrow = min(I, H)
    tiles = max(experts, 1) * -(-narrow // block_n)
    split = 1
    while tiles * split < 2 * sms and narrow // (2 * split * block_k) >= 4 and split < 16:
        split *= 2
    return split


def pick_nearest(table: dict[int, MoeConfig], num_tokens: int) -> MoeConfig:
    """The entry whose token count is nearest on a log scale (ties go to the smaller batch)."""
    target = math.log(max(num_tokens, 1))
    best = min(table, key=lambda t: (abs(math.log(max(t, 1)) - target), t))
    return table[best]


def get_config(
    num_tokens: int,
    top_k: int,
    E: int,
    I: int,
    H: int,
    dtype: torch.dtype,
    device: str,
    config_dir: Path | None = None,
    weights: str | None = None,
) -> MoeConfig:
    """Tuned config for this shape and batch if a table exists, else `default_config`.
    weights: the experts' narrow format (fp8, mxfp8, mxfp4), None for float weights in `dtype`."""
    return _cached_config(num_tokens, top_k, E, I, H, dtype, device, Path(config_dir or CONFIG_DIR),
                          weights_key(dtype, weights))


@functools.lru_cache(maxsize=1024)
def _cached_config(num_tokens: int, top_k: int, E: int, I: int, H: int, dtype: torch.dtype, device: str,
                   config_dir: Path, key: str) -> MoeConfig:
    # Every fused-MoE call looks its config up: keep that off the host's critical path.
    table = load_table(config_dir, config_file_name(E, I, H, key, device))
    if table:
        return pick_nearest(table, num_tokens)
    return default_config(num_tokens, top_k, E, dtype, device, I=I, H=H)


@functools.lru_cache(maxsize=64)
def load_table(config_dir: Path, name: str) -> dict[int, MoeConfig]:
    """Token count -> config from one table file; empty if the file does not exist."""
    path = Path(config_dir) / name
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    if data.get("format") != CONFIG_FORMAT or data.get("version") not in CONFIG_VERSIONS:
        raise ValueError(f"{path}: not a {CONFIG_FORMAT} file of version {' or '.join(map(str, CONFIG_VERSIONS))}")
    try:
        return {int(t): MoeConfig.from_json(c) for t, c in data["configs"].items()}
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"{path}: bad configs entry: {exc}") from exc


def write_table(
    path: Path,
    E: int,
    I: int,
    H: int,
    dtype: torch.dtype,
    device: str,
    table: dict[int, MoeConfig],
    provenance: dict | None = None,
    weights: str | None = None,
) -> Path:
    """Write a table in the format `load_table` reads; `path` is a directory or a file name.
    weights: the narrow weight format the table was tuned for (None: float weights in `dtype`)."""
    path = Path(path)
    key = weights_key(dtype, weights)
    if path.suffix != ".json":
        path = path / config_file_name(E, I, H, key, device)
    path.parent.mkdir(parents=True, exist_ok=True)
    version = 2 if any(c.split_k != 1 for c in table.values()) else 1
    data = {
        "format": CONFIG_FORMAT, "version": version,
        "E": E, "I": I, "H": H, "dtype": dtype_name(dtype), "weights": key, "device": device,
        "configs": {str(t): table[t].to_json() for t in sorted(table)},
        "provenance": provenance or {},
    }
    path.write_text(json.dumps(data, indent=1) + "\n")
    load_table.cache_clear()
    _cached_config.cache_clear()
    return path
