"""Hardware profiles and model shapes are validated where they are loaded: the shipped ones load and
carry their sources, a bad one is refused in one line naming the file and the field."""

import json

import pytest

from locus.errors import LocusError
from locus.routing.replay.hardware import FIGURES, RankTable, load_hardware, profile_names
from locus.routing.replay.model_shape import load_model_shape, shape_names
from locus.traces.format import TraceMeta
from locus.traces.presets import PRESETS

from pathlib import Path

MINI_CONFIG = Path(__file__).resolve().parents[3] / "locus" / "assets" / "mini" / "config.json"


def test_shipped_profiles_load_with_a_source_for_every_figure():
    assert profile_names() == ["cpu-2core-tbf", "h100-ib400", "h200-ib400"]
    for name in profile_names():
        hw = load_hardware(name)
        assert hw.name == name and all(hw.sources[f].strip() for f in FIGURES)
    h200, h100 = load_hardware("h200-ib400"), load_hardware("h100-ib400")
    assert (h200.memory_bytes_per_s, h100.memory_bytes_per_s) == (4.8e12, 3.35e12)
    # the GPU profiles compose compute, then exchange; the shaped CPU testbed overlaps them per collective
    assert (h200.host_overlap, h100.host_overlap, load_hardware("cpu-2core-tbf").host_overlap) == \
        ("none", "none", "per_collective")
    assert h200.tensor_flops_per_s == h100.tensor_flops_per_s == 9.89e14
    # DeepEP's normal-kernel internode bandwidth by EP size, nearest on a log scale
    assert [h200.inter_node.dispatch_bytes_per_s.at(r) for r in (16, 20, 32, 64, 256)] == [43e9, 43e9, 58e9, 51e9, 51e9]


def test_rank_table_takes_the_nearest_on_a_log_scale():
    t = RankTable(((8, 1.0), (32, 2.0)))
    assert [t.at(r) for r in (1, 8, 15, 16, 17, 64)] == [1.0, 1.0, 1.0, 1.0, 2.0, 2.0]


def good_profile() -> dict:
    return json.loads(Path(load_hardware("h200-ib400").path).read_text())


@pytest.mark.parametrize("change, message", [
    (lambda d: d.pop("memory_bytes_per_s"), "memory_bytes_per_s: missing"),
    (lambda d: d.update(memory_bytes_per_s=-1), "memory_bytes_per_s: must be a positive number, got -1"),
    (lambda d: d.update(tensor_flops_per_s="fast"), "tensor_flops_per_s: must be a positive number"),
    (lambda d: d["sources"].pop("inter_node"), "sources.inter_node: missing: every figure names its source"),
    (lambda d: d.update(format="locus-placement"), "format: is 'locus-placement'"),
    (lambda d: d.update(version=2), "version: is 2"),
    (lambda d: d.update(turbo=True), "turbo: unknown field"),
    (lambda d: d.update(expert_efficiency=[[1, 1.5]]), "expert_efficiency: an efficiency is a share of the roofline"),
    (lambda d: d.update(expert_efficiency=[[4, 0.9], [1, 0.9]]), "expert_efficiency: its token counts must be"),
    (lambda d: d["inter_node"].pop("shared_by_node"), "inter_node.shared_by_node: missing"),
    (lambda d: d["inter_node"].update(dispatch_bytes_per_s=[[32, 1e9], [16, 1e9]]),
     "inter_node.dispatch_bytes_per_s: the ranks of its pairs must be strictly increasing"),
    (lambda d: d.update(dispatch_latency_s=[[0, 1e-5]]), "dispatch_latency_s: each entry must be [ranks, value]"),
    (lambda d: d["intra_node"].update(shared_by_node="yes"), "intra_node.shared_by_node: must be true or false"),
    (lambda d: d.pop("host_overlap"), "host_overlap: missing"),
    (lambda d: d.update(host_overlap="max"), "host_overlap: must be one of none, per_collective, got 'max'"),
    (lambda d: d.update(host_overlap=True), "host_overlap: must be one of none, per_collective, got True"),
    (lambda d: d["sources"].pop("host_overlap"), "sources.host_overlap: missing: every figure names its source"),
])
def test_a_bad_profile_is_refused_by_name(tmp_path, change, message):
    doc = good_profile()
    change(doc)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(LocusError, match=f"hardware profile {path}: {message}".replace("[", r"\[")):
        load_hardware(str(path))


def test_unknown_or_unreadable_profile(tmp_path):
    with pytest.raises(LocusError, match="'a100' : neither a known profile".replace(" :", ":")):
        load_hardware("a100")
    (tmp_path / "x.json").write_text("{not json")
    with pytest.raises(LocusError, match="cannot read it as JSON"):
        load_hardware(str(tmp_path / "x.json"))


def test_shapes_load_and_agree_with_their_sources():
    assert shape_names() == ["deepseek-v3", "llama4-maverick", "llama4-scout", "mini", "mixtral-8x7b", "qwen3-235b"]
    for name in shape_names():
        shape = load_model_shape(name)
        if name in PRESETS:  # the synthetic presets' shapes are the same models'
            p = PRESETS[name]
            shape.check_trace(TraceMeta(name, p.num_experts, p.top_k, p.moe_layers, p.hidden_size))
    mini, config = load_model_shape("mini"), json.loads(MINI_CONFIG.read_text())
    assert (mini.hidden_size, mini.moe_intermediate_size, mini.shared_intermediate_size, mini.dense_intermediate_size,
            mini.num_hidden_layers, mini.num_moe_layers, mini.num_experts, mini.top_k, mini.num_attention_heads,
            mini.num_key_value_heads, mini.head_dim, mini.vocab_size) == (
        config["hidden_size"], config["intermediate_size"], config["intermediate_size"], config["intermediate_size_mlp"],
        config["num_hidden_layers"], len(config["moe_layers"]), config["num_local_experts"],
        config["num_experts_per_tok"], config["num_attention_heads"], config["num_key_value_heads"],
        config["head_dim"], config["vocab_size"])
    # mini's KV cache as an engine records it (traces' kv_bytes_per_token: 4 layers x 2 x 2 heads x 32 x 2 B)
    assert mini.kv_bytes_per_token == 1024
    ds = load_model_shape("deepseek-v3")  # MLA: kv_lora_rank 512 + qk_rope_head_dim 64 a layer, 61 layers, bf16
    assert ds.kv_bytes_per_token == 61 * 576 * 2 and ds.expert_bytes == 3 * 7168 * 2048 * 2


def test_a_bad_shape_is_refused_by_name(tmp_path):
    path = tmp_path / "s.json"
    path.write_text(json.dumps({"source": "x", "hidden_size": 4}))
    with pytest.raises(LocusError, match=f"{path}: shape 's' lacks 'moe_intermediate_size'"):
        load_model_shape(str(path))
    with pytest.raises(LocusError, match="neither a known model"):
        load_model_shape("gpt-5")
    shape = load_model_shape("llama4-maverick")
    with pytest.raises(LocusError, match="has top_k 1, the trace 8"):
        shape.check_trace(TraceMeta("x", 128, 8, tuple(range(24)), 5120))
