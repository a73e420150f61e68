"""A live re-plan under load on real gloo process groups (`small`, 2x2): rank 0's re-planner gathers
every rank's routing window, re-plans with the plan's own planner (EPLB here), aligns the result to
the current plan, and the ranks move the changed experts layer by layer while 16 streams decode.
Every stream's greedy tokens equal the single-process engine's; the bytes the ranks measured in each
placement epoch equal, to the byte, the replay of the trace they recorded under each epoch's plan."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from locus.engine.checkpoint.presets import PRESETS, build_preset
from locus.engine.checkpoint.quantize import quantize_model_experts
from locus.engine.checkpoint.tokenizer import ByteTokenizer
from locus.engine.core.engine_core import EngineConfig, EngineCore
from locus.engine.ep.ranks.control import ControlPlane
from locus.engine.ep.ranks.driver import EPDriver
from locus.engine.ep.groups import make_groups
from locus.engine.ep.layer import apply_expert_parallel
from locus.engine.ep.placement_move import align, fills
from locus.engine.ep.rebalance.replan import ReplanSchedule, attach_replanner
from locus.engine.model.slices import slices_of
from locus.engine.ep.ranks.worker import RankWorker
from locus.engine.sampling.sampler import SamplingParams
from locus.routing.plan.placement import PlacementPlan, plan_from_dict
from locus.routing.plan.topology import Topology
from locus.routing.planners.baselines import eplb, round_robin
from tests.engine.ep.test_expert_parallel import end_rank, free_port

TOKENS = 20


def stale_plan() -> PlacementPlan:
    """EPLB for a load the workload does not have (experts 0-3 hot): the live window disagrees."""
    config = PRESETS["small"]
    loads = np.ones((len(config.moe_layers), config.num_local_experts))
    loads[:, :4] = 100
    return eplb(loads, config.moe_layers, Topology(2, 2, 6), model="small")


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(11)
    return [torch.randint(0, 256, (int(n),), generator=g).tolist() for n in torch.randint(4, 40, (16,), generator=g)]


def worker(rank: int, world: int, port: int, out: str, quantize_experts: str | None = None) -> None:
    """One rank of the re-plan run; `quantize_experts`: its experts held in that narrow format
    (tests/engine/ep/test_quantized_experts_ep.py)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        config = PRESETS["small"]
        plan = stale_plan()
        model = build_preset("small", seed=0, expert_slices=slices_of(plan, rank))
        if quantize_experts:
            quantize_model_experts(model, quantize_experts)
        groups = make_groups(2, 2)
        runtime = apply_expert_parallel(model, plan, groups)
        core = EngineCore(model, ByteTokenizer(config.vocab_size),
                          EngineConfig(block_size=8, num_kv_blocks=256, max_num_batched_tokens=64))
        core.lockstep = runtime
        core.start_recording(f"{out}/trace{rank}", "small")
        rank_worker = RankWorker(core, runtime, ControlPlane(groups.control, rank, world), window_tokens=512)
        if rank != 0:
            rank_worker.serve()
            torch.save({"epochs": runtime.counters_by_epoch()}, f"{out}/rank{rank}.pt")
            return
        driver = EPDriver(rank_worker)
        replanner = attach_replanner(driver, ReplanSchedule(), layers_per_step=1, model_name="small")
        params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)
        for i, prompt in enumerate(prompts()):
            driver.add(f"p{i}", core.validate(prompt, params), None)
        finals, future, iterations, epochs_seen = {}, None, 0, set()
        while driver.has_unfinished() or replanner.state != "idle" or runtime.move is not None:
            for output in driver.step():
                if output.finished:
                    finals[output.request_id] = output.outputs[0].token_ids
            iterations += 1
            epochs_seen.add(runtime.placement.epoch)
            if iterations == 4:  # mid-stream: every request is decoding
                future = replanner.request(force=True)
        decision = future.result()
        epoch_totals = driver.epoch_totals()
        driver.stop()
        core.dump_recording()
        torch.save({"finals": finals, "decision": decision.to_dict(), "epoch_totals": epoch_totals,
                    "epochs_seen": epochs_seen, "final_plan": runtime.placement.plan.to_dict(),
                    "moved": [r.move for r in driver.ranks]}, f"{out}/rank0.pt")
    finally:
        dist.destroy_process_group()
    end_rank()


