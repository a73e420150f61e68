"""SGLang expert-distribution dumps built here with torch.save: per-token, stat and per-pass modes."""

from __future__ import annotations

import numpy as np
import pytest

from locus.traces.counts import read_counts
from locus.traces.format import TraceFormatError
from locus.traces.importers import ImportOptions, import_trace
from locus.traces.reader import TraceReader

torch = pytest.importorskip("torch")

# 4 model layers, layer 0 dense; 6 physical experts, physical 4 and 5 replicate logical 0 and 1.
P2L = torch.tensor([[0, 1, 2, 3, 0, 1]] * 4)


def sglang_topk(layer_rows: list[list[list[int]]]) -> torch.Tensor:
    """[3 MoE layers][n tokens][2 slots] physical ids -> SGLang's [4 layers, n, 8] padded with -1."""
    n = len(layer_rows[0])
    out = torch.full((4, n, 8), -1, dtype=torch.int32)
    for i, layer in enumerate(layer_rows, start=1):
        if n:
            out[i, :, :2] = torch.tensor(layer, dtype=torch.int32)
    return out


def per_token_dump() -> dict:
    extend = sglang_topk([[[0, 1], [2, 3], [4, 2], [1, 3], [5, 0]]] * 3)  # 5 tokens: sequences of 3 and 2
    decode = sglang_topk([[[3, 2], [4, 1]]] * 3)  # 2 decode tokens
    idle = sglang_topk([[]] * 3)
    records = [
        {"forward_pass_id": 0, "rank": 0, "gatherer_key": "primary", "input_ids": [1] * 5, "positions": list(range(5)),
         "extend_seq_lens": [3, 2], "forward_mode": 1, "topk_ids_of_layer": extend, "misc_objects": [],
         "global_physical_count": torch.zeros(4, 6, dtype=torch.int32)},
        {"forward_pass_id": 1, "rank": 0, "gatherer_key": "primary", "input_ids": [1, 1], "positions": [3, 2],
         "extend_seq_lens": None, "forward_mode": 2, "topk_ids_of_layer": decode, "misc_objects": [],
         "global_physical_count": torch.zeros(4, 6, dtype=torch.int32)},
        {"forward_pass_id": 2, "rank": 0, "gatherer_key": "primary", "input_ids": [], "positions": [],
         "extend_seq_lens": [], "forward_mode": 4, "topk_ids_of_layer": idle, "misc_objects": []},
    ]
    return {"records": records, "last_physical_to_logical_map": P2L}


def test_sglang_per_token(tmp_path):
    (tmp_path / "dump").mkdir()
    torch.save(per_token_dump(), tmp_path / "dump" / "expert_distribution_recorder_1.0_0.pt")
    result = import_trace("sglang", tmp_path / "dump", tmp_path / "t", ImportOptions(hidden_size=32))
    r = TraceReader(tmp_path / "t")
    assert result.kind == "tokens"
    assert r.meta.moe_layers == (1, 2, 3) and r.meta.top_k == 2 and r.meta.num_experts == 4
    stem = "expert_distribution_recorder_1.0_0"
    assert [(q.id, q.prompt_tokens, q.tokens) for q in r.requests] == [
        (f"{stem}#0/seq0", 3, 3), (f"{stem}#0/seq1", 2, 2), (f"{stem}#1", 0, 2)]
    logical = np.array([[0, 1], [2, 3], [0, 2], [1, 3], [1, 0], [3, 2], [0, 1]])  # physical 4 -> 0, 5 -> 1
    np.testing.assert_array_equal(np.asarray(r.expert_ids), np.repeat(logical[:, None, :], 3, axis=1))


