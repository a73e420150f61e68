"""The expert-load cap each MoE layer is placed under, decided from what EPLB reaches before the costly search.

EPLB's placement of every layer is cheap (a few greedy passes over all layers at once) and is the
fallback of a layer the locality search cannot bring under its cap, so it is computed first:
  - a fixed cap (`--expert-cap 1.10`): every layer gets it. The layers EPLB misses are searched first:
    if the search misses one of them too, nothing meets the cap there and the planner stops at once,
    naming that layer, the other layers EPLB misses and EPLB's figure on each (the best it knows to be
    reachable), instead of after placing every layer;
  - `auto` (`--expert-cap auto[:FLOOR]`): every layer is searched at the floor; one the search cannot
    bring under it is placed at the best figure reached, the search's own (its least overloaded state)
    or EPLB's, whichever is lower, and that figure is its cap (LayerCaps.settle). So a layer's cap is
    the tightest one the search meets, at least the floor and at most EPLB's figure, and an auto plan
    never fails on the cap;
  - `eplb` (`--expert-cap eplb[:SHARE]`, for plans a live server admits by): every layer is searched at
    EPLB's figure on it with SHARE (default 0.5) of its slack over 1.0, at most the fixed cap, and settled
    as under auto (the search's best figure if at most EPLB's, else EPLB's placement). EPLB's balance
    rests on each expert's total demand only; the locality placement's rests also on how that demand
    splits over the nodes, which the request mix moves between planning and serving (a domain a third
    more frequent in the served half fills its nodes and overflows), so a plan made at EPLB's own
    figure, or at the fixed cap above it, is over EPLB's balance once served (docs/planner.md, "Live
    admission and balance").
EPLB's figure is its expected max/mean rank load on the same demand (expected_load.rank_loads), the
measure the search's cap is checked with.

Shape legend: L MoE layers, N nodes, E experts, R ranks, S slots per GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from locus.errors import LocusError
from locus.routing.plan.caps import DEFAULT_CAP
from locus.routing.planners.baselines import eplb
from locus.routing.planners.expected_load import rank_loads
from locus.routing.plan.topology import Topology
from locus.traces.metrics import max_over_mean

AUTO = "auto"
EPLB = "eplb"
DEFAULT_EPLB_SHARE = 0.5  # of EPLB's slack over 1.0 an `eplb` layer is searched at (measured: docs/planner.md)
SHOWN_LAYERS = 8  # layers named one by one in the error; the rest are counted


@dataclass(frozen=True)
class LayerCaps:
    caps: np.ndarray  # [L] the cap each layer is placed under
    eplb_slots: np.ndarray  # [L, R, S] EPLB's placement of every layer, the fallback
    eplb_imbalance: np.ndarray  # [L] its expected max/mean rank load on the demand
    auto: bool
    moe_layers: tuple[int, ...]
    slots_per_gpu: int

    def settle(self, layer: int, search_reach: float) -> bool:
        """For a layer the search left above its cap at `search_reach`: True if the search's slots are kept
        (auto, and the search reached no more than EPLB), False if EPLB's are taken; the layer's cap
        becomes the figure kept under auto. Raises the unmeetable error when neither meets a fixed cap."""
        eplb_reach = float(self.eplb_imbalance[layer])
        if self.auto:
            keep_search = search_reach <= eplb_reach
            self.caps[layer] = search_reach if keep_search else eplb_reach
            return keep_search
        if eplb_reach > self.caps[layer]:
            raise unmeetable_error(self, layer, search_reach)
        return False

    def search_order(self) -> np.ndarray:
        """Layer indices, those EPLB misses first (their search decides whether the cap can be met at
        all), then the rest; each part in layer order."""
        missed = self.eplb_imbalance > self.caps
        return np.concatenate([np.flatnonzero(missed), np.flatnonzero(~missed)])


def layer_caps(demand: np.ndarray, moe_layers, topology: Topology, cap: float, auto: bool,
               eplb_share: float | None = None) -> LayerCaps:
    """Per-layer caps for node demand [L, N, E], all `cap` to start with (auto raises them in settle), and
    EPLB's placement and figure on every layer. `eplb_share` (the `eplb` mode, settled as auto): each
    layer starts at 1 + eplb_share * (EPLB's figure - 1) instead, at most `cap`."""
    backup = eplb(demand.sum(1), moe_layers, topology).slots  # [L, R, S]
    reach = max_over_mean(rank_loads(backup, demand))  # [L]
    caps = np.full(len(reach), float(cap))
    if eplb_share is not None:
        caps = np.minimum(caps, 1.0 + float(eplb_share) * (reach - 1.0))
    return LayerCaps(caps, backup, reach, auto or eplb_share is not None, tuple(moe_layers), topology.slots_per_gpu)


def parse_expert_cap(text: str) -> tuple[float, bool]:
    """`--expert-cap` as (cap, auto): a number, `auto` (floor 1.10) or `auto:FLOOR`. `eplb[:SHARE]` is
    refused here (it needs the share too: parse_expert_cap_mode)."""
    cap, auto, share = parse_expert_cap_mode(text)
    if share is not None:
        raise LocusError(f"--expert-cap {text!r}: the eplb mode is not taken here; give a number or auto[:FLOOR]")
    return cap, auto


def parse_expert_cap_mode(text: str) -> tuple[float, bool, float | None]:
    """`--expert-cap` as (cap, auto, eplb share): a number, `auto[:FLOOR]` (floor 1.10 by default), or
    `eplb[:SHARE]` (share 0.5 by default, at most the fixed cap 1.10; its share is not None)."""
    word, _, arg = text.partition(":")
    if word == AUTO:
        return (_number(arg, text) if arg else DEFAULT_CAP), True, None
    if word == EPLB:
        share = _number(arg, text) if arg else DEFAULT_EPLB_SHARE
        if not 0.0 <= share <= 1.0:
            raise LocusError(f"--expert-cap {text!r}: the share of EPLB's slack must be in [0, 1]")
        return DEFAULT_CAP, True, share
    if arg:
        raise LocusError(f"--expert-cap must be a number or auto[:FLOOR] or eplb[:SHARE], not {text!r}")
    return _number(text, text), False, None


def _number(text: str, whole: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise LocusError(f"--expert-cap must be a number or auto[:FLOOR] or eplb[:SHARE], not {whole!r}") from None


def unmeetable_error(limits: LayerCaps, layer: int, search_reach: float) -> LocusError:
    """The error for a layer that neither the search (reaching `search_reach`) nor EPLB brings under its
    cap, naming the other layers EPLB misses with EPLB's figure on each."""
    cap, moe_layers = float(limits.caps[layer]), limits.moe_layers
    missed = [int(l) for l in np.flatnonzero(limits.eplb_imbalance > limits.caps) if l != layer]
    digits = 3 if f"{search_reach:.3f}" != f"{cap:.3f}" else 5  # a miss by less than the printed precision
    text = (f"MoE layer {moe_layers[layer]}: the expert-load cap {cap:.3f} cannot be met with {limits.slots_per_gpu} "
            f"slots per GPU (locality search reaches {search_reach:.{digits}f}, EPLB {limits.eplb_imbalance[layer]:.3f})")
    if missed:
        shown = ", ".join(f"{moe_layers[l]} ({limits.eplb_imbalance[l]:.3f})" for l in missed[:SHOWN_LAYERS])
        more = f" and {len(missed) - SHOWN_LAYERS} more" if len(missed) > SHOWN_LAYERS else ""
        text += f"; EPLB misses it on {len(missed)} more layers too: {shown}{more}"
    loosest = float(limits.eplb_imbalance.max())
    text += (f"; EPLB's worst layer reaches {loosest:.3f}. Give more slots (--slots), a looser cap (--expert-cap "
             f"{np.ceil(loosest * 1000) / 1000:.3f} is met by EPLB on every layer), or --expert-cap auto (each layer "
             f"at the tightest cap reached, at least this one)")
    return LocusError(text)
