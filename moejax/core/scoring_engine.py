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
import math
import time
from typing import Callable, Hashable, Sequence

import jax
import numpy as np

from moejax import model as model_lib
from moejax.backends.base import Backend
from moejax.config import ModelConfig
from moejax.core.engine_core import EngineCore
from moejax.core.prefix_plan import plan_run
from moejax.core.router import Router, make_router, report_run
from moejax.core.scoring_steps import (ScoringRunner, ScoringSchedule, SequenceOutcome,
                                       plain_steps, ranked_steps)
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
    # Over the steps: the busiest rank's real tokens per step, summed, and every rank's,
    # summed (the straggler factor = ranks · busiest / all: 1 when balanced).
    rank_step_max_tokens: int = 0
    rank_step_tokens: int = 0
    rank_steps: int = 0
    shapes: set = dataclasses.field(default_factory=set)
    # The tokens each layer routed to each expert [L, E] (int64), over every step whose
    # backend counts them (None until one does): the prefill load EPLB balances.
    expert_tokens: np.ndarray | None = None


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
                 kv_cache_free: bool = False, rank_routing: str = "prefix",
                 rank_theta: float = math.inf):
        self.cfg = cfg
        self.backend = backend
        self.dtype = backend.dtype
        self.policy = policy or BucketPolicy()
        self.options = model_lib.ForwardOptions(attn_block=self.policy.min_block,
                                                expert_impl=expert_impl, tile_rows=tile_rows)
        self.stats = EngineStats()
        self.kv_cache_free = kv_cache_free
        self.last_cache_events: tuple[list[bytes], list[bytes]] = ([], [])
        self.last_rank_report = None      # the rank router's report of the last run
        # The device's KV memory (moejax.kv.store): its pool and block allocator, shared
        # with a generation scheduler on the same device when a server builds one there.
        self.kv_store: KVStore | None = None
        self.rank_router: Router | None = None
        if prefix_cache_blocks:
            # The backend places the pool (BackendError where it cannot hold one), with
            # prefix_cache_blocks blocks per data-parallel rank.
            self.kv_store = KVStore(
                functools.partial(backend.make_kv_pool, prefix_cache_blocks),
                [BlockAllocator(prefix_cache_blocks, record_events=True)
                 for _ in range(backend.num_ranks)])
            if backend.num_ranks > 1:
                self.route_ranks(rank_routing, rank_theta)
        self.runner = ScoringRunner(backend, self.kv_store, self.stats)

    @property
    def prefix_cache(self) -> BlockAllocator | None:
        """The block allocator of this engine's prefix cache (None without one; with
        several ranks rank 0's: ``kv_store.allocators`` holds one per rank)."""
        return None if self.kv_store is None else self.kv_store.allocators[0]

    def route_ranks(self, routing: str = "prefix", theta: float = math.inf,
                    seed: int = 0) -> None:
        """(Re)build the router that puts each op of a run on a data-parallel rank (a
        backend of several ranks holding a prefix pool): each rank is a routing target
        with its own blocks and its own Θ (``theta``, FLOPs per rank per round;
        ``moejax.core.router``), and learns afresh what the ranks hold."""
        if self.kv_store is None or self.backend.num_ranks == 1:
            raise ValueError("route_ranks: this engine has one rank or no prefix pool")
        self.rank_router = make_router(routing, self.cfg, self.backend.num_ranks,
                                       theta=theta, seed=seed)
        self._rank_routing = (routing, theta, seed)

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
                if self.rank_router is not None:
                    self.route_ranks(*self._rank_routing)

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
        the cached blocks and the shared tokens earlier levels stored. With several
        data-parallel ranks the rank router first puts each op on a rank, whose own
        blocks its plan reads and writes."""
        with self.kv_store.lock:
            return self._run_levels(ops, on_batch_done)

    def _run_levels(self, ops: Sequence[PrefillOp],
                    on_batch_done: Callable[[int], None] | None
                    ) -> dict[Hashable, SequenceOutcome]:
        store, epoch = self.kv_store, self.kv_store.epoch
        per_rank, costs = self._assign_ranks(ops)
        plans = [plan_run(rank_ops, allocator, self.kv_cache_free)
                 for rank_ops, allocator in zip(per_rank, store.allocators)]
        slots = store.allocators[0].num_slots      # a rank's own slots
        try:
            # Each rank's levels in order; a rank waits for its own earlier levels only
            # (it reads only what they stored), not for the other ranks'.
            levels = [[pack(level, self.policy, self.options, slots) for level in plan.levels]
                      for plan in plans]
            outputs = self._run_steps(ranked_steps(levels, slots), None)
            for plan, allocator in zip(plans, store.allocators):
                for block, digest in plan.to_commit:   # written: later runs may find them
                    allocator.name(block, digest)
        finally:
            if store.epoch == epoch:         # else a failed step reset every block
                for plan, allocator in zip(plans, store.allocators):
                    allocator.release(plan.pinned)
        # The caches' stored/evicted hashes of this run only (a router reads them; without
        # one they must not pile up over a long job).
        events = [allocator.drain_events() for allocator in store.allocators]
        self.last_cache_events = self._group_events(events)
        if self.rank_router is not None:
            for rank, (stored, evicted) in enumerate(events):
                report_run(self.rank_router, rank, per_rank[rank], costs[rank], stored,
                           evicted, kept=not self.kv_cache_free)
        self.stats.prefix_tokens_cached += sum(plan.cached_tokens for plan in plans)
        self.stats.prefix_tokens_shared += sum(plan.shared_tokens for plan in plans)
        if on_batch_done is not None:
            on_batch_done(len(ops))
        return outputs

    def _assign_ranks(self, ops: Sequence[PrefillOp]
                      ) -> tuple[list[list[PrefillOp]], list[list[int]]]:
        """Each op's rank (by the rank router: prefix affinity against that rank's own
        blocks, load in FLOPs, admission up to Θ) -> (ops per rank, their charged FLOPs).
        One rank: every op, uncharged."""
        if self.rank_router is None:
            return [list(ops)], [[]]
        report = self.rank_router.assign(ops)
        per_rank: list[list[PrefillOp]] = [[] for _ in self.kv_store.allocators]
        costs: list[list[int]] = [[] for _ in self.kv_store.allocators]
        for op, assignment in zip(ops, report.assignments):
            per_rank[assignment.engine].append(op)
            costs[assignment.engine].append(assignment.cost)
        self.last_rank_report = report
        return per_rank, costs

    def _group_events(self, events: list[tuple[list[bytes], list[bytes]]]
                      ) -> tuple[list[bytes], list[bytes]]:
        """The blocks the engine as a whole stored and evicted this run (what a router
        over several engines reads): any rank's stored ones, and evicted ones no rank
        still holds."""
        stored = [h for rank_stored, _ in events for h in rank_stored]
        evicted = [h for _, rank_evicted in events for h in rank_evicted
                   if not any(a.lookup([h]) for a in self.kv_store.allocators)]
        return stored, evicted

    def _run_batches(self, batches: Sequence[HostBatch],
                     on_batch_done: Callable[[int], None] | None
                     ) -> dict[Hashable, SequenceOutcome]:
        """Run ``batches`` (no prefix pool: any batch on any rank) on the engine core."""
        return self._run_steps(plain_steps(batches, self.backend.num_ranks), on_batch_done)

    def _run_steps(self, steps: Sequence[list[HostBatch | None]],
                   on_batch_done: Callable[[int], None] | None
                   ) -> dict[Hashable, SequenceOutcome]:
        """Run ``steps`` on the engine core, a step at a time with one step of lookahead
        (:mod:`moejax.core.scoring_steps`) -> outcomes by key. A step on the prefix pool
        that fails fails the run: the pool went into it (donated), so its contents — what
        this run's later levels and the cache's blocks read — are lost, and the store
        starts afresh (a generation scheduler sharing it recomputes what it held)."""
        schedule = ScoringSchedule(steps, self.cfg, self.stats, on_batch_done,
                                   backend_name=self.backend.name)
        try:
            return dict(EngineCore(schedule, self.runner).run())
        except Exception:
            if self.kv_store is not None:
                log.error("a prefix-pool step failed on %s: the pool and the cached prefixes "
                          "are dropped", self.backend.name)
                self.kv_store.reset()
            raise
