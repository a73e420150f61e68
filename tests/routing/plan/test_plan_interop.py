"""`locus plan export` / `locus plan import`: SGLang, vLLM and DeepSeek EPLB expert maps, real files in tmp_path.

The plan used throughout has replicas (experts 0 and 5 twice in layer 1, experts 0 and 1 twice in
layer 3), and rank 3 holds expert 5 in both its slots in layer 1, which EPLB can do too.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from locus.cli import main
from locus.errors import LocusError
from locus.routing.plan.interop import (
    deepseek_triple,
    export_plan,
    import_plan,
    replica_maps,
    sglang_document,
    vllm_document,
)
from locus.routing.plan.placement import PlacementPlan, load_plan
from locus.routing.plan.topology import Topology

torch = pytest.importorskip("torch")

E = 6
SLOTS = np.array([  # [L=2, R=4, S=2]: topology 2x2, P = 8 physical experts
    [[0, 1], [2, 0], [3, 4], [5, 5]],
    [[5, 4], [3, 2], [1, 0], [0, 1]],
])
LAYERS = (1, 3)


def make_plan() -> PlacementPlan:
    return PlacementPlan("tiny-moe", E, LAYERS, Topology(2, 2, 2), SLOTS.copy(), provenance={"planner": "test"})


@pytest.fixture
def plan_file(tmp_path):
    path = tmp_path / "plan.json"
    make_plan().save(path)
    return path


def assert_same_placement(got: PlacementPlan, want: PlacementPlan) -> None:
    assert np.array_equal(got.slots, want.slots)
    assert got.topology == want.topology
    assert got.moe_layers == want.moe_layers
    assert got.num_experts == want.num_experts


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("ext", [".json", ".pt"])
@pytest.mark.parametrize("fmt", ["sglang", "vllm", "deepseek"])
def test_cli_round_trip_keeps_the_placement(plan_file, tmp_path, capsys, fmt, ext):
    out, back = tmp_path / f"map{ext}", tmp_path / "back.json"
    extra = ["--num-hidden-layers", "5"] if fmt == "sglang" else []
    assert main(["plan", "export", str(plan_file), "--to", fmt, "-o", str(out), *extra]) == 0
    assert main(["plan", "import", str(out), "--from", fmt, "--topology", "2x2", "--model", "tiny-moe",
                 "--moe-layers", "1,3", "--num-experts", str(E), "-o", str(back)]) == 0
    assert_same_placement(load_plan(back), make_plan())
    got = load_plan(back)
    assert got.model == "tiny-moe" and got.planner == f"imported-{fmt}"
    assert "8 physical experts (6 experts + 2 redundant) on 4 ranks" in capsys.readouterr().out


@pytest.mark.parametrize("fmt", ["sglang", "vllm", "deepseek"])
def test_an_import_is_told_the_moe_layers_never_guesses_them(tmp_path, fmt):
    """No format says which model layers are MoE layers: 0..L-1 put a plan for layers 1 and 3 on 0 and 1."""
    out = tmp_path / "map.pt"
    export_plan(make_plan(), fmt, out)
    with pytest.raises(LocusError, match="does not say which model layers are MoE layers; pass --moe-layers"):
        import_plan(out, fmt, "2x2", "m", None)
    imported = import_plan(out, fmt, "2x2", "m", LAYERS)
    assert imported.plan.moe_layers == LAYERS and np.array_equal(imported.plan.slots, SLOTS)


def test_sglang_takes_the_rows_of_the_moe_layers(tmp_path):
    out = tmp_path / "map.json"
    export_plan(make_plan(), "sglang", out)  # rows 0..3; rows 0 and 2 are dense
    imported = import_plan(out, "sglang", "2x2", "m", LAYERS)
    assert imported.plan.moe_layers == LAYERS and np.array_equal(imported.plan.slots, SLOTS)
    assert any("num_experts inferred as 6" in n for n in imported.notes)


@pytest.mark.parametrize("fmt", ["sglang", "vllm", "deepseek"])
def test_cli_import_without_moe_layers_or_a_model_that_gives_them_is_refused(plan_file, tmp_path, capsys, fmt):
    src = tmp_path / "map.pt"
    assert main(["plan", "export", str(plan_file), "--to", fmt, "-o", str(src)]) == 0
    capsys.readouterr()
    err = run_import(tmp_path, capsys, src, fmt, layers=None, model="tiny-moe")
    assert err == (f"locus: error: --from {fmt} maps do not say which model layers are MoE layers: pass --moe-layers, "
                   "or --model as a Llama-4 checkpoint directory or trace preset that gives them ('tiny-moe' is "
                   "neither)\n")


def llama4_checkpoint(tmp_path, **text) -> str:
    """A checkpoint directory whose config.json is a multimodal Llama-4 config (text fields in text_config)."""
    model = tmp_path / "llama4-ckpt"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama4", "text_config": {
        "model_type": "llama4_text", "num_hidden_layers": 4, **text}, "vision_config": {}}))
    return str(model)


@pytest.mark.parametrize("fmt", ["sglang", "vllm", "deepseek"])
def test_cli_round_trip_takes_the_moe_layers_from_the_model_directory(plan_file, tmp_path, capsys, fmt):
    """MoE on every 2nd layer (interleave_moe_layer_step 2, as Llama-4 Maverick): layers 1 and 3, not 0 and 1."""
    out, back = tmp_path / "map.json", tmp_path / "back.json"
    assert main(["plan", "export", str(plan_file), "--to", fmt, "-o", str(out)]) == 0
    model = llama4_checkpoint(tmp_path, interleave_moe_layer_step=2)
    assert main(["plan", "import", str(out), "--from", fmt, "--topology", "2x2", "--model", model,
                 "--num-experts", str(E), "-o", str(back)]) == 0
    assert_same_placement(load_plan(back), make_plan())
    assert "MoE layers [1, 3]" in capsys.readouterr().out


@pytest.mark.parametrize("fmt", ["sglang", "vllm", "deepseek"])
def test_cli_round_trip_of_a_maverick_plan_takes_the_preset_layers(tmp_path, capsys, fmt):
    """llama4-maverick (a trace preset): 128 experts on the 24 odd layers of 48."""
    rng = np.random.default_rng(0)
    layers = tuple(range(1, 48, 2))
    slots = np.stack([rng.permutation(128).reshape(4, 32) for _ in layers])
    want = PlacementPlan("llama4-maverick", 128, layers, Topology(2, 2, 32), slots, provenance={"planner": "test"})
    plan, out, back = tmp_path / "plan.json", tmp_path / "map.pt", tmp_path / "back.json"
    want.save(plan)
    assert main(["plan", "export", str(plan), "--to", fmt, "-o", str(out)]) == 0
    assert main(["plan", "import", str(out), "--from", fmt, "--topology", "2x2", "--model", "llama4-maverick",
                 "-o", str(back)]) == 0
    assert_same_placement(load_plan(back), want)


@pytest.mark.parametrize("config, message", [
    ({"model_type": "mixtral", "num_hidden_layers": 32}, "model_type 'mixtral' is not a Llama-4 model"),
    ({"model_type": "llama4_text"}, "no num_hidden_layers: cannot tell the MoE layers; pass --moe-layers"),
    ({"num_hidden_layers": 4, "moe_layers": [1, 7]}, "moe_layers [1, 7] names no layer, or one outside 0..3"),
    (None, "missing config.json"),
])
def test_a_model_directory_that_does_not_give_the_moe_layers_is_one_line(tmp_path, capsys, config, message):
    src = tmp_path / "map.pt"
    export_plan(make_plan(), "vllm", src)
    model = tmp_path / "ckpt"
    model.mkdir()
    if config is not None:
        (model / "config.json").write_text(json.dumps(config))
    assert message in run_import(tmp_path, capsys, src, "vllm", layers=None, model=str(model))


def test_multi_node_topology_keeps_rank_major_order(tmp_path):
    # 4 nodes x 1 GPU has the same 4 ranks; 1 x 4 too: rank r = node * gpus + gpu either way.
    out = tmp_path / "map.pt"
    export_plan(make_plan(), "vllm", out)
    for shape in ("4x1", "1x4"):
        plan = import_plan(out, "vllm", shape, "m", moe_layers=LAYERS).plan
        assert np.array_equal(plan.slots, SLOTS) and plan.topology.ranks == 4
    # 1 rank: all 8 physical experts are its slots
    one = import_plan(out, "vllm", "1x1", "m", moe_layers=LAYERS).plan
    assert one.topology.slots_per_gpu == 8 and np.array_equal(one.slots[:, 0], SLOTS.reshape(2, 8))


# ---------------------------------------------------------------- what the files hold


def test_sglang_file_holds_one_key_with_a_row_per_model_layer(tmp_path):
    out = tmp_path / "sglang.json"
    export_plan(make_plan(), "sglang", out, num_hidden_layers=5)
    doc = json.loads(out.read_text())
    # SGLang calls init_by_mapping(server_args, model_config, **data): any other key would be a TypeError.
    assert list(doc) == ["physical_to_logical_map"]
    rows = np.array(doc["physical_to_logical_map"])
    assert rows.shape == (5, 8)  # [num_hidden_layers, P], P = ranks * slots
    assert np.array_equal(rows[1], SLOTS[0].ravel()) and np.array_equal(rows[3], SLOTS[1].ravel())
    for dense in (0, 2, 4):  # SGLang's init_trivial row
        assert np.array_equal(rows[dense], np.arange(8) % E)
    # physical p lives on rank p // slots_per_gpu
    p = np.arange(8)
    assert np.array_equal(rows[1][p], SLOTS[0][p // 2, p % 2])


def test_sglang_pt_file_is_a_dict_of_an_int64_tensor(tmp_path):
    out = tmp_path / "sglang.pt"
    export_plan(make_plan(), "sglang", out)
    data = torch.load(out, weights_only=True)
    assert list(data) == ["physical_to_logical_map"]
    assert data["physical_to_logical_map"].dtype == torch.int64
    assert tuple(data["physical_to_logical_map"].shape) == (4, 8)  # default: last MoE layer + 1


def test_vllm_maps_are_consistent_and_padded_with_minus_one(tmp_path):
    doc = vllm_document(make_plan())
    p2l, l2p, count = doc["physical_to_logical_map"], doc["logical_to_physical_map"], doc["logical_replica_count"]
    assert p2l.shape == (2, 8) and l2p.shape == (2, E, 2) and count.shape == (2, E)
    assert count.tolist() == [[2, 1, 1, 1, 1, 2], [2, 2, 1, 1, 1, 1]]
    for layer in range(2):
        for expert in range(E):
            listed = l2p[layer, expert]
            assert listed[: count[layer, expert]].tolist() == np.flatnonzero(p2l[layer] == expert).tolist()
            assert (listed[count[layer, expert]:] == -1).all()
    out = tmp_path / "vllm.pt"
    export_plan(make_plan(), "vllm", out)
    data = torch.load(out, weights_only=True)
    assert set(data) == {"physical_to_logical_map", "logical_to_physical_map", "logical_replica_count"}
    assert all(t.dtype == torch.int64 for t in data.values())


def test_deepseek_pt_is_the_eplb_triple(tmp_path):
    out = tmp_path / "eplb.pt"
    export_plan(make_plan(), "deepseek", out)
    data = torch.load(out, weights_only=True)
    assert isinstance(data, tuple) and len(data) == 3
    for got, want in zip(data, deepseek_triple(make_plan())):
        assert np.array_equal(got.numpy(), want)
    export_plan(make_plan(), "deepseek", tmp_path / "eplb.json")  # JSON has no tuples: the three are named
    assert list(json.loads((tmp_path / "eplb.json").read_text())) == ["phy2log", "log2phy", "logcnt"]


def test_replica_maps_on_a_plan_with_a_rank_holding_an_expert_twice():
    l2p, count = replica_maps(SLOTS.reshape(2, 8), E)
    assert l2p[0, 5].tolist() == [6, 7] and count[0, 5] == 2  # rank 3's two slots


# ---------------------------------------------------------------- foreign files that are fine


def test_deepseek_triple_in_replica_rank_order_and_wider_padding_is_accepted(tmp_path):
    """EPLB lists an expert's replicas by replica rank (not ascending physical id), and vLLM's live
    state pads logical_to_physical_map to far more columns than replicas; both are the same placement."""
    p2l = SLOTS.reshape(2, 8)
    l2p, count = replica_maps(p2l, E)
    twice = count == 2
    l2p[twice] = l2p[twice][:, ::-1]  # the second replica first: out of physical order
    assert l2p[0, 0].tolist() == [3, 0]
    wide = np.pad(l2p, ((0, 0), (0, 0), (0, 5)), constant_values=-1)
    path = tmp_path / "eplb.pt"
    torch.save((torch.tensor(p2l), torch.tensor(wide), torch.tensor(count)), path)
    plan = import_plan(path, "deepseek", "2x2", "m", moe_layers=LAYERS).plan
    assert np.array_equal(plan.slots, SLOTS)


def test_vllm_dict_with_only_the_physical_map_is_enough(tmp_path):
    path = tmp_path / "p2l.json"
    path.write_text(json.dumps({"physical_to_logical_map": SLOTS.reshape(2, 8).tolist()}))
    assert np.array_equal(import_plan(path, "vllm", "2x2", "m", LAYERS).plan.slots, SLOTS)


def test_sglang_recorder_dump_map_is_read(tmp_path):
    """SGLang's per_token / per_pass dumps hold the map in force as last_physical_to_logical_map [NL, P]."""
    full = sglang_document(make_plan())["physical_to_logical_map"]
    path = tmp_path / "expert_distribution_recorder_0.pt"
    torch.save({"records": [], "last_physical_to_logical_map": torch.tensor(full)}, path)
    plan = import_plan(path, "sglang", "2x2", "m", moe_layers=LAYERS).plan
    assert np.array_equal(plan.slots, SLOTS)


