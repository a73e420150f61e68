"""Does a local launch fit this machine? Checked at start, before the model loads or a rank starts.

`--ep-ranks 16` of `mini` held about 1.3 GB a rank (21 GB of a 24 GB machine) and another process met
the OOM killer: N ranks each allocate a whole KV pool, so the flags alone can ask for more memory than
the machine has. On CPU every rank's pool, weights and interpreter come out of the machine's RAM; the
estimate below is compared with MemAvailable and the launch refused, in one line with its figures.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from locus.errors import LocusError

# RSS of an idle `locus serve --model mini --kv-cache-memory 16MiB` on CPU (446 MiB measured, torch
# 2.13, Python 3.12), less its pool and its 14 MB of weights: the interpreter, torch and the server.
PROCESS_OVERHEAD_BYTES = 416 << 20


@dataclass(frozen=True)
class LaunchMemory:
    ranks: int
    kv_bytes: int  # one rank's pool
    weight_bytes: int  # one rank's weights: the dense ones and its round-robin share of the experts

    @property
    def per_rank(self) -> int:
        return self.kv_bytes + self.weight_bytes + PROCESS_OVERHEAD_BYTES

    @property
    def total(self) -> int:
        return self.ranks * self.per_rank


def mem_available(meminfo: str = "/proc/meminfo") -> int | None:
    """The kernel's estimate of memory a new process can take without swapping; None off Linux."""
    try:
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def launch_memory(model: str, dtype: str | None, kv_cache_memory: int, num_kv_blocks: int | None,
                  block_size: int, ranks: int) -> LaunchMemory:
    """What each of `ranks` local processes will hold, from the model's config (no weight is read)."""
    import torch

    from locus.engine.checkpoint.loader import config_of
    from locus.engine.checkpoint.weights import resolve_dtype
    from locus.engine.model.kv_cache import PagedKVCache
    from locus.engine.model.model import Llama4ForCausalLM

    config = config_of(model)
    torch_dtype = resolve_dtype(dtype or config.dtype)  # as the loader resolves it
    elem = torch.tensor([], dtype=torch_dtype).element_size()
    with torch.device("meta"):  # shapes only: nothing is allocated
        params = dict(Llama4ForCausalLM(config).named_parameters())
    experts = sum(p.numel() for name, p in params.items() if ".experts." in name)
    dense = sum(p.numel() for p in params.values()) - experts
    share = math.ceil(config.num_local_experts / ranks) / config.num_local_experts
    per_block = PagedKVCache.bytes_per_block(config, block_size, torch_dtype)
    kv = num_kv_blocks * per_block if num_kv_blocks is not None else kv_cache_memory // per_block * per_block
    return LaunchMemory(ranks, kv, int((dense + experts * share) * elem))


def gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def check_fits(need: LaunchMemory, available: int | None) -> None:
    """Refuse a launch whose processes would hold more than the machine has free, with the figures."""
    if available is None or need.total <= available:
        return
    what = f"{need.ranks} ranks x {gib(need.per_rank)}" if need.ranks > 1 else gib(need.per_rank)
    raise LocusError(f"the server needs about {gib(need.total)} of memory ({what}: a KV pool of {gib(need.kv_bytes)}, "
                     f"weights of {gib(need.weight_bytes)}, {gib(PROCESS_OVERHEAD_BYTES)} per process) but "
                     f"{gib(available)} is available (MemAvailable); lower --kv-cache-memory (or --num-kv-blocks) "
                     f"or --ep-ranks")
