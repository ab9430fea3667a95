"""moejax's KV layer: the one pool type (:class:`KVPool`, keys and values per 16-token
block, with the optional expert-count signature cache), the one block allocator
(:class:`BlockAllocator`) that keeps a pool's blocks, and the slot arithmetic of pooled
blocks. Scoring's prefix cache and generation's paged cache are both a pool and an
allocator, and one device's pool and allocators are a :class:`KVStore` that both may
share. Blocks are named by the chain hash of :mod:`moejax.prefix_hash`."""

from moejax.kv.blocks import BlockAllocator, OutOfBlocks, block_slots
from moejax.kv.pool import (SUM_BLOCK_COUNTS, WRITE_ROWS, KVPool, block_bytes, count_experts,
                            empty_pool, expert_count_bytes, sum_block_counts, write_rows)
from moejax.kv.store import KVStore

__all__ = ["BlockAllocator", "KVPool", "KVStore", "OutOfBlocks", "SUM_BLOCK_COUNTS", "WRITE_ROWS",
           "block_bytes", "block_slots", "count_experts", "empty_pool", "expert_count_bytes",
           "sum_block_counts", "write_rows"]
