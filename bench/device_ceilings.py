"""The two ceilings of a device, measured now: memory bandwidth and dense matrix throughput.

Roofline figures (a kernel's share of HBM bandwidth, a decode step against its floor) need the
device's real ceilings, not datasheet numbers, and not a bandwidth taken from many small buffers
(those mostly measure launch overhead and caches). Both are measured on buffers far larger than
the last-level cache:
- bandwidth: a device-to-device copy of a large buffer, counting bytes read plus bytes written
  (the convention of `cudaMemcpy` bandwidth tests); on CPU a plain read (a sum) of a large buffer;
- matmul: a square product of size 8192 on a GPU (1024 on CPU) in the given dtype.

    python bench/device_ceilings.py [--device cuda] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class Ceilings:
    device: str  # the device's name
    bandwidth: float  # bytes per second (read + written)
    matmul_flops: float  # FLOP/s of a large square matmul in `dtype`
    dtype: str

    def to_json(self) -> dict:
        return asdict(self)


def _median_seconds(fn, repeats: int, device: torch.device) -> float:
    """Median time of fn(): CUDA events on a GPU (after a warm-up), the wall clock on CPU."""
    for _ in range(2):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return statistics.median(times)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure_bandwidth(device: torch.device, nbytes: int | None = None) -> float:
    """Bytes per second: a large device-to-device copy (read + write) on a GPU, a large read on CPU."""
    if device.type == "cuda":
        nbytes = nbytes or 2 << 30  # 2 GiB each way: far beyond any L2
        src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
        dst = torch.empty_like(src)
        seconds = _median_seconds(lambda: dst.copy_(src), 10, device)
        return 2 * nbytes / seconds
    nbytes = nbytes or 512 << 20  # beyond the L3 of any machine this runs on
    src = torch.rand(nbytes // 4, dtype=torch.float32)
    return nbytes / _median_seconds(lambda: src.sum(), 5, device)


def measure_matmul(dtype: torch.dtype, device: torch.device) -> float:
    """FLOP/s of an n x n x n product on random data (zeros run faster than real data on some GPUs)."""
    n = 8192 if device.type == "cuda" else 1024
    a = torch.randn(n, n, dtype=dtype, device=device)
    b = torch.randn(n, n, dtype=dtype, device=device)
    return 2 * n ** 3 / _median_seconds(lambda: a @ b, 10, device)


def measure(device: torch.device | str, dtype: torch.dtype = torch.bfloat16) -> Ceilings:
    device = torch.device(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return Ceilings(name, measure_bandwidth(device), measure_matmul(dtype, device), str(dtype).removeprefix("torch."))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args()
    c = measure(args.device, getattr(torch, args.dtype))
    how = "copy, read + write" if args.device.startswith("cuda") else "read"
    print(f"{c.device}: {c.bandwidth / 1e9:,.0f} GB/s ({how}), "
          f"{c.matmul_flops / 1e12:,.1f} TFLOP/s ({c.dtype} matmul)")
    print(json.dumps(c.to_json()))


if __name__ == "__main__":
    main()
