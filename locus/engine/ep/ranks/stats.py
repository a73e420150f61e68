"""What rank 0 reports of an expert-parallel server (`GET /ep/stats`): the exchange counters summed
over ranks under replay's field names (docs/design.md, "Metrics"), each rank's counters, step times
and expert memory, the placement epochs, the re-planner and the recoveries.

Every total sums every rank that served, the ranks a regroup lost included (as of their last report,
and listed apart under `retired`): a counter never runs backwards, and an epoch's figure stays as it was
once the epoch has ended."""

from __future__ import annotations

from dataclasses import asdict

from locus.engine.ep.ranks.driver import EPDriver, RankRecord


def ep_stats_of(driver: EPDriver) -> dict:
    ranks, lost = driver.roster  # (one read: a regroup swaps both at once)
    per_rank = [rank_entry(driver, record, rank) for rank, record in enumerate(ranks)]
    retired = [rank_entry(driver, record, None) for record in lost]
    every = per_rank + retired
    runtime = driver.runtime
    topo = runtime.placement.plan.topology
    return {"ranks": len(per_rank), "assignment": driver.assignment, "exchange": runtime.mode,
            "overlap": runtime.overlap, "epoch": runtime.placement.epoch,
            "topology": {"nodes": topo.nodes, "gpus_per_node": topo.gpus_per_node, "slots_per_gpu": topo.slots_per_gpu},
            **totals_of(every),
            # requests moved after their prefill (--ep-moves): the KV cache sent, inter-node (the replay's
            # migrated_kv_bytes) and intra-node, apart from the dispatch bytes above
            "migrations": sum(r["migrations"] for r in every),
            "migrated_kv_bytes": sum(r["migration_inter_node"] for r in every),
            "migrated_kv_bytes_intra_node": sum(r["migration_intra_node"] for r in every),
            "per_rank": per_rank,
            "epochs": driver.epoch_totals(), "replan": replan_stats_of(driver), "recoveries": driver.recoveries,
            "retired": {**totals_of(retired), "per_rank": retired}}


def rank_entry(driver: EPDriver, record: RankRecord, rank: int | None) -> dict:
    """One rank's counters, step times and expert memory; `rank` None: a lost rank's, as it last reported."""
    c, times = record.counters, record.times
    return {"rank": rank, "identity": record.identity, **asdict(c), "tokens": driver.tokens_of(record),
            "inter_node": c.inter_node, "intra_node": c.intra_node, "wire": c.wire,
            "expert_bytes": record.expert_bytes, "steps": times.steps, "step_s": times.step_s,
            "compute_s": times.compute_s, "exchange_s": times.exchange_s, "control_s": times.control_s}


def totals_of(entries: list[dict]) -> dict:
    """The byte and token figures of `entries`, summed, under the replay's names."""
    return {"inter_node_bytes": sum(r["inter_node"] for r in entries),
            "intra_node_bytes": sum(r["intra_node"] for r in entries),
            "wire_bytes": sum(r["wire"] for r in entries),
            "tokens": sum(r["tokens"] for r in entries)}


def replan_stats_of(driver: EPDriver) -> dict | None:
    """The re-planner's state, its decisions so far, and what the placement moves sent (summed over ranks)."""
    planner = driver.replanner
    if planner is None:
        return None
    moves = [r.move for r in driver.ranks if r.move is not None]
    moved = {k: sum(getattr(m, k) for m in moves) for k in ("experts", "local", "intra_node_bytes", "inter_node_bytes")}
    return {"state": planner.state, "schedule": asdict(planner.schedule),
            "decisions": [d.to_dict() for d in planner.decisions], "moved": moved}
