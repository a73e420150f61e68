"""An expert-parallel rank's model holds, and reads, only its slots' experts: from a checkpoint (fused
and per-expert layouts) and from a preset's seed, with the whole model's values."""

from __future__ import annotations

import pytest
import torch

from locus.engine.checkpoint import weights
from locus.engine.model.slices import expert_memory, moe_experts, slices_of
from locus.engine.checkpoint.loader import config_of, load
from locus.engine.checkpoint.presets import build_preset
from locus.engine.checkpoint.weights import save_checkpoint
from locus.errors import LocusError
from locus.routing.planners.baselines import round_robin
from locus.routing.plan.topology import Topology

# rank 1 of a 2x2 tiny layout with an expert in two slots, as a plan may place it
SLICES = {0: [5, 5, 3], 1: [7, 0, 2], 3: [1, 6, 4]}


def assert_holds_rows_of(sliced, whole, slices):
    for layer, experts in moe_experts(sliced).items():
        full = moe_experts(whole)[layer]
        assert experts.expert_ids == slices[layer]
        assert experts.gate_up_proj.shape == (len(slices[layer]), 64, 128)  # [S, H, 2I]
        assert experts.down_proj.shape == (len(slices[layer]), 64, 64)  # [S, I, H]
        assert torch.equal(experts.gate_up_proj, full.gate_up_proj[slices[layer]])
        assert torch.equal(experts.down_proj, full.down_proj[slices[layer]])
    others = {n: p for n, p in whole.named_parameters() if ".experts." not in n}
    for name, param in sliced.named_parameters():
        if ".experts." not in name:
            assert torch.equal(param, others[name]), name


def test_a_sliced_preset_draws_the_whole_models_weights():
    whole = build_preset("tiny", seed=3)
    assert_holds_rows_of(build_preset("tiny", seed=3, expert_slices=SLICES), whole, SLICES)


@pytest.mark.parametrize("per_expert", [False, True])
def test_a_sliced_checkpoint_reads_only_its_experts(tmp_path, monkeypatch, per_expert):
    whole = build_preset("tiny", seed=4)
    ckpt = save_checkpoint(whole, tmp_path / "ckpt", per_expert=per_expert)
    read: list[str] = []
    get, get_rows = weights._ShardReader.get, weights._ShardReader.get_rows

    def spy_get(self, shard, name):
        read.append(name)
        return get(self, shard, name)

    def spy_rows(self, shard, name, rows, full_shape):
        read.append(f"{name}{rows}")
        return get_rows(self, shard, name, rows, full_shape)

    monkeypatch.setattr(weights._ShardReader, "get", spy_get)
    monkeypatch.setattr(weights._ShardReader, "get_rows", spy_rows)
    sliced = load(str(ckpt), expert_slices=SLICES, moe_backend="torch").model
    assert_holds_rows_of(sliced, whole, SLICES)
    expert_reads = sorted(n for n in read if ".experts." in n)
    if per_expert:  # only the held experts' tensors, each once
        want = sorted(f"model.layers.{layer}.feed_forward.experts.{e}.{part}_proj.weight"
                      for layer, ids in SLICES.items() for e in set(ids) for part in ("gate", "up", "down"))
        assert sorted(set(expert_reads)) == want
    else:  # the fused tensors only through row slices
        assert expert_reads == sorted(f"model.layers.{layer}.feed_forward.experts.{kind}{ids}"
                                      for layer, ids in SLICES.items() for kind in ("down_proj", "gate_up_proj"))


@pytest.mark.slow  # builds the `small` preset five times
def test_expert_memory_shrinks_with_the_slots():
    config = config_of("small")
    plan = round_robin(16, config.moe_layers, Topology(2, 2, 4))
    whole = expert_memory(build_preset("small"))
    held = [expert_memory(build_preset("small", expert_slices=slices_of(plan, rank))) for rank in range(4)]
    assert whole.held_bytes == whole.full_bytes == 4 * 16 * (256 * 1024 + 512 * 256) * 4  # 4 layers, float32
    assert [m.held_bytes * 4 for m in held] == [whole.held_bytes] * 4  # each rank a quarter
    assert [m.full_bytes for m in held] == [whole.full_bytes] * 4
    assert "25%" in held[0].describe()


def test_a_sliced_block_refuses_to_run_whole():
    model = build_preset("tiny", expert_slices=SLICES)
    with pytest.raises(RuntimeError, match="apply_expert_parallel"):
        model.model.layers[0].feed_forward(torch.zeros(2, 64))


def test_a_checkpoint_missing_an_unheld_expert_is_still_refused(tmp_path):
    """A rank does not read other ranks' experts, but a checkpoint without them is broken anyway."""
    from safetensors.torch import load_file, save_file

    ckpt = save_checkpoint(build_preset("tiny"), tmp_path / "ckpt", per_expert=True)
    tensors = load_file(ckpt / "model.safetensors")
    del tensors["model.layers.0.feed_forward.experts.6.up_proj.weight"]
    save_file(tensors, ckpt / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(LocusError, match="experts.6.up_proj"):
        load(str(ckpt), expert_slices=SLICES)
