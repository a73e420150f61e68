"""Align step of fused MoE: sort the (token, slot) pairs by expert and pad each expert's run to BLOCK_M.

The grouped GEMMs that follow process BLOCK_M rows at a time and multiply every row of a block by the
same expert's weights. So the T*K pairs are laid out expert by expert, each expert's run padded up to a
multiple of BLOCK_M with a sentinel id (T*K), and every block records which expert it belongs to. A
GEMM program then needs one load to learn its expert, and padding rows are masked out.

Pairs whose expert is not held by this rank (expert_map gives -1) or whose id is negative are left out
of the layout entirely: no block computes them.

Large batches take three small kernels, because the layout needs a global prefix sum between
counting and placing:
    1. count    (one program per chunk of pairs)  atomically count the pairs of each local expert
    2. layout   (one program)                     padded run starts, padded total, expert id per block
    3. place    (one program per chunk of pairs)  each pair takes the next free row of its expert's run
Step 3 claims rows with atomics, so on a GPU the order of pairs *within* one expert's run is not fixed.
Each output row depends only on its own input row, so results do not depend on that order.

Decode-sized batches (at most SINGLE_PROGRAM_MAX_PAIRS pairs) take one program that counts, lays out
and places in turn, with no atomics and no buffer to clear first: one launch instead of five (two
fills and three kernels), which matters when a whole MoE layer takes tens of microseconds, and a
stable layout (pairs keep their order within a run, as in `align_routing_reference`).
Neither path reads anything back to the host: the grid sizes come from T, K, E and BLOCK_M alone
(`max_padded_rows`), so the step can be captured in a CUDA graph.

Shape legend: T tokens, K slots per token, P = T*K pairs, E local experts, M_pad padded rows.
    topk_ids          [T, K]       global expert ids
    expert_map        [E_global]   global id -> local expert, or -1 when not held here
    sorted_pair_ids   [M_pad_max]  pair index t*K + k, or P for padding
    block_expert_ids  [M_pad_max / BLOCK_M]  local expert of each block, -1 past the padded end
    num_padded        [1]          padded row count actually used (stays on the device)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@dataclass(frozen=True)
class AlignedRouting:
    """The pairs of a batch laid out expert by expert, in BLOCK_M-row blocks (see module docstring)."""

    sorted_pair_ids: torch.Tensor  # [M_pad_max] int32
    block_expert_ids: torch.Tensor  # [M_pad_max // block_m] int32
    num_padded: torch.Tensor  # [1] int32
    block_m: int
    num_pairs: int  # P = T*K; also the padding sentinel in sorted_pair_ids

    @property
    def max_blocks(self) -> int:
        """Upper bound on the number of BLOCK_M blocks; the GEMM grid is sized by it."""
        return self.block_expert_ids.numel()


def max_padded_rows(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Most rows the layout can need: each non-empty expert wastes at most block_m - 1 rows."""
    padded = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return triton.cdiv(padded, block_m) * block_m


@triton.jit
def _local_expert(topk_ids_ptr, expert_map_ptr, offs, num_pairs, num_experts, map_size, HAS_MAP: tl.constexpr):
    """Local expert of each pair in offs, and whether the pair is computed here."""
    in_range = offs < num_pairs
    expert = tl.load(topk_ids_ptr + offs, mask=in_range, other=-1).to(tl.int32)
    if HAS_MAP:
        known = in_range & (expert >= 0) & (expert < map_size)
        expert = tl.load(expert_map_ptr + expert, mask=known, other=-1).to(tl.int32)
    # Out-of-range ids are a caller bug; dropping them beats touching memory past the buffers.
    valid = in_range & (expert >= 0) & (expert < num_experts)
    return expert, valid


