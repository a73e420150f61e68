"""The KV block pool: allocation, reference counts, and prefix caching.

A sequence owns a block table (block ids in position order). Blocks are reference counted: a block
shared by several sequences (a cached prompt prefix, or the prompt of an `n > 1` request) returns to
the pool only when its last holder lets go.

Prefix caching: once a block is *full* and its KV computed, it is registered under a hash of its
tokens chained with the previous block's hash (so a hash names the whole prefix, not just 16 tokens).
A new sequence whose prompt starts with the same full blocks takes them instead of recomputing.
Freed blocks keep their hash and content while they sit in the free pool; allocation takes
never-cached blocks first and evicts the least recently freed cached block last, so a popular prefix
survives as long as memory allows.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass


@dataclass
class PrefixCacheStats:
    queried_blocks: int = 0  # full prompt blocks looked up
    hit_blocks: int = 0  # of which found in the cache


def chain_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
    return hash((parent, tokens))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token (got {num_blocks} x {block_size})")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.free_plain: deque[int] = deque(range(num_blocks))  # never cached (or evicted)
        self.free_cached: OrderedDict[int, None] = OrderedDict()  # hashed, refcount 0, LRU first
        self.cached: dict[int, int] = {}  # hash -> block id
        self.stats = PrefixCacheStats()

    # --- pool accounting ------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_plain) + len(self.free_cached)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # --- allocation -----------------------------------------------------------------------------
    def allocate(self) -> int:
        if self.free_plain:
            block = self.free_plain.popleft()
        elif self.free_cached:
            block, _ = self.free_cached.popitem(last=False)  # evict the least recently freed
            del self.cached[self.block_hash[block]]
            self.block_hash[block] = None
        else:
            raise RuntimeError("KV block pool exhausted (the scheduler should have preempted)")
        self.ref_count[block] = 1
        return block

    def take(self, block: int) -> None:
        """Add a holder to an existing block (a prefix hit or a fork)."""
        if self.ref_count[block] == 0:
            self.free_cached.pop(block)
        self.ref_count[block] += 1

    def free(self, table: list[int]) -> None:
        """Drop one holder from each block of a table (last block first, so LRU evicts tails first)."""
        for block in reversed(table):
            self.ref_count[block] -= 1
            if self.ref_count[block] < 0:
                raise RuntimeError(f"block {block} freed more often than taken")
            if self.ref_count[block] == 0:
                if self.block_hash[block] is not None:
                    self.free_cached[block] = None
                else:
                    self.free_plain.append(block)
        table.clear()

    # --- prefix caching -------------------------------------------------------------------------
    def match_prefix(self, tokens: list[int], max_blocks: int) -> tuple[list[int], int | None]:
        """Take the longest cached run of full blocks that prefixes `tokens` (at most max_blocks).
        Returns the block ids (now held) and the hash of the last one."""
        taken: list[int] = []
        parent: int | None = None
        if not self.enable_prefix_caching:
            return taken, parent
        bs = self.block_size
        for i in range(min(len(tokens) // bs, max_blocks)):
            h = chain_hash(parent, tuple(tokens[i * bs:(i + 1) * bs]))
            self.stats.queried_blocks += 1
            block = self.cached.get(h)
            if block is None:
                break
            self.stats.hit_blocks += 1
            self.take(block)
            taken.append(block)
            parent = h
        return taken, parent

    def register(self, block: int, parent: int | None, tokens: tuple[int, ...]) -> int:
        """Record a full, computed block under its chained hash; returns the hash."""
        h = chain_hash(parent, tokens)
        if self.enable_prefix_caching and self.block_hash[block] is None and h not in self.cached:
            self.block_hash[block] = h
            self.cached[h] = block
        return h
