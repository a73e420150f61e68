"""Align step (Triton) against its torch reference, and the layout's invariants."""

from __future__ import annotations

import pytest
import torch
from moe_problems import DEVICE, half_expert_map, make_routing

from locus.kernels.moe_align import align_routing, align_routing_reference, max_padded_rows


def runs_by_block(routing):
    """block -> sorted pair ids of that block's expert run; order inside a run is free on a GPU."""
    used = int(routing.num_padded.item())
    blocks = routing.block_expert_ids[: used // routing.block_m].tolist()
    rows = routing.sorted_pair_ids[:used].view(-1, routing.block_m)
    runs = {}
    for b, e in enumerate(blocks):
        runs.setdefault(e, []).extend(rows[b].tolist())
    return {e: sorted(p) for e, p in runs.items()}


def assert_same_layout(actual, expected):
    assert actual.num_pairs == expected.num_pairs and actual.block_m == expected.block_m
    assert actual.num_padded.item() == expected.num_padded.item()
    assert torch.equal(actual.block_expert_ids.cpu(), expected.block_expert_ids.cpu())
    assert runs_by_block(actual) == runs_by_block(expected)


@pytest.mark.parametrize(
    "T, K, E, block_m, kind",
    [
        (1, 1, 4, 16, "random"),
        (7, 2, 16, 16, "random"),
        (64, 8, 128, 16, "random"),
        (300, 1, 16, 32, "random"),
        (300, 8, 128, 16, "random"),
        (300, 1, 16, 16, "one_expert"),
        (64, 2, 16, 64, "even_only"),
    ],
)
@pytest.mark.parametrize("with_map", [False, True])
def test_align_matches_reference(T, K, E, block_m, kind, with_map):
    ids, _ = make_routing(T, K, E, kind)
    expert_map = half_expert_map(E) if with_map else None
    local_experts = (E + 1) // 2 if with_map else E
    actual = align_routing(ids, local_experts, block_m, expert_map)
    expected = align_routing_reference(ids, local_experts, block_m, expert_map)
    assert_same_layout(actual, expected)


@pytest.mark.parametrize("T, K, E, block_m, kind", [(1, 1, 4, 16, "random"), (7, 2, 16, 32, "random"),
                                                    (32, 8, 128, 16, "random"), (300, 1, 16, 16, "one_expert"),
                                                    (5, 1, 1, 64, "random")])
@pytest.mark.parametrize("single_program", [True, False], ids=["one_program", "three_kernels"])
def test_both_align_paths_match_reference(T, K, E, block_m, kind, single_program):
    ids, _ = make_routing(T, K, E, kind)
    ids[::3, 0] = -1  # skipped slots
    expected = align_routing_reference(ids, E, block_m)
    actual = align_routing(ids, E, block_m, single_program=single_program)
    assert_same_layout(actual, expected)
    assert (actual.sorted_pair_ids.cpu()[int(actual.num_padded.item()):] == T * K).all()
    if single_program:  # no atomics: the layout is the reference's, order within runs included
        assert torch.equal(actual.sorted_pair_ids, expected.sorted_pair_ids)


def test_layout_invariants():
    T, K, E, block_m = 300, 2, 16, 16
    ids, _ = make_routing(T, K, E, "even_only", seed=3)
    routing = align_routing(ids, E, block_m)
    used = int(routing.num_padded.item())
    counts = torch.bincount(ids.flatten().cpu(), minlength=E)
    assert used == int(sum(-(-c // block_m) * block_m for c in counts.tolist()))
    assert used <= routing.sorted_pair_ids.numel() == max_padded_rows(T * K, E, block_m)
    blocks = routing.block_expert_ids.cpu()
    assert (blocks[used // block_m:] == -1).all()
    assert (torch.diff(blocks[: used // block_m]) >= 0).all()  # runs are in expert order
    rows = routing.sorted_pair_ids[:used].cpu().view(-1, block_m)
    flat_ids = ids.flatten().cpu()
    for b in range(used // block_m):
        real = rows[b][rows[b] < T * K]
        assert (flat_ids[real.long()] == blocks[b]).all()
    assert sorted(rows[rows < T * K].tolist()) == list(range(T * K))  # every pair exactly once
    assert (routing.sorted_pair_ids.cpu()[used:] == T * K).all()


def test_skipped_pairs_are_left_out():
    ids = torch.tensor([[0, 1], [1, -1], [3, 2]], device=DEVICE)
    expert_map = torch.tensor([-1, 0, 1, -1], dtype=torch.int32, device=DEVICE)  # holds experts 1 and 2
    routing = align_routing(ids, 2, 16, expert_map)
    assert runs_by_block(routing) == {0: [1, 2] + [6] * 14, 1: [5] + [6] * 15}
    assert routing.num_padded.item() == 32
    assert_same_layout(routing, align_routing_reference(ids, 2, 16, expert_map))


def test_out_of_range_ids_are_dropped_not_read():
    ids = torch.tensor([[0, 9], [2, 4]], device=DEVICE)  # 9 and 4 are past the 4-entry map / 4 experts
    expert_map = torch.tensor([0, -1, 1, -1], dtype=torch.int32, device=DEVICE)
    for local, mapping in ((4, None), (2, expert_map)):
        actual = align_routing(ids, local, 16, mapping)
        assert_same_layout(actual, align_routing_reference(ids, local, 16, mapping))
        assert 1 not in runs_by_block(actual).get(0, []) and 3 not in sum(runs_by_block(actual).values(), [])


def test_empty_batch():
    routing = align_routing(torch.zeros(0, 2, dtype=torch.int64, device=DEVICE), 4, 16)
    assert routing.num_padded.item() == 0 and routing.max_blocks == 0


def test_rejects_bad_input():
    with pytest.raises(ValueError, match="integer"):
        align_routing(torch.zeros(3, 2, device=DEVICE), 4, 16)
    with pytest.raises(ValueError, match="positive"):
        align_routing(torch.zeros(3, 2, dtype=torch.int64, device=DEVICE), 0, 16)
