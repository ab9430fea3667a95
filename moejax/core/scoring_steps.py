"""Scoring on the engine core (:mod:`moejax.core.engine_core`): the host-only schedule of
one run's packed batches, and the runner that executes them on a backend.

* :class:`ScoringSchedule` steps through a run's packed batches (``moejax.packing``)
  grouped into steps of the backend's data-parallel rank count, one shape per step:
  any batch on any rank (:func:`plain_steps`), or, on the prefix pool, each batch on
  the rank whose blocks it reads and writes (:func:`ranked_steps`).
  :meth:`~ScoringSchedule.update` unpacks a step's logits into ``(key, outcome)``
  events and counts them in the engine's stats.
* :class:`ScoringRunner` owns the device side: the backend (its weight placement and
  programs) and the device's KV store (the prefix pool, one part per rank). It pads a
  short step with empty batches (and idle ranks of a step on the pool with contexts
  that read and store nothing), runs a plain step or a step on the pool (which consumes
  the pool and puts the new one back in the store), and logs each new program shape it
  compiles.

A plain step that raises gives each of its sequences the exception as its outcome (the
backend has recovered; the other steps run as usual). A step on the pool raises instead:
the pool went into it (donated), so the run fails and the engine resets the store.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import jax
import numpy as np

from moejax.backends.base import (Backend, empty_batch_like, empty_context_like, padded_step,
                                  plan_steps)
from moejax.config import ModelConfig
from moejax.kv import KVStore
from moejax.ops import OpOutput
from moejax.packing import HostBatch, pad_to_common_shape, unpack

log = logging.getLogger("moejax.engine")

# The fields of a batch's shape key (moejax.packing.HostBatch.shape_key), in order: a
# plain batch has the first six; a batch on the prefix pool adds the last two.
SHAPE_KEY_FIELDS = ("T", "block", "positions", "columns", "full_vocab", "top_k",
                    "context_slots", "stored_rows")

# One scored sequence: its output (logits at each score position, their log-sum-exp and
# top ids where asked), or the exception of the step that failed it.
SequenceOutcome = OpOutput | Exception
ScoringEvent = tuple[Hashable, SequenceOutcome]


def describe_shape_key(key: Sequence[Any]) -> str:
    """``key`` as ``name=value`` pairs (``"T=64 block=16 ..."``), whatever its length: a
    field past the known names is shown by its position (``field8=...``)."""
    names = list(SHAPE_KEY_FIELDS) + [f"field{i + 1}" for i in range(len(SHAPE_KEY_FIELDS),
                                                                       len(key))]
    return " ".join(f"{name}={value}" for name, value in zip(names, key))


def plain_steps(batches: Sequence[HostBatch], num_ranks: int) -> list[list[HostBatch]]:
    """A run's batches in steps of up to ``num_ranks`` batches of one shape, in first-seen
    order of the shapes (any batch on any rank: nothing is kept between steps)."""
    return [[batches[i] for i in step]
            for step in plan_steps([h.shape_key for h in batches], num_ranks)]


def ranked_steps(per_rank: Sequence[Sequence[Sequence[HostBatch]]], rank_slots: int
                 ) -> list[list[HostBatch | None]]:
    """Steps of batches that must run on their own rank (they read and write that rank's
    pool blocks). ``per_rank[r]``: rank r's levels in order, each a list of batches (a
    level reads what the rank's earlier levels stored; the batches of one level are
    independent).

    Each step runs one attention block: the next batch of that block from every rank whose
    current level has one, grown to one program shape (``packing.pad_to_common_shape``;
    a rank with none is idle: None). A rank moves on to its next level as soon as its own
    current level is done: it reads only its own blocks, so it waits for no other rank's
    level, and a rank with a long level does not leave the others idle. Each step takes
    the block the most ranks have ready (ties: the larger block). Batches that do not
    touch the pool go in plain steps, on any rank, by shape."""
    plain: dict[Any, list[HostBatch]] = {}
    pending: list[collections.deque[dict[int, collections.deque]]] = []
    for levels in per_rank:
        queue: collections.deque[dict[int, collections.deque]] = collections.deque()
        for level in levels:
            by_block: dict[int, collections.deque] = {}
            for host in level:
                if host.context is None:
                    plain.setdefault(host.shape_key, []).append(host)
                else:
                    by_block.setdefault(host.options.attn_block,
                                        collections.deque()).append(host)
            if by_block:
                queue.append(by_block)
        pending.append(queue)
    ranks = len(per_rank)
    steps: list[list[HostBatch | None]] = []
    for anywhere in plain.values():     # any rank may run them: no pool read or write
        steps += [anywhere[i:i + ranks] for i in range(0, len(anywhere), ranks)]
    while any(pending):
        ready = collections.Counter(block for queue in pending if queue for block in queue[0])
        block = max(ready, key=lambda b: (ready[b], b))
        step = [_next_of_block(queue, block) for queue in pending]
        padded = iter(pad_to_common_shape([h for h in step if h is not None], rank_slots))
        steps.append([None if h is None else next(padded) for h in step])
    return steps


def _next_of_block(queue: collections.deque, block: int) -> HostBatch | None:
    """The next batch of attention block ``block`` in a rank's current level (the level
    is dropped once empty, making the next one current), or None."""
    if not queue or block not in queue[0]:
        return None
    level = queue[0]
    host = level[block].popleft()
    if not level[block]:
        del level[block]
    if not level:
        queue.popleft()
    return host


class ScoringSchedule:
    """The steps of one run (module docstring): ``steps``, each a list of batches of one
    shape, one per rank (None: an idle rank, on the pool; a plain step is padded by the
    runner). ``stats``: the engine's counters
    (:class:`moejax.core.scoring_engine.EngineStats`); ``on_batch_done(n)`` is called with
    the op count of each finished batch."""

    def __init__(self, steps: Sequence[list[HostBatch | None]], cfg: ModelConfig,
                 stats: Any, on_batch_done: Callable[[int], None] | None = None,
                 backend_name: str = ""):
        self._steps = collections.deque(steps)
        self.cfg = cfg
        self.stats = stats
        self.on_batch_done = on_batch_done
        self.backend_name = backend_name      # named in the log of a failed step

    def has_work(self) -> bool:
        return bool(self._steps)

    def schedule(self) -> list[HostBatch]:
        return self._steps.popleft()

    def update(self, hosts: list[HostBatch | None], outputs: Any) -> list[ScoringEvent]:
        """A step's outcomes by key. A failed plain step (its outputs are the exception,
        or reading them raises: an asynchronous failure) gives each of its sequences the
        exception; a failed step on the prefix pool raises it."""
        try:
            if isinstance(outputs, Exception):
                raise outputs
            fetched = jax.device_get(outputs[:len(hosts)])
        except Exception as error:   # noqa: BLE001
            if on_pool(hosts):
                raise
            log.error("a step of %d batch(es) failed on %s: %s: %s", len(hosts),
                      self.backend_name, type(error).__name__, error)
            events: list[ScoringEvent] = []
            for host in hosts:
                events += [(op.key, error) for op in host.sequences]
                self._done(len(host.sequences))
            return events
        events = []
        stats = self.stats
        # The straggler count (EngineStats): a rank absent from a step ran no token.
        tokens = [0 if host is None else host.real_tokens for host in hosts]
        stats.rank_step_max_tokens += max(tokens)
        stats.rank_step_tokens += sum(tokens)
        stats.rank_steps += 1
        for host, readout in zip(hosts, fetched):
            if host is None:            # an idle rank of a step on the pool
                continue
            events += unpack(host, readout)
            if readout.expert_tokens is not None:
                counted = np.asarray(readout.expert_tokens, np.int64)
                stats.expert_tokens = (counted if stats.expert_tokens is None
                                       else stats.expert_tokens + counted)
            stats.batches += 1
            stats.real_tokens += host.real_tokens
            # A continuation's cost counts only the tokens it runs (moejax.ops).
            stats.executed_flops += sum(op.flops(self.cfg) for op in host.sequences)
            stats.padded_tokens += int(host.batch.tokens.shape[0]) - host.real_tokens
            self._done(len(host.sequences))
        return events

    def _done(self, count: int) -> None:
        if self.on_batch_done is not None:
            self.on_batch_done(count)


class ScoringRunner:
    """Executes scoring steps on ``backend`` and the device's KV ``store`` (module
    docstring); counts compiles in ``stats``."""

    def __init__(self, backend: Backend, store: KVStore | None, stats: Any):
        self.backend = backend
        self.store = store
        self.stats = stats

    def execute(self, hosts: Sequence[HostBatch | None]) -> Any:
        """Start one step -> its outputs, or the exception it raised (a plain step). A step
        on the prefix pool raises."""
        first = next(h for h in hosts if h is not None)
        key = first.shape_key
        start = time.perf_counter()
        try:
            outs = self._run(hosts, first)
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
        except Exception as error:   # noqa: BLE001  (the backend recovered; see update)
            if on_pool(hosts):
                raise
            return error
        return outs

    def _run(self, hosts: Sequence[HostBatch | None], first: HostBatch) -> Any:
        if first.context is not None:       # continues or stores prefix KV: the pool
            store = self.store
            rank_slots = store.allocators[0].num_slots
            batches = [empty_batch_like(first.batch) if h is None else h.batch for h in hosts]
            contexts = [empty_context_like(first.context, rank_slots) if h is None
                        else h.context for h in hosts]
            outputs, store.pool = self.backend.prefix_steps(batches, contexts, store.pool,
                                                            first.options)
            return outputs
        batches = padded_step([h.batch for h in hosts], self.backend.num_ranks)
        return self.backend.step(batches, first.options)


def on_pool(hosts: Sequence[HostBatch | None]) -> bool:
    """Whether a step runs on the prefix pool (its batches continue or store prefix KV)."""
    return next(h for h in hosts if h is not None).context is not None
