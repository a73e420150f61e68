"""Whether one cluster of a `bench/ep_network.py` run decodes faster than others, repeat by repeat.

A cluster's median over a few repeats moves by more than the difference a payload format makes where
the link is not full, and the repeats differ from each other in what they send: every repeat sends
other prompts (other routing, other bytes), the same ones to every cluster at the same rate and repeat
(`measure_rate`). So the repeats pair across clusters, and the difference of a pair holds the prompts
fixed. Per rate and workload, for the subject against each other cluster: the pairs, the subject's
median TPOT p50 and the other's, the median of the paired differences with its distribution-free 95%
interval (order statistics of the differences, from the binomial), how many pairs the subject won,
and the two-sided sign-test p-value. Several JSON files (the same command run again) pool their pairs;
a pair never crosses files.

    python bench/paired_tpot.py RUN.json [RUN2.json ...] --subject locality/mxfp8 \\
        [--against eplb/model,locality/model] [--out OUT.json]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from serve_lib.table import print_table as markdown_table

PROG = "bench/paired_tpot.py"


@dataclass
class Comparison:
    """The subject against one other cluster at one rate and workload, over every pooled pair."""
    rate: str
    workload: str
    against: str
    pairs: int
    subject_median_ms: float
    against_median_ms: float
    median_difference_ms: float  # subject - against: negative = the subject is faster
    interval_ms: tuple[float, float] | None  # 95% for the median difference; None under 6 pairs
    subject_faster: int
    sign_test_p: float


def cluster_name(row: dict) -> str:
    """`plan/format` as the bench's table names a cluster (overlap and untagged runs suffixed)."""
    name = f"{row['plan']}/{row.get('format', 'model')}"
    return name + ("+overlap" if row.get("overlap") else "") + ("+untagged" if row.get("untagged") else "")


def sign_test_p(wins: int, n: int) -> float:
    """Two-sided binomial p-value of `wins` successes in `n` fair trials."""
    if n == 0:
        return 1.0
    k = min(wins, n - wins)
    tail = sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def median_interval(diffs: list[float], level: float = 0.95) -> tuple[float, float] | None:
    """The distribution-free interval for the median of `diffs`: the k-th smallest and k-th largest,
    with k the largest count whose binomial(n, 1/2) lower tail stays under (1 - level) / 2."""
    n = len(diffs)
    ordered = sorted(diffs)
    cdf, k = 0.0, 0
    for i in range(n + 1):
        cdf += math.comb(n, i) / 2 ** n
        if cdf > (1 - level) / 2:
            break
        k = i + 1
    if k == 0:
        return None
    return ordered[k - 1], ordered[n - k]


def load_runs(paths: list[Path]) -> list[dict[tuple[str, str, str], list[float]]]:
    """Per file: (cluster, rate, workload) -> its repeats' TPOT p50 in repeat order."""
    files = []
    for path in paths:
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise SystemExit(f"{PROG}: {path}: {error}")
        if data.get("bench") != "ep_network":
            raise SystemExit(f"{PROG}: {path} is not a bench/ep_network.py result (its 'bench' is {data.get('bench')!r})")
        files.append({(cluster_name(row), row["rate"], row["workload"]): [run["tpot_p50_ms"] for run in row["runs"]]
                      for row in data["results"]})
    return files


def compare(files: list[dict[tuple[str, str, str], list[float]]], subject: str,
            against: list[str]) -> list[Comparison]:
    """Every (rate, workload) the subject ran at, against each named cluster that ran there too."""
    keys = sorted({(rate, workload) for f in files for (name, rate, workload) in f if name == subject})
    if not keys:
        names = sorted({name for f in files for (name, _, _) in f})
        raise SystemExit(f"{PROG}: no cluster {subject!r} in the results (clusters: {', '.join(names)})")
    out = []
    for rate, workload in keys:
        for other in against:
            mine, theirs, diffs = [], [], []
            for f in files:
                a, b = f.get((subject, rate, workload)), f.get((other, rate, workload))
                if a is None or b is None:
                    continue
                if len(a) != len(b):
                    raise SystemExit(f"{PROG}: {subject} and {other} at {rate} {workload} ran {len(a)} and {len(b)} "
                                     "repeats in one file: the repeats do not pair")
                mine += a
                theirs += b
                diffs += [x - y for x, y in zip(a, b)]
            if not diffs:
                continue
            wins = sum(d < 0 for d in diffs)
            decided = sum(d != 0 for d in diffs)
            out.append(Comparison(rate, workload, other, len(diffs), statistics.median(mine), statistics.median(theirs),
                                  statistics.median(diffs), median_interval(diffs), wins, sign_test_p(wins, decided)))
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="+", type=Path, help="bench/ep_network.py --out files (pairs pool across them)")
    p.add_argument("--subject", required=True, help="the cluster in question, as plan/format (e.g. locality/mxfp8)")
    p.add_argument("--against", default=None,
                   help="comma-separated clusters to compare with (default: every other cluster in the results)")
    p.add_argument("--out", type=Path, default=None, help="write the comparisons as JSON")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    files = load_runs(args.results)
    names = sorted({name for f in files for (name, _, _) in f})
    against = [a.strip() for a in args.against.split(",") if a.strip()] if args.against else \
        [n for n in names if n != args.subject]
    if missing := [a for a in against if a not in names]:
        raise SystemExit(f"{PROG}: no cluster {', '.join(map(repr, missing))} in the results (clusters: {', '.join(names)})")
    rows = compare(files, args.subject, against)
    markdown_table(("rate", "workload", f"{args.subject} against", "pairs", "its TPOT p50", "theirs",
                    "median difference", "95% interval", "faster in", "sign test p"),
                   [(c.rate, c.workload, c.against, str(c.pairs), f"{c.subject_median_ms:.1f} ms",
                     f"{c.against_median_ms:.1f} ms", f"{c.median_difference_ms:+.1f} ms",
                     f"{c.interval_ms[0]:+.1f} .. {c.interval_ms[1]:+.1f}" if c.interval_ms else "-",
                     f"{c.subject_faster} of {c.pairs}", f"{c.sign_test_p:.3g}") for c in rows])
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"bench": "paired_tpot", "results": [str(p) for p in args.results],
                                        "subject": args.subject, "comparisons": [asdict(c) for c in rows]},
                                       indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
