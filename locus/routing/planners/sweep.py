"""The memory-for-traffic curve (`locus plan sweep`): for every slot count per GPU, plan eplb and locality
on the first half of a trace's requests and replay the second half, as `locus plan evaluate` does
(eplb with balanced assignment, locality with its grouper admitting requests as a live server does:
`locus replay --assign grouper`'s default arrivals), so a user sees what each extra expert slot
per GPU buys in inter-node bytes and what it costs in balance.

Rows: one per (slots, planner). Slot counts that cannot hold every expert once, or where the locality
planner cannot meet a fixed expert-load cap, are skipped with the reason (printed by the command); under
`--expert-cap auto` or `eplb` every slot count that holds the experts is planned.
"""

from __future__ import annotations

import json
import textwrap
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable

from locus.errors import LocusError
from locus.files import write_text_atomic
from locus.routing.dispatch_rule import DEFAULT_RULE
from locus.routing.grouping.live import simulate_live
from locus.routing.plan.caps import Caps
from locus.routing.plan.topology import parse_topology
from locus.routing.planners.planner import PlanOptions, make_plan
from locus.routing.replay.assignment import assign_balanced
from locus.routing.replay.report import json_safe
from locus.routing.replay.simulator import parse_request_range, replay

Log = Callable[[str], None]


@dataclass
class SweepRow:
    slots: int
    planner: str  # "eplb" (balanced assignment) or "locality" (its grouper)
    inter_node_bytes_per_token: float
    locality: float
    expert_imbalance_mean: float
    expert_imbalance_worst: float
    attention_imbalance: float
    reduction_vs_eplb: float  # 1 - bytes / eplb's bytes at the same slot count


def parse_slot_range(text: str) -> list[int]:
    """'2:8' (both ends included) or '3,5,9' -> sorted distinct slot counts."""
    try:
        if ":" in text:
            lo, hi = (int(x) for x in text.split(":"))
            values = list(range(lo, hi + 1))
        else:
            values = [int(x) for x in text.split(",")]
    except ValueError:
        raise LocusError(f"--slots {text!r} is not LO:HI or a comma-separated list of integers") from None
    if not values or min(values) < 1:
        raise LocusError(f"--slots {text!r} must name slot counts of at least 1")
    return sorted(set(values))


def sweep(reader, topology_text: str, slot_counts: list[int], caps: Caps, seed: int = 0,
          dispatch: str | None = None, batch_tokens: int = 4096, log: Log = print,
          replica_budget: str = "top", load_model: str | None = None, expert_cap_auto: bool = False,
          expert_cap_eplb_share: float | None = None) -> tuple[list[SweepRow], list[tuple[int, str]]]:
    """Rows for every usable slot count, and the (slot count, reason) of those skipped. `expert_cap_auto` /
    `expert_cap_eplb_share`: the locality plans' `--expert-cap auto` / `eplb` (PlanOptions), which never
    stop on the cap, so only slot counts too small for one copy of every expert are skipped."""
    meta = reader.meta
    R = len(reader.requests)
    plan_range, replay_range = parse_request_range("0:0.5", R), parse_request_range("0.5:1", R)
    rows, skipped = [], []
    fewest = parse_topology(topology_text, meta.num_experts).slots_per_gpu  # one copy of every expert
    for slots in slot_counts:
        if slots < fewest:
            skipped.append((slots, f"too few for one copy of each of the {meta.num_experts} experts"))
            continue
        topology = parse_topology(topology_text, meta.num_experts, slots)
        options = PlanOptions(caps=caps, seed=seed, dispatch=dispatch, replica_budget=replica_budget,
                              load_model=load_model, expert_cap_auto=expert_cap_auto,
                              expert_cap_eplb_share=expert_cap_eplb_share)
        tokens = [r.tokens for r in reader.requests[replay_range[0] : replay_range[1]]]
        balanced = assign_balanced(tokens, topology.ranks, request_start=replay_range[0])
        # one rule for both rows (the title's): EPLB under its own `position` rule is `locus plan evaluate`'s row
        eplb_plan = make_plan("eplb", reader, topology, plan_range,
                              replace(options, dispatch=dispatch or DEFAULT_RULE)).plan
        eplb = replay(reader, eplb_plan, topology, balanced, batch_tokens=batch_tokens)
        try:
            local_plan = make_plan("locality", reader, topology, plan_range, options).plan
        except LocusError as exc:  # the cap cannot be met at this slot count: a point the curve lacks
            skipped.append((slots, str(exc)))
            continue
        grouped = simulate_live(local_plan, reader, *replay_range).assignment
        local = replay(reader, local_plan, topology, grouped, batch_tokens=batch_tokens)
        for name, report in (("eplb", eplb), ("locality", local)):
            rows.append(SweepRow(slots, name, report.inter_node_bytes_per_token, report.locality,
                                 report.expert_imbalance_mean, report.expert_imbalance_worst,
                                 report.attention_imbalance,
                                 1 - report.inter_node_bytes_per_token / eplb.inter_node_bytes_per_token))
        log(f"  {slots} slots/GPU: eplb {eplb.inter_node_bytes_per_token:,.0f}, locality "
            f"{local.inter_node_bytes_per_token:,.0f} B/token")
    return rows, skipped


def format_sweep(rows: list[SweepRow], title: str) -> str:
    lines = [title, "", "| slots/GPU | planner | inter-node B/token | vs eplb | locality | expert imb. mean / worst "
             "| attention imb. |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        vs = "0" if r.planner == "eplb" else f"{-100 * r.reduction_vs_eplb:+.1f} %"
        lines.append(f"| {r.slots} | {r.planner} | {r.inter_node_bytes_per_token:,.0f} | {vs} "
                     f"| {100 * r.locality:.1f} % | {r.expert_imbalance_mean:.3f} / {r.expert_imbalance_worst:.3f} "
                     f"| {r.attention_imbalance:.3f} |")
    lines += ["", "locality: the plan's grouper admitting requests as a live expert-parallel server does "
              "(`locus replay --assign grouper` with its default arrivals)."]
    return "\n".join(lines) + "\n"


def write_sweep(rows: list[SweepRow], title: str, out_dir: str | Path, settings: dict) -> list[Path]:
    """sweep.json, sweep.md and, when matplotlib is installed (extra `plots`), sweep.png."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "sweep.json", out / "sweep.md"]
    write_text_atomic(paths[0], json.dumps(json_safe({"settings": settings, "rows": [asdict(r) for r in rows]}),
                                           indent=1) + "\n")
    write_text_atomic(paths[1], format_sweep(rows, title))
    png = plot_sweep(rows, title, out / "sweep.png")
    return paths + ([png] if png else [])


def plot_sweep(rows: list[SweepRow], title: str, path: Path) -> Path | None:
    """Bytes per token (left) and mean expert imbalance (right) against slots per GPU; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for name, style in (("eplb", "s--"), ("locality", "o-")):
        mine = [r for r in rows if r.planner == name]
        slots = [r.slots for r in mine]
        left.plot(slots, [r.inter_node_bytes_per_token / 1e3 for r in mine], style, label=name)
        right.plot(slots, [r.expert_imbalance_mean for r in mine], style, label=name)
    left.set(xlabel="expert slots per GPU", ylabel="inter-node kB / token", title="traffic")
    right.set(xlabel="expert slots per GPU", ylabel="expert imbalance (mean max/mean)", title="balance")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(textwrap.fill(title, 110), fontsize=8)
    fig.tight_layout()
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)  # atomic, as every result file
    return path
