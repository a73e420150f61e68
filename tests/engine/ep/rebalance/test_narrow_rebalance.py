"""Re-planning and elastic recovery with narrow experts (no process group needed): a survivor keeps
the narrow rows it holds and reads the lost rank's experts from the model's source in the same narrow
form (quantized as at load, or read narrow from an FP8 checkpoint), stacked as QuantizedTensors that
hold the very weights of the whole model (fingerprints), and a read in another form is refused; a
re-plan prices a move in the bytes an expert is held in."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from locus.engine.checkpoint.presets import PRESETS, build_preset
from locus.engine.checkpoint.quantize import quantize_model_experts
from locus.engine.checkpoint.weights import load_model
from locus.engine.ep.invariant import expert_fingerprint
from locus.engine.ep.ranks.elastic import expert_reader, plan_onto, refill_experts
from locus.engine.model.slices import moe_experts, slices_of
from locus.kernels.formats import QuantizedTensor
from locus.routing.plan.topology import Topology
from locus.routing.planners.baselines import round_robin
from tests.engine.ep.test_quantized_experts_ep import write_checkpoints


def survivor_runtime(model, old, rank: int):
    """What refill_experts reads of a rank's runtime: its placement's local experts and its layers."""
    local = tuple(tuple(int(e) for e in old.slots[i][rank]) for i in range(len(old.moe_layers)))
    layers = [SimpleNamespace(gate_up_proj=e.gate_up_proj, down_proj=e.down_proj) for e in moe_experts(model).values()]
    return SimpleNamespace(placement=SimpleNamespace(local_experts=local), layers=layers)


@pytest.mark.parametrize("source", ["float", "fp8", "mxfp8", "mxfp4", "fbgemm_fp8"])
def test_a_survivor_refills_its_slots_in_the_form_it_holds(source, tmp_path):
    config = PRESETS["tiny"]
    old = round_robin(config.num_local_experts, config.moe_layers, Topology(2, 2, 2), model="tiny")
    new = plan_onto(old, [0, 1, 3], max_slots=config.num_local_experts)  # rank 2 is lost: rank 0 takes its expert 2
    if source == "fbgemm_fp8":
        path = write_checkpoints(tmp_path)["fbgemm_fp8"]
        model, whole = load_model(path, expert_slices=slices_of(old, 0)), load_model(path)
        read = expert_reader(path, None, "cpu", "torch", 0)  # the checkpoint's experts are read narrow
    else:
        fmt = None if source == "float" else source
        model, whole = build_preset("tiny", seed=0, expert_slices=slices_of(old, 0)), build_preset("tiny", seed=0)
        if fmt:
            quantize_model_experts(model, fmt)
            quantize_model_experts(whole, fmt)
        read = expert_reader("tiny", None, "cpu", "torch", 0, fmt)
    runtime = survivor_runtime(model, old, 0)
    assert refill_experts(runtime, new, 0, read) == 3  # expert 2 of each MoE layer, read from the source
    for i, layer in enumerate(runtime.layers):
        ids = [int(e) for e in new.slots[i][0]]
        assert tuple(layer.gate_up_proj.shape)[0] == len(ids) > 2  # grew past the 2 slots it held
        assert isinstance(layer.gate_up_proj, QuantizedTensor) == (source != "float")
        assert isinstance(layer.down_proj, QuantizedTensor) == (source != "float")
        experts = moe_experts(whole)[config.moe_layers[i]]
        for j, e in enumerate(ids):
            assert expert_fingerprint(layer.gate_up_proj[j], layer.down_proj[j]) == \
                expert_fingerprint(experts.gate_up_proj[e], experts.down_proj[e]), (i, j, e)


def test_a_refill_read_in_another_form_is_refused():
    config = PRESETS["tiny"]
    old = round_robin(config.num_local_experts, config.moe_layers, Topology(2, 2, 2), model="tiny")
    new = plan_onto(old, [0, 1, 3], max_slots=config.num_local_experts)
    model = build_preset("tiny", seed=0, expert_slices=slices_of(old, 0))
    quantize_model_experts(model, "mxfp8")
    runtime = survivor_runtime(model, old, 0)
    with pytest.raises(ValueError, match="float torch.float32 for a layer holding mxfp8 experts"):
        refill_experts(runtime, new, 0, expert_reader("tiny", None, "cpu", "torch", 0))
    with pytest.raises(ValueError, match="in fp8 for a layer holding mxfp8 experts"):
        refill_experts(runtime, new, 0, expert_reader("tiny", None, "cpu", "torch", 0, "fp8"))


@pytest.mark.parametrize("fmt,expert_bytes", [(None, (64 * 128 + 64 * 64) * 4),
                                              # E4M3 elements, a float32 scale per output column
                                              ("fp8", 64 * 128 + 128 * 4 + 64 * 64 + 64 * 4),
                                              # E2M1 two a byte, an E8M0 scale per 32 along K
                                              ("mxfp4", 32 * 128 + 2 * 128 + 32 * 64 + 2 * 64)])
def test_a_replan_prices_a_move_in_the_bytes_an_expert_is_held_in(fmt, expert_bytes):
    from locus.engine.ep.rebalance.replan import ReplanSchedule, attach_replanner

    config = PRESETS["tiny"]
    plan = round_robin(config.num_local_experts, config.moe_layers, Topology(2, 2, 2), model="tiny")
    model = build_preset("tiny", seed=0, expert_slices=slices_of(plan, 1))
    if fmt:
        quantize_model_experts(model, fmt)
    runtime = survivor_runtime(model, plan, 1)
    driver = SimpleNamespace(core=SimpleNamespace(model=model), runtime=runtime)
    assert attach_replanner(driver, ReplanSchedule(), model_name="tiny").expert_bytes == expert_bytes
