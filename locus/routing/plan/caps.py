"""Balance caps the locality planner and the grouper must respect (hard constraints, max/mean)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from locus.errors import LocusError

DEFAULT_CAP = 1.10


@dataclass(frozen=True)
class Caps:
    expert: float = DEFAULT_CAP  # per MoE layer: max over ranks / mean of the (token, k) pairs computed
    attention: float = DEFAULT_CAP  # max over ranks / mean of the tokens whose attention a rank runs

    def __post_init__(self) -> None:
        for name in ("expert", "attention"):
            value = getattr(self, name)
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not number or not math.isfinite(value) or value < 1.0:
                raise LocusError(f"the {name}-load cap must be a number >= 1.0 (max/mean), got {value!r}")

    def to_dict(self) -> dict:
        return {"expert": float(self.expert), "attention": float(self.attention)}