def test_deepseek_accepts_a_dict_with_vllm_key_names(tmp_path):
    path = tmp_path / "state.pt"
    torch.save({k: torch.tensor(v) for k, v in vllm_document(make_plan()).items()}, path)
    assert np.array_equal(import_plan(path, "deepseek", "2x2", "m", LAYERS).plan.slots, SLOTS)


# ---------------------------------------------------------------- errors: one line, exit 2, no file


def run_import(tmp_path, capsys, src, fmt, *extra, topology="2x2", layers: str | None = "0,1", model="m"):
    out = tmp_path / "out.json"
    layer_args = ["--moe-layers", layers] if layers is not None else []
    code = main(["plan", "import", str(src), "--from", fmt, "--topology", topology, "--model", model, *layer_args,
                 *extra, "-o", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and not out.exists()
    assert err.startswith("locus: error: ") and err.count("\n") == 1, err
    return err


def save_json(path, doc):
    path.write_text(json.dumps(doc))
    return path


def vllm_doc_lists(**changes):
    doc = {k: v.tolist() for k, v in vllm_document(make_plan()).items()}
    doc.update(changes)
    return doc


def test_physical_count_not_divisible_by_ranks(tmp_path, capsys):
    src = save_json(tmp_path / "s.json", {"physical_to_logical_map": [[0, 1, 2, 3, 4, 5]]})
    err = run_import(tmp_path, capsys, src, "sglang", topology="2x2", layers="0")
    assert "6 physical experts per layer do not divide among the 4 ranks of topology 2x2" in err
    assert str(src) in err


@pytest.mark.parametrize("fmt", ["sglang", "vllm", "deepseek"])
def test_expert_missing_in_a_layer(tmp_path, capsys, fmt):
    rows = SLOTS.reshape(2, 8).copy()
    rows[1, rows[1] == 2] = 0  # layer 3 loses expert 2
    src = save_json(tmp_path / "m.json", {"physical_to_logical_map": rows.tolist()})
    layers = "1,3"
    if fmt == "sglang":
        full = np.tile(np.arange(8) % E, (4, 1))
        full[[1, 3]] = rows
        src = save_json(tmp_path / "m.json", {"physical_to_logical_map": full.tolist()})
    err = run_import(tmp_path, capsys, src, fmt, "--num-experts", str(E), layers=layers)
    assert "layer 3: expert(s) 2 have no physical slot" in err


@pytest.mark.parametrize("fmt", ["vllm", "deepseek"])
def test_row_count_differs_from_moe_layers(tmp_path, capsys, fmt):
    src = tmp_path / "m.pt"
    export_plan(make_plan(), fmt, src)
    err = run_import(tmp_path, capsys, src, fmt, layers="1,3,5")
    assert "the map has 2 MoE layer rows, but --moe-layers names 3 layers" in err


def test_sglang_moe_layer_beyond_the_rows(tmp_path, capsys):
    src = tmp_path / "m.json"
    export_plan(make_plan(), "sglang", src)  # 4 rows
    err = run_import(tmp_path, capsys, src, "sglang", layers="1,9")
    assert "--moe-layers names layer 9, but the map has rows for layers 0..3 only" in err


@pytest.mark.parametrize("spec, message", [
    ("3,1", "strictly increasing"),
    ("1,1", "strictly increasing"),
    ("a,b", "cannot parse"),
])
def test_bad_moe_layer_list(tmp_path, capsys, spec, message):
    src = tmp_path / "m.pt"
    export_plan(make_plan(), "vllm", src)
    assert message in run_import(tmp_path, capsys, src, "vllm", layers=spec)


def test_vllm_replica_count_disagrees(tmp_path, capsys):
    count = vllm_document(make_plan())["logical_replica_count"].copy()
    count[1, 4] = 2
    src = save_json(tmp_path / "v.json", vllm_doc_lists(logical_replica_count=count.tolist()))
    err = run_import(tmp_path, capsys, src, "vllm")
    assert "layer 1, expert 4: logical_replica_count says 2 replica(s), physical_to_logical_map places 1" in err


def test_vllm_logical_to_physical_disagrees(tmp_path, capsys):
    l2p = vllm_document(make_plan())["logical_to_physical_map"].copy()
    l2p[0, 1, 0], l2p[0, 2, 0] = l2p[0, 2, 0], l2p[0, 1, 0]  # experts 1 and 2 swap their physical slot
    src = save_json(tmp_path / "v.json", vllm_doc_lists(logical_to_physical_map=l2p.tolist()))
    err = run_import(tmp_path, capsys, src, "vllm", layers="1,3")
    assert ("layer 1, expert 1: logical_to_physical_map lists physical [2], "
            "physical_to_logical_map places it at [1]") in err


def test_vllm_maps_disagree_on_layer_rows(tmp_path, capsys):
    count = vllm_document(make_plan())["logical_replica_count"][:1]
    src = save_json(tmp_path / "v.json", vllm_doc_lists(logical_replica_count=count.tolist()))
    assert "logical_replica_count has 1 layer rows, physical_to_logical_map has 2" in run_import(
        tmp_path, capsys, src, "vllm")


def test_vllm_maps_disagree_on_expert_count(tmp_path, capsys):
    count = vllm_document(make_plan())["logical_replica_count"][:, :5]
    src = save_json(tmp_path / "v.json", vllm_doc_lists(logical_replica_count=count.tolist()))
    assert "disagree on the number of experts ([5, 6])" in run_import(tmp_path, capsys, src, "vllm")


@pytest.mark.parametrize("fmt, value, message", [
    ("sglang", -1, "layer 1, physical expert 3: logical id -1 is outside 0..5"),
    ("vllm", 6, "layer 1, physical expert 3: logical id 6 is outside 0..5"),
])
def test_logical_id_out_of_range(tmp_path, capsys, fmt, value, message):
    rows = np.tile(np.arange(8) % E, (2, 1))
    rows[1, 3] = value
    src = save_json(tmp_path / "m.json", {"physical_to_logical_map": rows.tolist()})
    assert message in run_import(tmp_path, capsys, src, fmt, "--num-experts", str(E))


def test_physical_id_out_of_range_in_logical_to_physical(tmp_path, capsys):
    l2p = vllm_document(make_plan())["logical_to_physical_map"].copy()
    l2p[0, 1, 1] = 8
    src = save_json(tmp_path / "v.json", vllm_doc_lists(logical_to_physical_map=l2p.tolist()))
    assert "layer 0, expert 1: logical_to_physical_map names physical expert 8, outside 0..7" in run_import(
        tmp_path, capsys, src, "vllm")


def test_num_experts_contradicting_the_map(tmp_path, capsys):
    src = tmp_path / "v.pt"
    export_plan(make_plan(), "vllm", src)
    assert "the map is for 6 experts, --num-experts says 7" in run_import(
        tmp_path, capsys, src, "vllm", "--num-experts", "7")


@pytest.mark.parametrize("name, content, fmt, message", [
    ("bad.json", "{not json", "sglang", "not valid JSON (line 1"),
    ("bad.pt", "plain text", "vllm", "not a readable torch.save file"),
    ("map.txt", "{}", "sglang", "unknown file type '.txt'; use a .json or .pt file name"),
    ("nokey.json", json.dumps({"logical_count": [[1]]}), "sglang", "not an SGLang expert-location file"),
    ("nokey.json", json.dumps({"something": 1}), "vllm", "not a vllm expert map"),
    ("two.json", json.dumps([[[0]], [[[0]]]]), "deepseek", "not a deepseek expert map"),
    ("flat.json", json.dumps({"physical_to_logical_map": [0, 1, 2, 3]}), "vllm",
     "physical_to_logical_map has 1 dimension(s) [4], expected 2"),
    ("ragged.json", json.dumps({"physical_to_logical_map": [[0, 1], [2]]}), "sglang", "not a rectangular array"),
    ("float.json", json.dumps({"physical_to_logical_map": [[0.0, 1.5, 2, 3]]}), "sglang",
     "holds float64 values, expected integers"),
    ("empty.json", json.dumps({"physical_to_logical_map": [[]]}), "vllm", "is empty"),
])
def test_bad_files(tmp_path, capsys, name, content, fmt, message):
    src = tmp_path / name
    src.write_text(content)
    err = run_import(tmp_path, capsys, src, fmt)
    assert message in err and str(src) in err


def test_float_tensor_in_a_pt_file(tmp_path, capsys):
    src = tmp_path / "f.pt"
    torch.save({"physical_to_logical_map": torch.zeros(2, 8)}, src)
    assert "holds torch.float32 values, expected integers" in run_import(tmp_path, capsys, src, "vllm")


def test_missing_source_file(tmp_path, capsys):
    assert "no such file" in run_import(tmp_path, capsys, tmp_path / "absent.pt", "vllm")


def test_bad_topology(tmp_path, capsys):
    src = tmp_path / "m.pt"
    export_plan(make_plan(), "vllm", src)
    assert "not of the form NODESxGPUS" in run_import(tmp_path, capsys, src, "vllm", topology="four")


def test_export_errors(plan_file, tmp_path, capsys):
    cases = [
        (["--to", "sglang", "-o", str(tmp_path / "s.json"), "--num-hidden-layers", "3"],
         "--num-hidden-layers 3 is too small: the plan places layer 3"),
        (["--to", "vllm", "-o", str(tmp_path / "v.npy")], "unknown file type '.npy'"),
        (["--to", "vllm", "-o", str(tmp_path / "v.pt"), "--num-hidden-layers", "5"], "applies to --to sglang only"),
        (["--to", "vllm", "-o", str(tmp_path / "no" / "v.pt")], "directory"),
    ]
    for args, message in cases:
        assert main(["plan", "export", str(plan_file), *args]) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]  # nothing written
    assert main(["plan", "export", str(tmp_path / "absent.json"), "--to", "vllm", "-o", str(tmp_path / "v.pt")]) == 2
    assert "cannot read placement plan" in capsys.readouterr().err


def test_api_raises_locus_error():
    with pytest.raises(LocusError, match="too small"):
        sglang_document(make_plan(), num_hidden_layers=2)
    with pytest.raises(LocusError, match="unknown format"):
        export_plan(make_plan(), "megatron", "x.json")


def test_cli_format_choices_match_the_converters():
    from locus.routing.plan.interop import FORMATS
    from locus.routing.planners.cli import MAP_FORMATS

    assert MAP_FORMATS == FORMATS


# ---------------------------------------------------------------- untrusted files (issue 41, finding 8)


def import_with_memory_cap(tmp_path, *args: str):
    """`locus plan import` in a process whose address space is capped at 1 GiB: the old importer sized a
    bincount by the file's largest id (2e9 -> 16.8 GB RSS, OOM-killed; 1e15 -> MemoryError)."""
    import resource
    import subprocess
    import sys

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))

    out = tmp_path / "out.json"
    proc = subprocess.run([sys.executable, "-m", "locus.cli", "plan", "import", *args, "--topology", "1x1", "--model",
                           "m", "--moe-layers", "0", "-o", str(out)], capture_output=True, text=True, timeout=120,
                          preexec_fn=cap)
    assert not out.exists()
    return proc


