"""The `locus` command: a thin dispatcher over each package's own `cli.py`.

Each package that has subcommands provides `locus/<package>/cli.py` with
`register(subparsers) -> None`, which adds its parsers and sets `func` (a callable taking the parsed
namespace and returning an exit code). Modules are discovered, so a package adds commands without
touching this file. Keep those modules light: import torch and friends inside the handlers.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from locus.errors import LocusError

# Lowest layer first; the order only affects --help.
PACKAGES = ("kernels", "traces", "routing", "engine", "training", "server")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="locus",
        description="Locus: serve Llama-4-style MoE models, record and replay expert traces, plan expert placement.",
    )
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    root = Path(__file__).parent
    for package in PACKAGES:
        # look for the file rather than find_spec, which would import the package (and torch) first
        if (root / package / "cli.py").is_file():
            importlib.import_module(f"locus.{package}.cli").register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except LocusError as exc:  # a bad input: one clear line, no traceback
        print(f"locus: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
