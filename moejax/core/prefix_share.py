"""Generation reads the prompt blocks that scoring cached: a system prompt scored once is
not prefilled again when a generation request starts with it.

A Scorer engine's prefix cache (:mod:`moejax.core.prefix_plan`) and the generation pool
(:mod:`moejax.decode.paged`) hold the same thing in the same layout: 16-token blocks named
by the same chain hash (:mod:`moejax.prefix_hash`), keys (after RoPE) and values per layer
in ``[L, S, n_kv, h]`` slots, ``block * 16 + offset``. :class:`ScorerPrefixSource` looks
a prompt's block hashes up in the Scorer's engines; the scheduler
(:class:`moejax.core.continuous.Scheduler`) then copies the hits into fresh blocks of its own
pool (:func:`moejax.kv.copy.copy_blocks`: a gather on the engine's device, one scatter into
the pool)
and names them, so from then on they are its own cached blocks.

Thread safety: an engine's cache and pool change during a scoring run (blocks are
evicted; the pool is donated to each step). The source takes the engine's
``prefix_lock`` *without waiting*: while an engine is scoring nothing is read from it (the
prompt is prefilled as usual), so generation never waits on scoring. The engine's blocks
are pinned only while the copy's gather runs, which finishes before the lock is released.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from moejax.kv import KVPool
from moejax.kv.copy import copy_blocks


def caching_engines(scorer: Any) -> list[Any]:
    """The engines of ``scorer`` that keep prompt blocks across calls (a prefix cache,
    not the KV-cache-free mode, which shares prompts within a call only)."""
    return [e for e in scorer.engines if e.prefix_cache is not None and not e.kv_cache_free]


class ScorerPrefixSource:
    """The prompt blocks a :class:`serving.Scorer`'s engines have cached, for a generation
    scheduler of the same model and dtype (module docstring)."""

    def __init__(self, scorer: Any, cfg: Any, dtype: Any):
        engines = caching_engines(scorer)
        if not engines:
            raise ValueError("the Scorer keeps no prefix cache across calls "
                             "(prefix_cache_blocks=0): there are no cached prompt blocks "
                             "to share")
        if scorer.config != cfg:
            raise ValueError("the Scorer serves another model configuration than the "
                             "Generator: their cached keys/values are not interchangeable")
        if np.dtype(engines[0].dtype) != np.dtype(dtype):
            raise ValueError(f"the Scorer computes in {np.dtype(engines[0].dtype).name} and "
                             f"the Generator in {np.dtype(dtype).name}: cached blocks are "
                             f"shared only between the same dtypes")
        self.engines = engines
        self.busy_skips = 0      # lookups skipped because an engine was scoring

    def copy_into(self, hashes: Sequence[bytes], kv: KVPool,
                  allocate: Callable[[int], list[int]], device: Any
                  ) -> tuple[KVPool, list[int]]:
        """Copy the longest leading run of ``hashes`` that an idle engine holds into
        blocks from ``allocate(n)`` (which may give fewer) -> (the pool, the blocks now
        holding hashes[0], hashes[1], ... in order; empty if none was found)."""
        for engine in self.engines:
            if not engine.prefix_lock.acquire(blocking=False):
                self.busy_skips += 1
                continue
            try:
                cache = engine.prefix_cache
                matched = cache.match(hashes)
                try:
                    dest = allocate(len(matched)) if matched else []
                    if dest:
                        kv = copy_blocks(engine.prefix_pool, matched[:len(dest)], kv, dest,
                                         device)
                        return kv, dest
                finally:
                    cache.release(matched)
            finally:
                engine.prefix_lock.release()
        return kv, []
