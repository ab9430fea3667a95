"""The scoring engine: prefill-only work on the engine core.

An :class:`Engine` packs a run's sequences into bucketed batches (``moejax.packing``),
plans their reuse of the prefix pool in levels (``moejax.core.prefix_plan``), and runs
each level on the engine core (``moejax.core.engine_core``): a host-only schedule of
steps and a runner that owns the backend and the device's KV store
(``moejax.core.scoring_steps``). Each step is dispatched before the previous one's
results are fetched (JAX dispatch is asynchronous, so the host packs and unpacks while
the devices compute), and every new program shape is logged when it compiles so that an
operator can see the bucket count stay bounded.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import Callable, Hashable, Sequence

import jax

from moejax import model as model_lib
from moejax.backends.base import Backend
from moejax.config import ModelConfig
from moejax.core.engine_core import EngineCore
from moejax.core.prefix_plan import plan_run
from moejax.core.scoring_steps import ScoringRunner, ScoringSchedule, SequenceOutcome
from moejax.kv import BlockAllocator, KVStore
from moejax.ops import PrefillOp
from moejax.packing import BucketPolicy, HostBatch, pack

log = logging.getLogger("moejax.engine")


@dataclasses.dataclass
class EngineStats:
    """Counters of one engine (cumulative)."""

    batches: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0
    compiles: int = 0
    compile_seconds: float = 0.0
    run_seconds: float = 0.0
    prefix_tokens_cached: int = 0     # prompt tokens read from blocks of earlier runs
    prefix_tokens_shared: int = 0     # prompt tokens read from sequences of the same run
    executed_flops: int = 0      # model FLOPs of the real tokens run (DESIGN.md formulas)
    shapes: set = dataclasses.field(default_factory=set)


class Engine:
    """Runs prefill ops (:class:`moejax.ops.PrefillOp`) through the model on one execution backend.

    The backend (``moejax.backends``: resident, offload, async_ep, hybrid, sync_ep, tp)
    owns the weights and their placement; the engine packs and plans (host), and its
    :class:`~moejax.core.scoring_steps.ScoringRunner` executes on the backend and the
    device's KV store (``kv_store``; shared with a generation scheduler on the device,
    ``moejax.kv.store``).
    """

    def __init__(self, cfg: ModelConfig, backend: Backend, *,
                 policy: BucketPolicy | None = None, expert_impl: str = "auto",
                 tile_rows: int | None = None, prefix_cache_blocks: int = 0,
                 kv_cache_free: bool = False):
        self.cfg = cfg
        self.backend = backend
        self.dtype = backend.dtype
        self.policy = policy or BucketPolicy()
        self.options = model_lib.ForwardOptions(attn_block=self.policy.min_block,
                                                expert_impl=expert_impl, tile_rows=tile_rows)
        self.stats = EngineStats()
        self.kv_cache_free = kv_cache_free
        self.last_cache_events: tuple[list[bytes], list[bytes]] = ([], [])
        # The device's KV memory (moejax.kv.store): its pool and block allocator, shared
        # with a generation scheduler on the same device when a server builds one there.
        self.kv_store: KVStore | None = None
        if prefix_cache_blocks:
            # The backend places the pool (BackendError where it cannot hold one).
            self.kv_store = KVStore.single(
                functools.partial(backend.make_kv_pool, prefix_cache_blocks),
                prefix_cache_blocks, record_events=True)
        self.runner = ScoringRunner(backend, self.kv_store, self.stats)

    @property
    def prefix_cache(self) -> BlockAllocator | None:
        """The block allocator of this engine's prefix cache (None without one)."""
        return None if self.kv_store is None else self.kv_store.allocators[0]

    @property
    def device(self) -> jax.Device:
        return self.backend.devices[0]

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix: no block is found by its hash any more (blocks a
        generation on the same pool is reading stay its own until it releases them)."""
        if self.kv_store is not None:
            with self.kv_store.lock:
                for allocator in self.kv_store.allocators:
                    allocator.forget_names()

    def run(self, ops: Sequence[PrefillOp],
            on_batch_done: Callable[[int], None] | None = None) -> dict[Hashable, SequenceOutcome]:
        """Score every op; returns key -> (logits per score position, log-sum-exp or None),
        or the exception of the step that failed it.

        ``on_batch_done(n)`` is called with the number of ops of each finished batch. The
        prefix cache computes each op's shared prefix (``op.prefix_len``) once.
        """
        start = time.perf_counter()
        if self.kv_store is None:
            results = self._run_batches(pack(ops, self.policy, self.options), on_batch_done)
        else:
            results = self._run_with_prefix_cache(ops, on_batch_done)
        self.stats.run_seconds += time.perf_counter() - start
        return results

    def _run_with_prefix_cache(self, ops: Sequence[PrefillOp],
                               on_batch_done: Callable[[int], None] | None
                               ) -> dict[Hashable, SequenceOutcome]:
        """Run the levels of the prefix plan (moejax/core/prefix_plan.py): each op continues
        the cached blocks and the shared tokens earlier levels stored."""
        with self.kv_store.lock:
            return self._run_levels(ops, on_batch_done)

    def _run_levels(self, ops: Sequence[PrefillOp],
                    on_batch_done: Callable[[int], None] | None
                    ) -> dict[Hashable, SequenceOutcome]:
        cache, epoch = self.prefix_cache, self.kv_store.epoch
        plan = plan_run(ops, cache, self.kv_cache_free)
        slots = cache.num_slots
        try:
            outputs: dict[Hashable, SequenceOutcome] = {}
            for level in plan.levels:                # each reads what earlier ones stored
                outputs.update(self._run_batches(pack(level, self.policy, self.options, slots),
                                                 None))
            for block, digest in plan.to_commit:     # written: later runs may find them
                cache.name(block, digest)
        finally:
            if self.kv_store.epoch == epoch:         # else a failed step reset every block
                cache.release(plan.pinned)
        # The cache's stored/evicted hashes of this run only (a router reads them; without
        # one they must not pile up over a long job).
        self.last_cache_events = cache.drain_events()
        self.stats.prefix_tokens_cached += plan.cached_tokens
        self.stats.prefix_tokens_shared += plan.shared_tokens
        if on_batch_done is not None:
            on_batch_done(len(ops))
        return outputs

    def _run_batches(self, batches: Sequence[HostBatch],
                     on_batch_done: Callable[[int], None] | None
                     ) -> dict[Hashable, SequenceOutcome]:
        """Run ``batches`` on the engine core, a step at a time with one step of lookahead
        (:mod:`moejax.core.scoring_steps`) -> outcomes by key. A step on the prefix pool
        that fails fails the run: the pool went into it (donated), so its contents — what
        this run's later levels and the cache's blocks read — are lost, and the store
        starts afresh (a generation scheduler sharing it recomputes what it held)."""
        schedule = ScoringSchedule(batches, self.backend.num_ranks, self.cfg, self.stats,
                                   on_batch_done, backend_name=self.backend.name)
        try:
            return dict(EngineCore(schedule, self.runner).run())
        except Exception:
            if self.kv_store is not None:
                log.error("a prefix-pool step failed on %s: the pool and the cached prefixes "
                          "are dropped", self.backend.name)
                self.kv_store.reset()
            raise
