"""Executes packed scoring batches on an execution backend.

The engine packs sequences into bucketed batches (``moejax.packing``), hands them
to its backend (``moejax.backends``) a step at a time, dispatches each step before
fetching the previous one's results (JAX dispatch is asynchronous, so the host
packs and unpacks while the devices compute), and logs every new program shape it
compiles so that an operator can see the bucket count stay bounded.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import Any, Callable, Hashable, Sequence

import jax
import numpy as np

from moejax import model as model_lib
from moejax.backends.base import Backend, padded_step, plan_steps
from moejax.config import ModelConfig
from moejax.core.prefix_plan import plan_run
from moejax.kv import BlockAllocator, KVStore
from moejax.ops import PrefillOp
from moejax.packing import BucketPolicy, HostBatch, pack, unpack

log = logging.getLogger("moejax.engine")

# The fields of a batch's shape key (moejax.packing.HostBatch.shape_key), in order: a
# plain batch has the first five; a batch on the prefix pool adds the last two.
SHAPE_KEY_FIELDS = ("T", "block", "positions", "columns", "full_vocab",
                    "context_slots", "stored_rows")


def describe_shape_key(key: Sequence[Any]) -> str:
    """``key`` as ``name=value`` pairs (``"T=64 block=16 ..."``), whatever its length: a
    field past the known names is shown by its position (``field8=...``)."""
    names = list(SHAPE_KEY_FIELDS) + [f"field{i + 1}" for i in range(len(SHAPE_KEY_FIELDS),
                                                                       len(key))]
    return " ".join(f"{name}={value}" for name, value in zip(names, key))

# Per op: (logits per score position, log-sum-exp or None), or the exception of the step
# that failed it (the backend recovered; serving.results turns it into an error result).
# One scored sequence: its logits at each score position, and their log-sum-exp (None
# without full-vocabulary scoring); or the exception of the step that failed it.
SequenceLogits = tuple[list[np.ndarray], np.ndarray | None]
SequenceOutcome = SequenceLogits | Exception


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
    owns the weights and their placement; the engine packs, groups batches of one shape
    into steps of the backend's data-parallel rank count (padding a short step with
    empty batches), dispatches each step before collecting the previous one, and
    unpacks the results.
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

    @property
    def prefix_cache(self) -> BlockAllocator | None:
        """The block allocator of this engine's prefix cache (None without one)."""
        return None if self.kv_store is None else self.kv_store.allocators[0]

    @property
    def device(self) -> jax.Device:
        return self.backend.devices[0]

    def _step(self, hosts: Sequence[HostBatch]):
        if hosts[0].context is not None:        # continues or stores prefix KV: the pool path
            host, store = hosts[0], self.kv_store
            output, store.pool = self.backend.prefix_step(host.batch, host.context,
                                                          store.pool, host.options)
            return [output]
        batches = padded_step([h.batch for h in hosts], self.backend.num_ranks)
        return self.backend.step(batches, hosts[0].options)

    def _dispatch(self, hosts: Sequence[HostBatch]):
        """Start one step -> its outputs, or the exception it raised (a plain step's
        sequences then get it as their result, see :meth:`_collect`). A step on the prefix
        pool raises: the pool went into it (see :meth:`_run_batches`)."""
        key = hosts[0].shape_key
        start = time.perf_counter()
        try:
            outs = self._step(hosts)
            if self.backend.serialize_steps:
                jax.block_until_ready(outs)
            if key not in self.stats.shapes:   # first use of this shape: compiled just now
                jax.block_until_ready(outs)
                elapsed = time.perf_counter() - start
                self.stats.shapes.add(key)
                self.stats.compiles += 1
                self.stats.compile_seconds += elapsed
                log.info("compiled forward #%d for %s on %s (%.1fs, includes first run)",
                         self.stats.compiles, describe_shape_key(key), self.backend.name,
                         elapsed)
        except Exception as error:   # noqa: BLE001  (the backend recovered; see _collect)
            if hosts[0].context is not None:
                raise
            return error
        return outs

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
        """Run ``batches`` a step at a time -> outputs by key. The sequences of a step that
        raises get the exception as their value (the backend has recovered: the other
        steps run as usual). A step on the prefix pool fails the run instead: the pool went
        into it (donated), so its contents — what this run's later levels and the cache's
        blocks read — are lost; the engine starts from a fresh pool and an empty cache."""
        results: dict[Hashable, SequenceOutcome] = {}
        pending: tuple[list[HostBatch], Any] | None = None
        try:
            for step in plan_steps([h.shape_key for h in batches], self.backend.num_ranks):
                hosts = [batches[i] for i in step]
                outs = self._dispatch(hosts)
                if pending is not None:
                    self._collect(*pending, results, on_batch_done)
                pending = (hosts, outs)
            if pending is not None:
                self._collect(*pending, results, on_batch_done)
        except Exception:
            if self.kv_store is not None:
                log.error("a prefix-pool step failed on %s: the pool and the cached prefixes "
                          "are dropped", self.backend.name)
                self.kv_store.reset()
            raise
        return results

    def _collect(self, hosts: list[HostBatch], outs: Any, results: dict[Hashable, SequenceOutcome],
                 on_batch_done: Callable[[int], None] | None) -> None:
        """Fetch one step's outputs into ``results``. A failed plain step (its outputs are
        the exception, or fetching them raises: an asynchronous failure) gives each of its
        sequences the exception; a failed step on the prefix pool raises it."""
        try:
            if isinstance(outs, Exception):
                raise outs
            fetched = jax.device_get(outs[:len(hosts)])
        except Exception as error:   # noqa: BLE001
            if hosts[0].context is not None:
                raise
            log.error("a step of %d batch(es) failed on %s: %s: %s", len(hosts),
                      self.backend.name, type(error).__name__, error)
            for host in hosts:
                results.update({op.key: error for op in host.sequences})
                if on_batch_done is not None:
                    on_batch_done(len(host.sequences))
            return
        for host, (logits, lse) in zip(hosts, fetched):
            for key, per_position, seq_lse in unpack(host, logits, lse):
                results[key] = (per_position, seq_lse)
            self.stats.batches += 1
            self.stats.real_tokens += host.real_tokens
            # A continuation's cost counts only the tokens it runs (moejax.ops).
            self.stats.executed_flops += sum(op.flops(self.cfg) for op in host.sequences)
            self.stats.padded_tokens += int(host.batch.tokens.shape[0]) - host.real_tokens
            if on_batch_done is not None:
                on_batch_done(len(host.sequences))
