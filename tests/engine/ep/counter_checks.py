"""Every counter an expert-parallel server exposes, flattened to {name: value}, and the checks that none
ran backwards between two readings (issue 55, item 2): a Prometheus counter must never decrease, and
a placement epoch's figure must not change once the epoch has ended."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

# /ep/stats per-rank fields that are not counters: the rank's number (a regroup renumbers it) and what
# its expert weights take now (a regroup may give it more slots, or fewer)
NOT_COUNTERS = {"rank", "identity", "expert_bytes"}
TOTALS = ("inter_node_bytes", "intra_node_bytes", "wire_bytes", "tokens", "migrations", "migrated_kv_bytes",
          "migrated_kv_bytes_intra_node")


def families_counters(families) -> dict[str, float]:
    """The samples of every counter and histogram family (their `_created` timestamps left out)."""
    out = {}
    for family in families:
        if family.type not in ("counter", "histogram"):
            continue
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}"] = sample.value
    return out


def metrics_counters(text: str) -> dict[str, float]:
    """Every counter of a /metrics page."""
    return families_counters(text_string_to_metric_families(text))


def stats_counters(stats: dict) -> dict[str, float]:
    """Every counter of /ep/stats: the totals, and each rank's by the rank it was started as (a lost
    rank's under `retired`)."""
    out = {key: stats[key] for key in TOTALS}
    for entry in stats["per_rank"] + stats["retired"].get("per_rank", []):
        identity = entry.get("identity", entry["rank"])  # (before issue 55 a rank had only its number)
        for key, value in entry.items():
            if key not in NOT_COUNTERS:
                out[f"rank {identity} {key}"] = value
    return out


def closed_epochs(stats: dict) -> dict[int, dict]:
    """The entries of the epochs that have ended (every one before the current)."""
    return {e["epoch"]: e for e in stats["epochs"] if e["epoch"] < stats["epoch"]}


def assert_never_backwards(before: dict[str, float], after: dict[str, float], slack: float = 0.0) -> None:
    """Every counter of `before` is still there in `after`, no smaller. `slack`: what float seconds may lose
    to rounding (a split computed as a difference)."""
    missing = sorted(before.keys() - after.keys())
    backwards = {k: (before[k], after[k]) for k in before.keys() & after.keys() if after[k] < before[k] - slack}
    assert not missing and not backwards, (f"counters gone: {missing[:8]}; counters that ran backwards (before, after): "
                                           f"{dict(sorted(backwards.items())[:12])}")