@pytest.mark.slow  # spawns 4 rank processes
def test_a_forced_replan_mid_stream_keeps_tokens_and_bytes_equal_the_replay(tmp_path):
    from locus.engine.frontend.llm import LLM
    from locus.routing.replay.assignment import assign_recorded
    from locus.routing.replay.simulator import replay
    from locus.traces.merge import merge_traces
    from locus.traces.reader import TraceReader

    mp.spawn(worker, args=(4, free_port(), str(tmp_path)), nprocs=4, join=True)
    got = torch.load(tmp_path / "rank0.pt", weights_only=False)
    decision = got["decision"]
    assert decision["applied"] and decision["moved_slots"] > 0 and decision["planner"] == "eplb"
    assert decision["window_tokens"] > 0 and decision["move_bytes"] > 0
    assert got["epochs_seen"] == {0, 1, 2, 3, 4}  # one epoch a switched MoE layer
    final = plan_from_dict(got["final_plan"])
    assert sum(len(fills(stale_plan(), final, row)) for row in range(4)) == decision["moved_slots"]

    config = PRESETS["small"]
    llm = LLM.from_model(build_preset("small", seed=0), ByteTokenizer(config.vocab_size),
                         EngineConfig(block_size=8, num_kv_blocks=256))
    want = llm.generate(prompts(), SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True))
    assert len(got["finals"]) == 16
    for i, out in enumerate(want):
        assert got["finals"][f"p{i}"] == out.outputs[0].token_ids, f"request {i}"

    merge_traces([tmp_path / f"trace{r}" for r in range(4)], tmp_path / "trace", ranks=list(range(4)))
    reader = TraceReader(tmp_path / "trace")
    plans = {e: plan_from_dict(p) for e, p in reader.plans().items()}
    assert sorted(plans) == [0, 1, 2, 3, 4] and set(np.unique(reader.epochs).tolist()) <= set(plans)
    report = replay(reader, plans[0], plans[0].topology, assign_recorded(reader.requests, 4), epoch_plans=plans)
    measured = {e["epoch"]: e for e in got["epoch_totals"]}
    for row in report.epochs:
        m = measured[row["epoch"]]
        assert (m["inter_node_bytes"], m["intra_node_bytes"], m["tokens"]) == (
            row["inter_node_bytes"], row["intra_node_bytes"], row["tokens"]), row["epoch"]
    assert sum(e["inter_node_bytes"] for e in report.epochs) == report.inter_node_bytes


def test_align_keeps_experts_in_place_and_relabels_ranks_within_a_node_only():
    old = round_robin(8, (0, 1), Topology(2, 2, 3), model="toy")
    new = PlacementPlan("toy", 8, (0, 1), Topology(2, 2, 3), np.array(old.slots)[:, [1, 0, 3, 2]], dispatch="position")
    aligned = align(old, new)  # the same sets, ranks swapped within each node: nothing moves
    assert aligned.slots.tolist() == old.slots.tolist()
    crossed = PlacementPlan("toy", 8, (0, 1), Topology(2, 2, 3), np.array(old.slots)[:, [2, 3, 0, 1]])
    moved = align(old, crossed)  # node sets swapped: ranks never leave their node, so experts move
    assert sum(len(fills(old, moved, row)) for row in range(2)) > 0
    for row in range(2):
        for node in range(2):  # each node holds what the new plan gives that node
            want = sorted(np.array(crossed.slots[row][2 * node:2 * node + 2]).ravel().tolist())
            assert sorted(np.array(moved.slots[row][2 * node:2 * node + 2]).ravel().tolist()) == want


def test_replan_schedule_parses_seconds_and_steps():
    assert ReplanSchedule.parse("600") == ReplanSchedule(seconds=600.0)
    assert ReplanSchedule.parse("30s") == ReplanSchedule(seconds=30.0)
    assert ReplanSchedule.parse("3000steps") == ReplanSchedule(steps=3000)
    assert not ReplanSchedule.parse(None).active
    from locus.errors import LocusError

    for bad in ("0", "-5", "steps", "fast", "0steps"):
        with pytest.raises(LocusError, match="replan-every"):
            ReplanSchedule.parse(bad)


def test_plan_onto_survivors_keeps_held_experts_and_places_every_lost_one():
    from locus.engine.ep.ranks.elastic import plan_onto, survivor_topology
    from locus.errors import LocusError

    plan = round_robin(8, (0, 1), Topology(2, 2, 2), model="toy")  # rank r holds experts r, r + 4
    onto = plan_onto(plan, [0, 1, 3], max_slots=8)  # rank 2 (experts 2, 6) is lost
    assert onto.topology == Topology(3, 1, 3)  # node 1 lost a rank: every survivor is its own node
    for row in range(2):
        for new, old in enumerate([0, 1, 3]):
            assert set(plan.slots[row][old]) <= set(onto.slots[row][new])  # nothing a survivor holds moves
        assert set(np.array(onto.slots[row]).ravel()) == set(range(8))
    assert survivor_topology(Topology(2, 2, 2), [0, 2], 4) == Topology(2, 1, 4)  # one rank left on each node
    assert survivor_topology(Topology(2, 2, 2), [0, 1], 4) == Topology(1, 2, 4)
    with pytest.raises(LocusError, match="--ep-max-slots 3"):
        plan_onto(plan, [0, 1], max_slots=3)  # 8 experts on 2 ranks need 4 slots each


def test_a_replan_leaving_an_expert_without_a_slot_is_refused_before_anything_moves():
    from dataclasses import replace

    from locus.engine.ep.rebalance.replan import check_target
    from locus.errors import LocusError

    current = round_robin(8, (0, 1), Topology(2, 2, 2), model="toy")
    check_target(current, align(current, eplb_like(current)))  # a full plan passes
    slots = np.array(current.slots)
    slots[1, 2, 1] = slots[1, 1, 0]  # layer 1: expert 6's only slot now holds a replica of expert 1
    with pytest.raises(LocusError, match=r"re-plan refused.*layer 1: expert\(s\) 6 have no slot"):
        check_target(current, replace(current, slots=slots))
    with pytest.raises(LocusError, match="re-plan refused.*topology"):
        check_target(current, round_robin(8, (0, 1), Topology(1, 4, 2), model="toy"))


def eplb_like(plan: PlacementPlan) -> PlacementPlan:
    """The same experts, the ranks' slots reversed: a different but complete plan."""
    from dataclasses import replace

    return replace(plan, slots=np.ascontiguousarray(np.asarray(plan.slots)[:, :, ::-1]))
