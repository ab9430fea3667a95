"""Scoring on the engine core (:mod:`moejax.core.engine_core`): the host-only schedule of
one run's packed batches, and the runner that executes them on a backend.

* :class:`ScoringSchedule` groups a run's packed batches (``moejax.packing``) into steps
  of the backend's data-parallel rank count, one shape per step, in first-seen order of
  the shapes; :meth:`~ScoringSchedule.update` unpacks a step's logits into
  ``(key, outcome)`` events and counts them in the engine's stats.
* :class:`ScoringRunner` owns the device side: the backend (its weight placement and
  programs) and the device's KV store (the prefix pool). It pads a short step with empty
  batches, runs a plain step or a step on the pool (which consumes the pool and puts the
  new one back in the store), and logs each new program shape it compiles.

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

from moejax.backends.base import Backend, padded_step, plan_steps
from moejax.config import ModelConfig
from moejax.kv import KVStore
from moejax.packing import HostBatch, unpack

log = logging.getLogger("moejax.engine")

# The fields of a batch's shape key (moejax.packing.HostBatch.shape_key), in order: a
# plain batch has the first five; a batch on the prefix pool adds the last two.
SHAPE_KEY_FIELDS = ("T", "block", "positions", "columns", "full_vocab",
                    "context_slots", "stored_rows")

# One scored sequence: its logits at each score position, and their log-sum-exp (None
# without full-vocabulary scoring); or the exception of the step that failed it.
SequenceLogits = tuple[list[np.ndarray], np.ndarray | None]
SequenceOutcome = SequenceLogits | Exception
ScoringEvent = tuple[Hashable, SequenceOutcome]


def describe_shape_key(key: Sequence[Any]) -> str:
    """``key`` as ``name=value`` pairs (``"T=64 block=16 ..."``), whatever its length: a
    field past the known names is shown by its position (``field8=...``)."""
    names = list(SHAPE_KEY_FIELDS) + [f"field{i + 1}" for i in range(len(SHAPE_KEY_FIELDS),
                                                                       len(key))]
    return " ".join(f"{name}={value}" for name, value in zip(names, key))


class ScoringSchedule:
    """The steps of one run over ``batches`` (module docstring). ``stats``: the engine's
    counters (:class:`moejax.core.scoring_engine.EngineStats`); ``on_batch_done(n)`` is
    called with the op count of each finished batch."""

    def __init__(self, batches: Sequence[HostBatch], num_ranks: int, cfg: ModelConfig,
                 stats: Any, on_batch_done: Callable[[int], None] | None = None,
                 backend_name: str = ""):
        self._steps = collections.deque(
            [batches[i] for i in step]
            for step in plan_steps([h.shape_key for h in batches], num_ranks))
        self.cfg = cfg
        self.stats = stats
        self.on_batch_done = on_batch_done
        self.backend_name = backend_name      # named in the log of a failed step

    def has_work(self) -> bool:
        return bool(self._steps)

    def schedule(self) -> list[HostBatch]:
        return self._steps.popleft()

    def update(self, hosts: list[HostBatch], outputs: Any) -> list[ScoringEvent]:
        """A step's outcomes by key. A failed plain step (its outputs are the exception,
        or reading them raises: an asynchronous failure) gives each of its sequences the
        exception; a failed step on the prefix pool raises it."""
        try:
            if isinstance(outputs, Exception):
                raise outputs
            fetched = jax.device_get(outputs[:len(hosts)])
        except Exception as error:   # noqa: BLE001
            if hosts[0].context is not None:
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
        for host, (logits, lse) in zip(hosts, fetched):
            events += [(key, (per_position, seq_lse))
                       for key, per_position, seq_lse in unpack(host, logits, lse)]
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

    def execute(self, hosts: Sequence[HostBatch]) -> Any:
        """Start one step -> its outputs, or the exception it raised (a plain step). A step
        on the prefix pool raises."""
        key = hosts[0].shape_key
        start = time.perf_counter()
        try:
            outs = self._run(hosts)
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
            if hosts[0].context is not None:
                raise
            return error
        return outs

    def _run(self, hosts: Sequence[HostBatch]) -> Any:
        if hosts[0].context is not None:        # continues or stores prefix KV: the pool
            host, store = hosts[0], self.store
            output, store.pool = self.backend.prefix_step(host.batch, host.context,
                                                          store.pool, host.options)
            return [output]
        batches = padded_step([h.batch for h in hosts], self.backend.num_ranks)
        return self.backend.step(batches, hosts[0].options)
