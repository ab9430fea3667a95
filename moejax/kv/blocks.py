"""The one block allocator of moejax's KV pools: free list, reference counts, and the
cache of full prompt blocks named by their chain hash (:mod:`moejax.prefix_hash`).

Scoring's prefix cache (an engine's pool of prompt blocks) and generation's paged pool
(the continuous scheduler's) keep their blocks with it. Every block is in exactly one
state:

* **free**: on the free list, holding nothing anyone may read;
* **in use**: referenced by a running plan or sequence (``refs > 0``); a named prompt
  block may be shared by every reader whose prompt starts the same way;
* **cached**: nobody holds it, but it keeps a full prompt block under its chain hash,
  so a later prompt with the same prefix reuses it. Cached blocks are evicted least
  recently released first when no block is free.

A block's chain hash names the whole prefix up to its end, so a hit on block i means
blocks 0..i hold exactly that prompt's tokens: reuse is always of a leading run.

Freed blocks are handed out again last-freed first (their pool rows are the likeliest to
be in a cache). With ``record_events``, the hashes named and evicted are recorded for
a router's view of the pool (:meth:`BlockAllocator.drain_events`).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import numpy as np

from moejax.prefix_hash import BLOCK_SIZE


class OutOfBlocks(RuntimeError):
    """The pool has fewer free (or evictable) blocks than asked for."""


def block_slots(blocks: Sequence[int], block_size: int = BLOCK_SIZE, count: int | None = None,
                pad_slot: int = 0) -> np.ndarray:
    """Pool token slots of ``blocks`` (``block * block_size + offset``, in order). With
    ``count``, padded with ``pad_slot`` to ``count`` blocks' worth (a bucketed shape)."""
    count = len(blocks) if count is None else count
    if count < len(blocks):
        raise ValueError(f"{len(blocks)} blocks do not fit a count of {count}")
    slots = np.full(count * block_size, pad_slot, np.int32)
    offsets = np.arange(block_size, dtype=np.int32)
    slots[:len(blocks) * block_size] = (np.asarray(blocks, np.int32)[:, None] * block_size
                                        + offsets).reshape(-1)
    return slots


