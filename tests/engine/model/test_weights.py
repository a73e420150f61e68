"""Checkpoint loading variants and the errors bad checkpoints get."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from locus.engine.model.forward_batch import ForwardBatch
from locus.engine.checkpoint.presets import build_preset
from locus.engine.checkpoint.weights import load_model, save_checkpoint
from locus.errors import LocusError
from tests.engine.model.hf_reference import make_hf_model, prompt_ids, save_hf_model

pytest.importorskip("transformers")


def logits_of(model, ids):
    with torch.no_grad():
        return model.compute_logits(model(ForwardBatch.single(ids)).hidden)


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    hf = make_hf_model(seed=11, interleave_moe_layer_step=2, num_experts_per_tok=2)
    return save_hf_model(hf, tmp_path_factory.mktemp("hf") / "ck")


@pytest.fixture(scope="module")
def reference(hf_checkpoint):
    return logits_of(load_model(hf_checkpoint), prompt_ids(48))


@pytest.mark.parametrize("per_expert,prefix,shard_bytes", [
    (True, "", 2 << 30),
    (False, "language_model.", 2 << 30),
    (True, "language_model.", 2 << 30),
    (False, "", 200_000),  # several shards + model.safetensors.index.json
])
def test_resaved_variants_load_to_identical_logits(tmp_path, hf_checkpoint, reference, per_expert, prefix, shard_bytes):
    out = save_checkpoint(load_model(hf_checkpoint), tmp_path / "v", per_expert=per_expert, prefix=prefix,
                          max_shard_bytes=shard_bytes)
    names = set()
    for f in out.glob("*.safetensors"):
        from safetensors import safe_open
        with safe_open(str(f), "pt") as h:
            names |= set(h.keys())
    assert any(n.startswith(prefix + "model.layers.") for n in names)
    assert any(".experts.0.gate_proj.weight" in n for n in names) == per_expert
    if shard_bytes < 1 << 20:
        assert (out / "model.safetensors.index.json").is_file() and len(list(out.glob("*.safetensors"))) > 1
    assert torch.equal(logits_of(load_model(out), prompt_ids(48)), reference)


def test_multimodal_config_and_old_rope_fields_load_identically(tmp_path, hf_checkpoint, reference):
    ck = tmp_path / "mm"
    shutil.copytree(hf_checkpoint, ck)
    text = json.loads((ck / "config.json").read_text())
    rope = text.pop("rope_parameters")
    text["rope_theta"] = rope["rope_theta"]  # old style: rope_theta + rope_scaling (null = default)
    text["rope_scaling"] = None
    wrapped = {"model_type": "llama4", "architectures": ["Llama4ForConditionalGeneration"],
               "text_config": text, "vision_config": {"model_type": "llama4_vision_model", "hidden_size": 32}}
    (ck / "config.json").write_text(json.dumps(wrapped))
    assert torch.equal(logits_of(load_model(ck), prompt_ids(48)), reference)


def test_save_then_load_round_trips_a_preset(tmp_path):
    model = build_preset("tiny", seed=3)
    out = save_checkpoint(model, tmp_path / "tiny")
    assert torch.equal(logits_of(load_model(out), [5, 6, 7, 8]), logits_of(model, [5, 6, 7, 8]))
    with pytest.raises(LocusError, match="not empty"):
        save_checkpoint(model, out)


# --- bad inputs: one clear error naming the file or tensor -------------------------------------------

@pytest.fixture
def broken(tmp_path, hf_checkpoint):
    ck = tmp_path / "broken"
    shutil.copytree(hf_checkpoint, ck)
    return ck


def test_missing_config(broken):
    (broken / "config.json").unlink()
    with pytest.raises(LocusError, match=r"config\.json"):
        load_model(broken)


def test_no_weights(broken):
    (broken / "model.safetensors").unlink()
    with pytest.raises(LocusError, match=r"no \*\.safetensors"):
        load_model(broken)


def test_missing_shard_listed_in_index(tmp_path, hf_checkpoint):
    out = save_checkpoint(load_model(hf_checkpoint), tmp_path / "sharded", max_shard_bytes=200_000)
    victim = sorted(out.glob("*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(LocusError, match=victim.name):
        load_model(out)


def test_truncated_shard(broken):
    f = broken / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(LocusError, match=r"model\.safetensors.*(truncated|corrupt)"):
        load_model(broken)


def test_wrong_shape_names_the_tensor(broken):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(broken / "model.safetensors"))
    name = "model.layers.1.feed_forward.experts.down_proj"
    tensors[name] = tensors[name][:, :-1].contiguous()
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(LocusError, match=name.replace(".", r"\.") + ".*shape"):
        load_model(broken)


def test_missing_tensor_is_named(broken):
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["model.layers.2.self_attn.k_proj.weight"]
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(LocusError, match=r"model\.layers\.2\.self_attn\.k_proj\.weight"):
        load_model(broken)


def test_unknown_rope_type(broken):
    cfg = json.loads((broken / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "yarn-banana", "rope_theta": 10000.0}
    (broken / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(LocusError, match="unknown rope_type 'yarn-banana'"):
        load_model(broken)


def test_vision_only_config(broken):
    (broken / "config.json").write_text(json.dumps({"model_type": "llama4_vision_model", "hidden_size": 768}))
    with pytest.raises(LocusError, match="vision-only"):
        load_model(broken)


def test_invalid_json_config(broken):
    (broken / "config.json").write_text("{not json")
    with pytest.raises(LocusError, match=r"config\.json.*not valid JSON"):
        load_model(broken)
