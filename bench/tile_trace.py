"""A trace made of N copies of another's requests (ids suffixed -c0, -c1, ...): the shape of a 10M-token
planning trace (requests x layers x experts, each request's counts as in the preset) from the 1M-token
preset, written in a minute of file copying where synthesising 10M preset tokens takes tens of CPU
minutes. For memory figures at scale (bench/plan_time.py --trace OUT --tokens 10000000): the plan made on
copies is not a plan for 10M distinct requests.

    python bench/tile_trace.py results/tmp/traces/deepseek-v3-2400-seed0 /tmp/deepseek-v3-x10 --copies 10
"""

from __future__ import annotations

import argparse
import dataclasses

from locus.traces.reader import TraceReader
from locus.traces.writer import TraceWriter

CHUNK_ROWS = 1 << 16  # rows read and written at a time (plain file reads: nothing of the source stays mapped)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("source", help="a trace directory")
    ap.add_argument("out", help="the new trace directory (must not exist)")
    ap.add_argument("--copies", type=int, default=10)
    args = ap.parse_args()
    if args.copies < 1:
        raise SystemExit("--copies must be >= 1")
    reader = TraceReader(args.source, check_ids=False)
    if reader.token_ids is not None or reader.epochs is not None or reader.expert_weights is not None:
        raise SystemExit(f"{args.source}: only expert ids are copied; this trace has token ids, epochs or weights")
    if any(r.admitted is not None or r.rank is not None for r in reader.requests):
        raise SystemExit(f"{args.source}: a recording's ranks and admission order cannot be copied")
    with TraceWriter(args.out, reader.meta) as writer:
        for k in range(args.copies):
            for chunk in reader.iter_chunks(CHUNK_ROWS, copy=True):
                records = [dataclasses.replace(r, id=f"{r.id}-c{k}")
                           for r in reader.requests[chunk.request_start : chunk.request_stop]]
                writer.add_requests(records, chunk.expert_ids)
        print(f"wrote {args.out}: {writer.num_requests:,} requests, {writer.num_tokens:,} tokens")


if __name__ == "__main__":
    main()