@pytest.mark.parametrize("fmt", ["sglang", "vllm", "deepseek"])
@pytest.mark.parametrize("value", [2_000_000_000, 10**15])
def test_a_huge_logical_id_is_refused_before_anything_is_sized_by_it(tmp_path, fmt, value):
    src = save_json(tmp_path / "m.json", {"physical_to_logical_map": [[value]]} if fmt != "deepseek" else
                    {"phy2log": [[value]], "log2phy": None, "logcnt": None})
    proc = import_with_memory_cap(tmp_path, str(src), "--from", fmt)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == (f"locus: error: {src}: logical id {value} implies at least {value + 1} experts, but a "
                           "layer has only 1 physical experts (every expert needs one in every layer)\n")


def test_a_huge_num_experts_flag_is_refused_before_anything_is_sized_by_it(tmp_path):
    src = save_json(tmp_path / "m.json", {"physical_to_logical_map": [[0, 1]]})
    proc = import_with_memory_cap(tmp_path, str(src), "--from", "vllm", "--num-experts", str(10**15))
    assert proc.returncode == 2 and "1000000000000000 experts cannot all have a slot among the 2" in proc.stderr


def test_one_expert_holding_most_slots_is_compared_without_a_dense_map(tmp_path):
    """The logical-side map is checked as (layer, expert, physical) triples: a dense [L, E, X] map of
    a 60,000-slot file whose expert 0 holds half the slots (X = 30,001) would take 7.2 GB."""
    P = 60_000
    p2l = np.concatenate([np.arange(P // 2), np.zeros(P // 2, dtype=np.int64)])[None]
    l2p = [[[0]] + [[e] for e in range(1, P // 2)]]  # [1, E, 1]: expert 0's other replicas left out
    src = save_json(tmp_path / "m.json", {"physical_to_logical_map": p2l.tolist(), "logical_to_physical_map": l2p})
    proc = import_with_memory_cap(tmp_path, str(src), "--from", "vllm")
    assert proc.returncode == 2, proc.stderr
    assert (f"layer 0, expert 0: logical_to_physical_map lists physical [0], physical_to_logical_map places it at "
            f"[0, 30000, 30001, 30002, 30003, 30004, 30005, 30006, 30007, 30008, ...] (30001 in all)") in proc.stderr


@pytest.mark.parametrize("name, content, message", [
    ("garbage.json", bytes(range(200, 256)) * 4, "not UTF-8 text (byte 0: invalid continuation byte)"),
    ("utf16.json", json.dumps({"format": "locus-placement"}).encode("utf-16"), "(it looks like UTF-16: save it as UTF-8)"),
    ("deep.json", b"[" * 100_000, "JSON nested too deeply to read"),
    ("digits.json", b"[" + b"9" * 5000 + b"]", "not valid JSON"),
    ("huge.json", json.dumps({"format": "locus-placement", "version": 1, "model": "m", "num_experts": 2,
                              "moe_layers": [0], "topology": {"nodes": 10**9, "gpus_per_node": 10**9,
                                                              "slots_per_gpu": 10**6},
                              "layers": [{"layer": 0, "slots": [[0, 1]]}]}).encode(),
     "layer 0: slots lists 1 ranks, topology 1000000000x1000000000 (1000000 slots/GPU) has 1000000000000000000"),
])
def test_export_of_a_bad_plan_file_is_one_line(tmp_path, capsys, name, content, message):
    """Issue 41: garbage, UTF-16 and a huge topology gave raw tracebacks (UnicodeDecodeError; numpy's
    "array is too big" while allocating for the topology's word, before reading the lists)."""
    src = tmp_path / name
    src.write_bytes(content)
    assert main(["plan", "export", str(src), "--to", "vllm", "-o", str(tmp_path / "v.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"locus: error: {src}: ") and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "v.json").exists()
