"""The expert-parallel payload codec on CPU: Payload.encode / decode timed through the torch op chain
and through the C pass (locus/kernels/mx_rows_cpu.c) that replaces it on CPU.

    python bench/payload_codec.py                          # N = 4, 16, 64; H = 256; bfloat16; one thread
    python bench/payload_codec.py --rows 16 --hidden 5120 --formats mxfp8

Each time is the median over --repeat calls (after a warm-up) of `time.thread_time` (CPU time of the
calling thread: a loaded machine inflates it less than wall time), in ms. The C output is checked
byte for byte against the torch path on the timed inputs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from locus.engine.ep.payload import Payload  # noqa: E402
from locus.kernels import mx_rows_cpu  # noqa: E402


def median_ms(fn, repeat: int) -> float:
    for _ in range(5):
        fn()
    times = []
    for _ in range(repeat):
        start = time.thread_time()
        fn()
        times.append(time.thread_time() - start)
    return statistics.median(times) * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", default="4,16,64", help="comma-separated row counts N")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--formats", default="mxfp8,mxint8")
    p.add_argument("--repeat", type=int, default=2000)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if mx_rows_cpu.load_library() is None:
        print("no C compiler: only the torch path exists here", file=sys.stderr)
        return 1
    dtype = getattr(torch, args.dtype)
    library = mx_rows_cpu.load_library
    print(f"H = {args.hidden}, {args.dtype}, {args.threads} torch thread(s); ms of CPU per call (median)")
    print(f"{'format':8} {'N':>4} {'encode torch':>13} {'encode C':>9} {'decode torch':>13} {'decode C':>9}")
    for fmt in args.formats.split(","):
        payload = Payload(args.hidden, dtype, fmt)
        for n in (int(r) for r in args.rows.split(",")):
            x = torch.randn(n, args.hidden, dtype=dtype)
            rows = payload.encode(x)
            times = {}
            for way in ("torch", "C"):
                if way == "torch":  # what Payload takes without the library
                    mx_rows_cpu.load_library = lambda: None
                try:
                    if not torch.equal(payload.encode(x), rows):
                        raise SystemExit(f"{fmt} N={n}: the {way} path wrote other bytes")
                    times[way] = (median_ms(lambda: payload.encode(x), args.repeat),
                                  median_ms(lambda: payload.decode(rows), args.repeat))
                finally:
                    mx_rows_cpu.load_library = library
            print(f"{fmt:8} {n:>4} {times['torch'][0]:>13.3f} {times['C'][0]:>9.3f} "
                  f"{times['torch'][1]:>13.3f} {times['C'][1]:>9.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