def test_sglang_stat_dump_becomes_a_count_trace(tmp_path):
    counts = torch.zeros(2, 4, 4, dtype=torch.int32)  # [steps, layers, experts], layer 0 dense
    counts[0, 1:] = torch.tensor([5, 1, 1, 1])
    counts[1, 1:] = torch.tensor([1, 3, 0, 0])
    torch.save({"rank": 0, "logical_count": counts, "average_utilization_rate_over_window": None}, tmp_path / "s.pt")
    result = import_trace("sglang", tmp_path / "s.pt", tmp_path / "c", ImportOptions(hidden_size=32, top_k=2))
    c = read_counts(tmp_path / "c")
    assert result.kind == "counts" and c.meta.moe_layers == (1, 2, 3)
    np.testing.assert_array_equal(c.counts, [[6, 4, 1, 1]] * 3)
    assert c.num_tokens == 6  # 12 pairs per layer / top-2
    with pytest.raises(TraceFormatError, match="top-k"):
        import_trace("sglang", tmp_path / "s.pt", tmp_path / "c2", ImportOptions(hidden_size=32))


def test_sglang_per_pass_counts_map_physical_to_logical(tmp_path):
    phys = torch.zeros(4, 6, dtype=torch.int32)
    phys[2] = torch.tensor([1, 0, 0, 2, 3, 4])  # physical 4 and 5 add to logical 0 and 1
    data = {"records": [{"forward_pass_id": 0, "global_physical_count": phys}] * 2, "last_physical_to_logical_map": P2L}
    torch.save(data, tmp_path / "p.pt")
    import_trace("sglang", tmp_path / "p.pt", tmp_path / "c", ImportOptions(model="mixtral-8x7b"))
    c = read_counts(tmp_path / "c")
    assert c.meta.moe_layers == (2,) and c.meta.top_k == 2 and c.meta.hidden_size == 4096  # from the preset
    np.testing.assert_array_equal(c.counts, [[8, 8, 0, 4]])


def test_sglang_bad_files(tmp_path):
    (tmp_path / "junk.pt").write_bytes(b"not a torch file")
    with pytest.raises(TraceFormatError, match="junk.pt: not a readable torch.save file"):
        import_trace("sglang", tmp_path / "junk.pt", tmp_path / "t", ImportOptions(hidden_size=32))
    torch.save({"something": 1}, tmp_path / "other.pt")
    with pytest.raises(TraceFormatError, match="other.pt: not an SGLang expert-distribution dump"):
        import_trace("sglang", tmp_path / "other.pt", tmp_path / "t", ImportOptions(hidden_size=32))
    (tmp_path / "empty").mkdir()
    with pytest.raises(TraceFormatError, match="no .pt files"):
        import_trace("sglang", tmp_path / "empty", tmp_path / "t", ImportOptions(hidden_size=32))


@pytest.mark.parametrize("kind", ["per_pass", "per_token"])
def test_a_huge_logical_id_in_the_expert_map_is_refused_before_anything_is_sized_by_it(tmp_path, kind):
    """Issue 41, finding 8 (all importers): a per-pass dump's map sized a [layers, largest id + 1] count
    array (1e15: numpy's "array is too big"; 2e9: 64 GB)."""
    p2l = P2L.clone()
    p2l[2, 3] = 10**15
    if kind == "per_pass":
        data = {"records": [{"forward_pass_id": 0, "global_physical_count": torch.ones(4, 6, dtype=torch.int32)}],
                "last_physical_to_logical_map": p2l}
    else:
        data = {**per_token_dump(), "last_physical_to_logical_map": p2l}
    torch.save(data, tmp_path / "p.pt")
    with pytest.raises(TraceFormatError, match=r"p.pt: last_physical_to_logical_map holds logical id 1000000000000000, "
                                               r"outside 0..32766 \(what a trace \(int16 ids\) allows\)"):
        import_trace("sglang", tmp_path / "p.pt", tmp_path / "c", ImportOptions(hidden_size=32, top_k=2))
    with pytest.raises(TraceFormatError, match=r"holds logical id 1000000000000000, outside 0..3 \(what --num-experts"):
        import_trace("sglang", tmp_path / "p.pt", tmp_path / "c", ImportOptions(hidden_size=32, top_k=2, num_experts=4))
