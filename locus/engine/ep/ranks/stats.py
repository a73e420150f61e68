"""What rank 0 reports of an expert-parallel server (`GET /ep/stats`): the exchange counters summed
over ranks under replay's field names (docs/design.md, "Metrics"), each rank's counters, step times
and expert memory, the placement epochs, the re-planner and the recoveries."""

from __future__ import annotations

from dataclasses import asdict

from locus.engine.ep.ranks.driver import EPDriver


def ep_stats_of(driver: EPDriver) -> dict:
    per_rank = []
    for rank, record in enumerate(driver.ranks):
        c, times = record.counters, record.times
        per_rank.append({"rank": rank, **asdict(c), "tokens": driver.rank_tokens(rank),
                         "inter_node": c.inter_node, "intra_node": c.intra_node, "wire": c.wire,
                         "expert_bytes": record.expert_bytes, "steps": times.steps, "step_s": times.step_s,
                         "compute_s": times.compute_s, "exchange_s": times.exchange_s, "control_s": times.control_s})
    runtime = driver.runtime
    topo = runtime.placement.plan.topology
    return {"ranks": len(per_rank), "assignment": driver.assignment, "exchange": runtime.mode,
            "overlap": runtime.overlap, "epoch": runtime.placement.epoch,
            "topology": {"nodes": topo.nodes, "gpus_per_node": topo.gpus_per_node, "slots_per_gpu": topo.slots_per_gpu},
            "inter_node_bytes": sum(r["inter_node"] for r in per_rank),
            "intra_node_bytes": sum(r["intra_node"] for r in per_rank),
            "wire_bytes": sum(r["wire"] for r in per_rank),
            "tokens": sum(r["tokens"] for r in per_rank),
            # requests moved after their prefill (--ep-moves): the KV cache sent, inter-node (the replay's
            # migrated_kv_bytes) and intra-node, apart from the dispatch bytes above
            "migrations": sum(r.counters.migrations for r in driver.ranks),
            "migrated_kv_bytes": sum(r.counters.migration_inter_node for r in driver.ranks),
            "migrated_kv_bytes_intra_node": sum(r.counters.migration_intra_node for r in driver.ranks),
            "per_rank": per_rank,
            "epochs": driver.epoch_totals(), "replan": replan_stats_of(driver), "recoveries": driver.recoveries,
            "retired": {"inter_node_bytes": driver.retired.inter_node, "intra_node_bytes": driver.retired.intra_node}}


def replan_stats_of(driver: EPDriver) -> dict | None:
    """The re-planner's state, its decisions so far, and what the placement moves sent (summed over ranks)."""
    planner = driver.replanner
    if planner is None:
        return None
    moves = [r.move for r in driver.ranks if r.move is not None]
    moved = {k: sum(getattr(m, k) for m in moves) for k in ("experts", "local", "intra_node_bytes", "inter_node_bytes")}
    return {"state": planner.state, "schedule": asdict(planner.schedule),
            "decisions": [d.to_dict() for d in planner.decisions], "moved": moved}
