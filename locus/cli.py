"""The `locus` command: a thin dispatcher over each package's own `cli.py`.

Each package that has subcommands provides `locus/<package>/cli.py` with
`register(subparsers) -> None`, which adds its parsers and sets `func` (a callable taking the parsed
namespace and returning an exit code). Modules are discovered, so a package adds commands without
touching this file. Keep those modules light: import torch and friends inside the handlers.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback
from pathlib import Path

from locus.errors import DEBUG_ENV, LocusError, debug_enabled, one_line

# Lowest layer first; the order only affects --help.
PACKAGES = ("kernels", "traces", "routing", "engine", "training", "server", "router")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="locus",
        description="Locus: serve Llama-4-style MoE models, record and replay expert traces, plan expert placement.",
    )
    parser.add_argument("--debug", action="store_true",
                        help="on an error, show its traceback as well as the one-line message (may stand anywhere "
                             "on the command line)")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    root = Path(__file__).parent
    for package in PACKAGES:
        # look for the file rather than find_spec, which would import the package (and torch) first
        if (root / package / "cli.py").is_file():
            importlib.import_module(f"locus.{package}.cli").register(subparsers)
    return parser


def take_debug_flag(argv: list[str]) -> tuple[list[str], bool]:
    """`--debug` is global: taken out wherever it stands before a `--`, so that every subcommand
    (`plan` hands its arguments to inner parsers) sees the rest unchanged."""
    end = argv.index("--") if "--" in argv else len(argv)
    kept = [a for a in argv[:end] if a != "--debug"] + argv[end:]
    return kept, len(kept) != len(argv)


def main(argv: list[str] | None = None) -> int:
    argv, debug = take_debug_flag(list(sys.argv[1:] if argv is None else argv))
    if debug:
        os.environ[DEBUG_ENV] = "1"  # for the processes a command starts (expert-parallel ranks)
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # noqa: BLE001 - every error is one line; --debug adds the traceback
        from locus.traces.format import TraceFormatError

        bad_input = isinstance(exc, (LocusError, TraceFormatError))
        if debug_enabled():
            traceback.print_exc()
        hint = "" if bad_input or debug_enabled() else " (run with --debug for the traceback)"
        print(f"locus: error: {one_line(exc, (LocusError, TraceFormatError))}{hint}", file=sys.stderr)
        return 2 if bad_input else 1


if __name__ == "__main__":
    sys.exit(main())
