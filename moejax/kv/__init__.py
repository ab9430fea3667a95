"""moejax's KV layer: the block allocator every KV pool keeps its blocks with (scoring's
prefix pool and generation's paged pool), and the slot arithmetic of pooled blocks.
Blocks are named by the chain hash of :mod:`moejax.prefix_hash`."""

from moejax.kv.blocks import BlockAllocator, OutOfBlocks, block_slots

__all__ = ["BlockAllocator", "OutOfBlocks", "block_slots"]
