"""Host-side bookkeeping of the paged KV pool: the free list, reference counts, and the
cache of full prompt blocks named by the prefix cache's hash chain.

Every block is in exactly one state:

* **free** — on the free list, holding nothing anyone may read;
* **in use** — referenced by one or more running sequences (``refs > 0``); a full
  prompt block may be shared by every sequence whose prompt starts the same way;
* **cached** — no sequence holds it, but it keeps a full prompt block's keys/values
  under its chain hash (``moejax.prefix_hash``), so a later prompt with the same prefix
  reuses it; cached blocks are evicted least recently released first when the free list
  is empty.

A block's chain hash names the whole prefix up to its end, so a hit on block i means
blocks 0..i hold exactly that prompt's tokens: reuse is always of a leading run.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence


class OutOfBlocks(RuntimeError):
    """The pool has fewer free (or evictable) blocks than asked for."""


class BlockManager:
    """The state of ``num_blocks`` KV blocks (module docstring)."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"a KV pool needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.refs = [0] * num_blocks
        self._free: collections.deque[int] = collections.deque(range(num_blocks))
        self._cached: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._block_of: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}

    # ----------------------------------------------------------------- queries
    @property
    def num_available(self) -> int:
        """Blocks that :meth:`allocate` can hand out (free + evictable cached)."""
        return len(self._free) + len(self._cached)

    @property
    def num_in_use(self) -> int:
        """Blocks some sequence holds."""
        return self.num_blocks - self.num_available

    @property
    def num_cached(self) -> int:
        """Blocks that nobody holds but that keep a reusable prompt block."""
        return len(self._cached)

    def cached_prefix(self, hashes: Sequence[bytes]) -> list[int]:
        """The blocks holding the longest leading run of ``hashes`` (a prompt's chain)."""
        found = []
        for digest in hashes:
            block = self._block_of.get(digest)
            if block is None:
                break
            found.append(block)
        return found

    # ----------------------------------------------------------------- changes
    def allocate(self, count: int) -> list[int]:
        """``count`` fresh blocks (free ones first, then the least recently released cached
        ones, whose hashes are forgotten), each with one reference."""
        if count > self.num_available:
            raise OutOfBlocks(f"asked for {count} KV blocks, {self.num_available} available")
        blocks = []
        for _ in range(count):
            if self._free:
                block = self._free.popleft()
            else:
                block, _ = self._cached.popitem(last=False)
                del self._block_of[self._hash_of.pop(block)]
            self.refs[block] = 1
            blocks.append(block)
        return blocks

    def acquire(self, blocks: Sequence[int]) -> None:
        """One more reference to each of ``blocks`` (cached ones come back into use)."""
        for block in blocks:
            if self.refs[block] == 0:
                if block not in self._cached:
                    raise ValueError(f"block {block} is free: nothing to share")
                del self._cached[block]
            self.refs[block] += 1

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each of ``blocks``; unreferenced ones become cached (if
        they hold a named prompt block) or free."""
        for block in blocks:
            if self.refs[block] <= 0:
                raise ValueError(f"block {block} released more often than acquired")
            self.refs[block] -= 1
            if self.refs[block] == 0:
                if block in self._hash_of:
                    self._cached[block] = None
                else:
                    self._free.append(block)

    def name(self, block: int, digest: bytes) -> None:
        """Record that ``block`` (in use, fully written) holds the prompt block ``digest``.
        A digest already held by another block keeps that one."""
        if digest in self._block_of or block in self._hash_of:
            return
        self._block_of[digest] = block
        self._hash_of[block] = digest