class BlockAllocator:
    """The state of ``num_blocks`` KV blocks of ``block_size`` token slots (module
    docstring). Host-only; not thread-safe (its owner serialises access)."""

    def __init__(self, num_blocks: int, block_size: int = BLOCK_SIZE, *,
                 record_events: bool = False):
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"a KV pool needs at least one block, got {num_blocks!r}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.refs = [0] * num_blocks
        # Free blocks, handed out from the end: block 0 first, then the last freed.
        self._free = list(range(num_blocks - 1, -1, -1))
        self._cached: collections.OrderedDict[int, None] = collections.OrderedDict()
        self._block_of: dict[bytes, int] = {}
        self._hash_of: dict[int, bytes] = {}
        self.record_events = record_events
        self.stored: list[bytes] = []        # named since the last drain (record_events)
        self.evicted: list[bytes] = []       # evicted since the last drain (record_events)
        self.hits = self.lookups = self.evictions = 0

    # ----------------------------------------------------------------- queries
    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def num_available(self) -> int:
        """Blocks that :meth:`allocate` can hand out (free + evictable cached)."""
        return len(self._free) + len(self._cached)

    @property
    def num_in_use(self) -> int:
        """Blocks somebody holds."""
        return self.num_blocks - self.num_available

    @property
    def num_cached(self) -> int:
        """Blocks nobody holds that keep a reusable prompt block."""
        return len(self._cached)

    @property
    def num_named(self) -> int:
        """Blocks holding a named prompt block (in use or cached)."""
        return len(self._block_of)

    def slots(self, blocks: Sequence[int]) -> np.ndarray:
        """Pool token slots of ``blocks``, in order."""
        return block_slots(blocks, self.block_size)

    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """The blocks holding the longest leading run of ``hashes`` (a prompt's chain),
        neither pinned nor counted (:meth:`acquire` them to read them)."""
        found = []
        for digest in hashes:
            block = self._block_of.get(digest)
            if block is None:
                break
            found.append(block)
        return found

    # ----------------------------------------------------------------- changes
    def match(self, hashes: Sequence[bytes]) -> list[int]:
        """:meth:`lookup`, with the blocks found acquired for the caller (release them
        after use) and counted in ``hits`` / ``lookups``."""
        blocks = self.lookup(hashes)
        self.lookups += len(hashes)
        self.hits += len(blocks)
        self.acquire(blocks)
        return blocks

    def allocate(self, count: int) -> list[int]:
        """``count`` fresh blocks (free ones first, then the least recently released cached
        ones, whose hashes are forgotten), each with one reference. Raises
        :class:`OutOfBlocks`, taking nothing, when fewer are available."""
        if count > self.num_available:
            raise OutOfBlocks(f"asked for {count} KV blocks, {self.num_available} available")
        blocks = []
        for _ in range(count):
            if self._free:
                block = self._free.pop()
            else:
                block, _ = self._cached.popitem(last=False)
                digest = self._hash_of.pop(block)
                del self._block_of[digest]
                self.evictions += 1
                if self.record_events:
                    self.evicted.append(digest)
            self.refs[block] = 1
            blocks.append(block)
        if self.record_events:
            self._bound_events()
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
        they hold a named prompt block, most recently released last) or free."""
        for block in blocks:
            if self.refs[block] <= 0:
                raise ValueError(f"block {block} released more often than acquired")
            self.refs[block] -= 1
            if self.refs[block] == 0:
                if block in self._hash_of:
                    self._cached[block] = None
                else:
                    self._free.append(block)

    def name(self, block: int, digest: bytes) -> bool:
        """Record that ``block`` (in use, fully written) holds the prompt block ``digest``,
        so later lookups find it. False, and the block stays anonymous (freed on release),
        when another block already holds ``digest`` or this one has a name."""
        if self.refs[block] <= 0:
            raise ValueError(f"block {block} is not in use: only a written block is named")
        if digest in self._block_of or block in self._hash_of:
            return False
        self._block_of[digest] = block
        self._hash_of[block] = digest
        if self.record_events:
            self.stored.append(digest)
            self._bound_events()
        return True

    def forget_names(self) -> None:
        """Drop every name: cached blocks become free, blocks in use stay in use but
        anonymous (freed when released). What readers hold is untouched; nothing is found
        by a lookup any more. The names dropped are recorded as evicted."""
        if self.record_events:
            self.evicted.extend(self._block_of)
        self._free.extend(reversed(self._cached))
        self._cached.clear()
        self._block_of.clear()
        self._hash_of.clear()
        self._bound_events()

    def reset(self) -> None:
        """Forget every block: all free, nothing named (after the pool's contents were
        lost). The names dropped are recorded as evicted (``record_events``)."""
        self.forget_names()
        self.refs = [0] * self.num_blocks
        self._free = list(range(self.num_blocks - 1, -1, -1))

    def _bound_events(self) -> None:
        """Keep the recorded events to a few pool's worth between drains (a pool that
        names blocks for a long time without a reader): the net effect replaces them, and
        past that only the newest evictions are kept (an older one a reader misses only
        makes it believe a block is still here, which costs a lookup miss, not a wrong
        result)."""
        bound = 4 * self.num_blocks + 64
        if len(self.stored) + len(self.evicted) <= bound:
            return
        self.stored = [d for d in dict.fromkeys(self.stored) if d in self._block_of]
        evicted = [d for d in dict.fromkeys(self.evicted) if d not in self._block_of]
        self.evicted = evicted[-bound:]

    def drain_events(self) -> tuple[list[bytes], list[bytes]]:
        """(named, evicted) hashes since the last call (``record_events``)."""
        stored, evicted = self.stored, self.evicted
        self.stored, self.evicted = [], []
        return stored, evicted
