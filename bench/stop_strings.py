"""What stop strings cost per generated token: the streaming scanner against re-scanning the text.

Worst case for both: every output character is 'a' and the four stop strings are runs of 'b'..'e', so
no suffix of the output ever starts a stop string and every possible prefix length is tried. The
re-scan is what the detokenizer did before issue 41 (the reference definitions `find_stop` and
`partial_stop_length` over the whole decoded text, each token); the scanner is IncrementalDetokenizer
today (ByteTokenizer: one character per token), timed over the whole output.

    python bench/stop_strings.py [--lengths 1000,10000,100000] [--stop-lengths 1000,100000]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def rescan_ms(output: int, stop_length: int, budget_s: float = 2.0) -> float:
    """One token's cost (ms) of the re-scan once the output is `output` characters long."""
    from locus.engine.core.detokenizer import find_stop, partial_stop_length

    stops = tuple(c * stop_length for c in "bcde")
    text, runs, start = "a" * output, 0, time.perf_counter()
    while runs < 3 or (time.perf_counter() - start < budget_s / 10 and runs < 50):
        find_stop(text, stops, start=output - 1)  # nothing held back before this token's character
        partial_stop_length(text, stops)
        runs += 1
        if time.perf_counter() - start > budget_s:
            break
    return (time.perf_counter() - start) / runs * 1e3


def streaming(output: int, stop_length: int) -> tuple[float, float]:
    """(ms a token averaged over the whole output, ms a token over its last 100 tokens)."""
    from locus.engine.checkpoint.tokenizer import ByteTokenizer
    from locus.engine.core.detokenizer import IncrementalDetokenizer, failure_table
    from locus.engine.sampling.sampler import SamplingParams

    failure_table.cache_clear()  # the tables' build counts
    tok = ByteTokenizer(512)
    stops = tuple(c * stop_length for c in "bcde")
    start = time.perf_counter()
    detok = IncrementalDetokenizer(tok, [], SamplingParams(stop=stops))
    for _ in range(output - 100):
        detok.add(97)
    tail = time.perf_counter()
    for _ in range(100):
        detok.add(97)
    end = time.perf_counter()
    assert len(detok.text) == output
    return (end - start) / output * 1e3, (end - tail) / 100 * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="1000,10000,100000", help="output lengths in characters")
    p.add_argument("--stop-lengths", default="1000,100000", help="length of each of the four stop strings")
    p.add_argument("--out", default="results/stop_strings.json")
    args = p.parse_args(argv)
    rows = []
    print(f"{'output chars':>12}{'stop chars':>11}{'re-scan ms/token':>18}{'scanner ms/token':>18}{'scanner last 100':>18}")
    for stop_length in (int(x) for x in args.stop_lengths.split(",")):
        for output in (int(x) for x in args.lengths.split(",")):
            old = rescan_ms(output, stop_length)
            mean, last = streaming(output, stop_length)
            rows.append({"output_chars": output, "stop_chars": stop_length, "rescan_ms_per_token": old,
                         "scanner_ms_per_token": mean, "scanner_last100_ms_per_token": last})
            print(f"{output:>12}{stop_length:>11}{old:>18.3f}{mean:>18.4f}{last:>18.4f}", flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