@triton.jit
def _count_kernel(topk_ids_ptr, expert_map_ptr, counts_ptr, num_pairs, num_experts, map_size,
                  HAS_MAP: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    expert, valid = _local_expert(topk_ids_ptr, expert_map_ptr, offs, num_pairs, num_experts, map_size, HAS_MAP)
    tl.atomic_add(counts_ptr + expert, 1, mask=valid)


@triton.jit
def _store_block_experts(block_expert_ptr, ends, total, max_blocks, BLOCK_M: tl.constexpr,
                         BLOCKS_PER_STEP: tl.constexpr):
    """Expert of each BLOCK_M-row block, -1 past the padded end (`ends`: each run's end row)."""
    # Block b belongs to the first expert whose run ends after row b*BLOCK_M, i.e. its index is the
    # number of runs ending at or before that row (empty runs end where they start, so they count too).
    for step in range(0, tl.cdiv(max_blocks, BLOCKS_PER_STEP)):
        blocks = step * BLOCKS_PER_STEP + tl.arange(0, BLOCKS_PER_STEP)
        first_row = blocks * BLOCK_M
        expert = tl.sum((ends[None, :] <= first_row[:, None]).to(tl.int32), axis=1)
        expert = tl.where(first_row < total, expert, -1)
        tl.store(block_expert_ptr + blocks, expert, mask=blocks < max_blocks)


@triton.jit
def _layout_kernel(counts_ptr, cursor_ptr, block_expert_ptr, num_padded_ptr, num_experts, max_blocks,
                   BLOCK_M: tl.constexpr, EXPERTS_POW2: tl.constexpr, BLOCKS_PER_STEP: tl.constexpr):
    experts = tl.arange(0, EXPERTS_POW2)
    counts = tl.load(counts_ptr + experts, mask=experts < num_experts, other=0)
    padded = tl.cdiv(counts, BLOCK_M) * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    # The place step claims rows by bumping this cursor, so it starts at each run's first row.
    tl.store(cursor_ptr + experts, starts, mask=experts < num_experts)
    total = tl.sum(padded, axis=0)
    tl.store(num_padded_ptr, total)
    _store_block_experts(block_expert_ptr, ends, total, max_blocks, BLOCK_M, BLOCKS_PER_STEP)


@triton.jit
def _place_kernel(topk_ids_ptr, expert_map_ptr, cursor_ptr, sorted_pair_ptr, num_pairs, num_experts, map_size,
                  HAS_MAP: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    expert, valid = _local_expert(topk_ids_ptr, expert_map_ptr, offs, num_pairs, num_experts, map_size, HAS_MAP)
    row = tl.atomic_add(cursor_ptr + expert, 1, mask=valid)
    tl.store(sorted_pair_ptr + row, offs, mask=valid)


@triton.jit
def _align_single_kernel(topk_ids_ptr, expert_map_ptr, sorted_pair_ptr, block_expert_ptr, num_padded_ptr,
                         num_pairs, num_experts, map_size, max_rows, max_blocks,
                         HAS_MAP: tl.constexpr, BLOCK_M: tl.constexpr, EXPERTS_POW2: tl.constexpr,
                         CHUNK: tl.constexpr, ROWS_PER_STEP: tl.constexpr, BLOCKS_PER_STEP: tl.constexpr):
    """The whole layout in one program, for a few hundred pairs (see module docstring)."""
    experts = tl.arange(0, EXPERTS_POW2)
    lane = tl.arange(0, CHUNK)
    num_chunks = tl.cdiv(num_pairs, CHUNK)

    counts = tl.zeros((EXPERTS_POW2,), dtype=tl.int32)
    for c in range(0, num_chunks):
        expert, valid = _local_expert(topk_ids_ptr, expert_map_ptr, c * CHUNK + lane, num_pairs, num_experts,
                                      map_size, HAS_MAP)
        hit = (expert[:, None] == experts[None, :]) & valid[:, None]  # [CHUNK, EXPERTS_POW2] one-hot
        counts += tl.sum(hit.to(tl.int32), axis=0)
    padded = tl.cdiv(counts, BLOCK_M) * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    total = tl.sum(padded, axis=0)
    tl.store(num_padded_ptr, total)

    # A pair's row: its run's start, plus the pairs of its expert in earlier chunks (cursor), plus
    # those before it in its own chunk (rank). Stable, and every row is written by exactly one store.
    cursor = starts
    for c in range(0, num_chunks):
        offs = c * CHUNK + lane
        expert, valid = _local_expert(topk_ids_ptr, expert_map_ptr, offs, num_pairs, num_experts, map_size, HAS_MAP)
        hit = (expert[:, None] == experts[None, :]) & valid[:, None]
        base = tl.sum(tl.where(hit, cursor[None, :], 0), axis=1)
        earlier = (expert[:, None] == expert[None, :]) & valid[None, :] & (lane[None, :] < lane[:, None])
        rank = tl.sum(earlier.to(tl.int32), axis=1)
        tl.store(sorted_pair_ptr + base + rank, offs, mask=valid)
        cursor += tl.sum(hit.to(tl.int32), axis=0)

    # Padding: the tail of each run, then every row past the padded end.
    slot = tl.arange(0, BLOCK_M)
    pad_rows = (starts + counts)[:, None] + slot[None, :]
    pad_ok = (slot[None, :] < (padded - counts)[:, None]) & (experts < num_experts)[:, None]
    tl.store(sorted_pair_ptr + pad_rows, tl.zeros((EXPERTS_POW2, BLOCK_M), dtype=tl.int32) + num_pairs, mask=pad_ok)
    for step in range(0, tl.cdiv(max_rows, ROWS_PER_STEP)):
        rows = step * ROWS_PER_STEP + tl.arange(0, ROWS_PER_STEP)
        tl.store(sorted_pair_ptr + rows, tl.zeros((ROWS_PER_STEP,), dtype=tl.int32) + num_pairs,
                 mask=(rows >= total) & (rows < max_rows))
    _store_block_experts(block_expert_ptr, ends, total, max_blocks, BLOCK_M, BLOCKS_PER_STEP)


SINGLE_PROGRAM_MAX_PAIRS = 256  # up to here one program lays the batch out (decode); above, three kernels


def align_routing(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_m: int,
    expert_map: torch.Tensor | None = None,
    single_program: bool | None = None,
) -> AlignedRouting:
    """Lay out the pairs of topk_ids [T, K] expert by expert in block_m-row blocks (Triton).

    single_program: one program (decode batches) or three kernels; None chooses by the number of pairs."""
    _check_inputs(topk_ids, num_experts, block_m, expert_map)
    device = topk_ids.device
    ids = topk_ids.reshape(-1).contiguous()
    num_pairs = ids.numel()
    rows = max_padded_rows(num_pairs, num_experts, block_m)
    max_blocks = rows // block_m
    if single_program is None:
        single_program = num_pairs <= SINGLE_PROGRAM_MAX_PAIRS

    has_map = expert_map is not None
    map_arg = expert_map.to(device).contiguous() if has_map else ids  # never read without a map
    map_size = map_arg.numel() if has_map else 0
    experts_pow2 = max(2, triton.next_power_of_2(num_experts))
    if single_program and num_pairs > 0:
        sorted_pair_ids = torch.empty(rows, dtype=torch.int32, device=device)
        block_expert_ids = torch.empty(max_blocks, dtype=torch.int32, device=device)
        num_padded = torch.empty(1, dtype=torch.int32, device=device)
        _align_single_kernel[(1,)](ids, map_arg, sorted_pair_ids, block_expert_ids, num_padded,
                                   num_pairs, num_experts, map_size, rows, max_blocks,
                                   HAS_MAP=has_map, BLOCK_M=block_m, EXPERTS_POW2=experts_pow2,
                                   CHUNK=64, ROWS_PER_STEP=1024, BLOCKS_PER_STEP=64)
        return AlignedRouting(sorted_pair_ids, block_expert_ids, num_padded, block_m, num_pairs)

    counts = torch.zeros(num_experts, dtype=torch.int32, device=device)
    cursor = torch.empty(num_experts, dtype=torch.int32, device=device)
    sorted_pair_ids = torch.full((rows,), num_pairs, dtype=torch.int32, device=device)
    block_expert_ids = torch.empty(max_blocks, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)
    routing = AlignedRouting(sorted_pair_ids, block_expert_ids, num_padded, block_m, num_pairs)
    if num_pairs == 0:
        num_padded.zero_()
        return routing

    chunk = 256
    grid = (triton.cdiv(num_pairs, chunk),)
    _count_kernel[grid](ids, map_arg, counts, num_pairs, num_experts, map_size, HAS_MAP=has_map, BLOCK=chunk)
    _layout_kernel[(1,)](counts, cursor, block_expert_ids, num_padded, num_experts, max_blocks,
                         BLOCK_M=block_m, EXPERTS_POW2=experts_pow2, BLOCKS_PER_STEP=64)
    _place_kernel[grid](ids, map_arg, cursor, sorted_pair_ids, num_pairs, num_experts, map_size,
                        HAS_MAP=has_map, BLOCK=chunk)
    return routing


def align_routing_reference(
    topk_ids: torch.Tensor,
    num_experts: int,
    block_m: int,
    expert_map: torch.Tensor | None = None,
) -> AlignedRouting:
    """The same layout in plain torch; pairs keep their original order within an expert's run."""
    _check_inputs(topk_ids, num_experts, block_m, expert_map)
    device = topk_ids.device
    ids = topk_ids.reshape(-1).long()
    num_pairs = ids.numel()
    if expert_map is not None:
        expert_map = expert_map.to(device).long()
        known = (ids >= 0) & (ids < expert_map.numel())
        ids = torch.where(known, expert_map[ids.clamp(0, expert_map.numel() - 1)], -1)
    ids = torch.where((ids >= 0) & (ids < num_experts), ids, -1)

    rows = max_padded_rows(num_pairs, num_experts, block_m)
    sorted_pair_ids = torch.full((rows,), num_pairs, dtype=torch.int32, device=device)
    block_expert_ids = torch.full((rows // block_m,), -1, dtype=torch.int32, device=device)
    start = 0
    for e in range(num_experts):
        pairs = torch.nonzero(ids == e).flatten()
        if pairs.numel() == 0:
            continue
        sorted_pair_ids[start:start + pairs.numel()] = pairs.to(torch.int32)
        run = triton.cdiv(pairs.numel(), block_m) * block_m
        block_expert_ids[start // block_m:(start + run) // block_m] = e
        start += run
    num_padded = torch.tensor([start], dtype=torch.int32, device=device)
    return AlignedRouting(sorted_pair_ids, block_expert_ids, num_padded, block_m, num_pairs)


def _check_inputs(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                  expert_map: torch.Tensor | None) -> None:
    if topk_ids.dim() != 2 or topk_ids.dtype not in (torch.int32, torch.int64, torch.int16):
        raise ValueError(f"topk_ids must be an integer [T, K] tensor, got {topk_ids.dtype} {tuple(topk_ids.shape)}")
    if num_experts < 1 or block_m < 1:
        raise ValueError(f"num_experts ({num_experts}) and block_m ({block_m}) must be positive")
    if expert_map is not None and (expert_map.dim() != 1 or expert_map.dtype.is_floating_point):
        raise ValueError(f"expert_map must be a 1-D integer tensor, got {expert_map.dtype} {tuple(expert_map.shape)}")
