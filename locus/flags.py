"""Range checks for numeric command-line flags, in one place and one wording.

No torch here: `locus serve` checks every number it is given before it imports torch, loads a model or
starts a rank, so a flag that would make a useless server (a negative context, a zero queue, a NaN
timeout) is one line and exit code 2 at once. A refusal reads `FLAG must be RANGE, not VALUE`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from locus.errors import LocusError

_UNITS = {"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9, "b": 1, "": 1}


def parse_memory(value: str | int) -> int:
    """'512MiB', '2GiB', '1.5GB', '1000000' -> bytes."""
    if isinstance(value, int):
        return value
    text = value.strip().lower()
    number = text.rstrip("kmgib")
    try:
        return int(float(number) * _UNITS[text[len(number):]])
    except (ValueError, KeyError, OverflowError):  # nan, inf
        raise LocusError(f"cannot read memory size {value!r} (examples: 512MiB, 2GiB, 1000000)") from None


def check_range(flag: str, value: float | int | None, low: float, high: float | None = None, *,
                positive: bool = False, unit: str = "") -> None:
    """Refuse `value` outside [low, high] (or not above 0 with `positive`), and any NaN or infinity.
    None is a flag left at its "absent" default, which means something of its own."""
    if value is None:
        return
    finite = not isinstance(value, float) or math.isfinite(value)
    inside = (value > 0 if positive else value >= low) and (high is None or value <= high)
    if finite and inside:
        return
    of = f" of {unit}" if unit else ""
    if positive:
        wanted = f"a positive number{of}"
    elif high is None:
        wanted = f"at least {low}" + (f" {unit}" if unit else "")
    else:
        wanted = f"between {low} and {high}" + (f" {unit}" if unit else "")
    raise LocusError(f"{flag} must be {wanted}, not {value}")


@dataclass(frozen=True)
class NumericFlag:
    """One numeric flag's range: `memory` flags are sizes ('512MiB') checked once parsed."""

    flag: str
    low: float = 1
    high: float | None = None
    positive: bool = False
    unit: str = ""
    memory: bool = False

    @property
    def dest(self) -> str:
        return self.flag.lstrip("-").replace("-", "_")

    def check(self, value) -> None:
        if self.memory and value is not None:
            value = parse_memory(value)
        check_range(self.flag, value, self.low, self.high, positive=self.positive, unit=self.unit)


def check_flags(args, table: tuple[NumericFlag, ...]) -> None:
    """Every flag of `table` that `args` holds, in the table's order: the first bad one is the error."""
    for spec in table:
        if hasattr(args, spec.dest):
            spec.check(getattr(args, spec.dest))
