"""One device's KV memory: a :class:`~moejax.kv.KVPool` and the
:class:`~moejax.kv.BlockAllocator` (one per data-parallel rank) that keeps its blocks, for
every engine that computes on that device.

A server that scores and generates on one device holds one store: the scoring engine's
prefix cache and the continuous scheduler's paged cache are the same blocks of the same
pool. A prompt block either side writes and names is found by the other under the same
chain hash and read where it is, by the same block id (no copy).

The pool is a value that each step consumes (donated) and replaces, so whoever steps it
holds :attr:`KVStore.lock` from taking :attr:`KVStore.pool` to putting the new one back,
and while it plans with the allocators. A scoring run holds it for the whole run (its plan
pins blocks across levels); a generation scheduler for each step. When a step fails with
the pool donated, its contents are gone for everyone: :meth:`KVStore.reset` puts a fresh
pool in, forgets every block and bumps :attr:`KVStore.epoch`, and a sharer that sees
the epoch change recomputes what it held (:class:`moejax.core.continuous.Scheduler`
re-queues its sequences; a scoring run plans afresh each run).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from moejax.kv.blocks import BlockAllocator
from moejax.kv.pool import KVPool


class KVStore:
    """A pool and its allocators (module docstring). ``make_pool()`` builds a zeroed pool
    of the same size and placement (used by :meth:`reset`)."""

    def __init__(self, make_pool: Callable[[], KVPool], allocators: Sequence[BlockAllocator]):
        if not allocators:
            raise ValueError("a KV store needs at least one block allocator")
        self._make_pool = make_pool
        self.pool: KVPool = make_pool()
        self.allocators = list(allocators)
        self.lock = threading.RLock()
        self.epoch = 0
        slots = sum(a.num_slots for a in self.allocators)
        if slots != self.pool.num_slots:
            raise ValueError(f"the pool has {self.pool.num_slots} token slots but its "
                             f"allocators keep {slots}")

    @classmethod
    def single(cls, make_pool: Callable[[], KVPool], num_blocks: int, *,
               record_events: bool = False) -> "KVStore":
        """A one-rank store of ``num_blocks`` blocks."""
        return cls(make_pool, [BlockAllocator(num_blocks, record_events=record_events)])

    @property
    def num_blocks(self) -> int:
        """Blocks per rank."""
        return self.allocators[0].num_blocks

    def reset(self) -> None:
        """A fresh zeroed pool, every block forgotten (the old pool's contents were lost
        with a failed step); sharers see :attr:`epoch` change."""
        with self.lock:
            self.pool = self._make_pool()
            for allocator in self.allocators:
                allocator.reset()
            self.epoch += 1
