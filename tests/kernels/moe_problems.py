"""Problem makers and tolerances shared by the kernel tests (shape legend as in locus/kernels)."""

from __future__ import annotations

import pytest
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOLERANCE = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}  # atol = rtol, by dtype


def make_routing(T: int, K: int, E: int, kind: str = "random", seed: int = 0):
    """topk_ids [T, K] (distinct experts per token) and topk_weights [T, K] in (0.1, 1).

    kind: "random" uniform; "one_expert" every token's slot k goes to expert k (so with K=1 all
    tokens share expert 0); "even_only" only even experts get tokens (odd ones stay empty).
    """
    gen = torch.Generator().manual_seed(seed)
    if kind == "one_expert":
        ids = torch.arange(K).repeat(T, 1)
    else:
        pool = E if kind == "random" else (E + 1) // 2
        ids = torch.stack([torch.randperm(pool, generator=gen)[:K] for _ in range(T)])
        if kind == "even_only":
            ids = ids * 2
    weights = 0.1 + 0.9 * torch.rand(T, K, generator=gen)
    return ids.to(DEVICE), weights.to(DEVICE)


def make_experts(T: int, E: int, H: int, I: int, dtype: torch.dtype, seed: int = 0):
    """x [T, H], gate_up [E, H, 2I], down [E, I, H], scaled so every stage stays O(1)."""
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(T, H, generator=gen)
    gate_up = torch.randn(E, H, 2 * I, generator=gen) / H**0.5
    down = torch.randn(E, I, H, generator=gen) / I**0.5
    return (t.to(DEVICE, dtype) for t in (x, gate_up, down))


def half_expert_map(E: int) -> torch.Tensor:
    """This rank holds the even experts: global 2j -> local j, odd -> -1."""
    expert_map = torch.full((E,), -1, dtype=torch.int32)
    expert_map[::2] = torch.arange((E + 1) // 2, dtype=torch.int32)
    return expert_map.to(DEVICE)


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    tol = TOLERANCE[expected.dtype]
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


def capture_sync_free(call):
    """(graph, output) of `call` captured in a CUDA graph, after one call to compile and one under
    torch.cuda.set_sync_debug_mode("error") (a host sync in it raises)."""
    call()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        call()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    return graph, out


def replay_with_new_routing(graph, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, E: int,
                            seeds=(1, 2)):
    """For each seed: new routing over E experts and new inputs copied into the captured tensors,
    the graph replayed; yields after each replay (check the captured output then)."""
    T, K = ids.shape
    for seed in seeds:
        new_ids, new_weights = make_routing(T, K, E, seed=seed)
        ids.copy_(new_ids)
        weights.copy_(new_weights)
        x.normal_()
        graph.replay()
        yield seed


requires_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
