"""Executes packed scoring batches on an execution backend.

The engine packs sequences into bucketed batches (``moejax.packing``), hands them
to its backend (``moejax.backends``) a step at a time, dispatches each step before
fetching the previous one's results (JAX dispatch is asynchronous, so the host
packs and unpacks while the devices compute), and logs every new program shape it
compiles so that an operator can see the bucket count stay bounded.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable, Hashable, Sequence

import jax
import numpy as np

from moejax import model as model_lib
from moejax.backends.base import Backend, padded_step, plan_steps
from moejax.config import ModelConfig
from moejax.packing import BucketPolicy, HostBatch, ScoringSequence, pack, unpack

log = logging.getLogger("moejax.engine")

SequenceOutput = tuple[list[np.ndarray], "np.ndarray | None"]


@dataclasses.dataclass
class EngineStats:
    """Counters of one engine (cumulative)."""

    batches: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0
    compiles: int = 0
    compile_seconds: float = 0.0
    run_seconds: float = 0.0
    shapes: set = dataclasses.field(default_factory=set)


class Engine:
    """Runs :class:`ScoringSequence` s through the model on one execution backend.

    The backend (``moejax.backends``: resident, offload, async_ep, hybrid, sync_ep, tp)
    owns the weights and their placement; the engine packs, groups batches of one shape
    into steps of the backend's data-parallel rank count (padding a short step with
    empty batches), dispatches each step before collecting the previous one, and
    unpacks the results.
    """

    def __init__(self, cfg: ModelConfig, backend: Backend, *,
                 policy: BucketPolicy | None = None, expert_impl: str = "auto",
                 tile_rows: int | None = None):
        self.cfg = cfg
        self.backend = backend
        self.dtype = backend.dtype
        self.policy = policy or BucketPolicy()
        self.options = model_lib.ForwardOptions(attn_block=self.policy.min_block,
                                                expert_impl=expert_impl, tile_rows=tile_rows)
        self.stats = EngineStats()

    @property
    def device(self) -> jax.Device:
        return self.backend.devices[0]

    def _dispatch(self, hosts: Sequence[HostBatch]):
        batches = padded_step([h.batch for h in hosts], self.backend.num_ranks)
        key = hosts[0].shape_key
        start = time.perf_counter()
        outs = self.backend.step(batches, hosts[0].options)
        if self.backend.serialize_steps:
            jax.block_until_ready(outs)
        if key not in self.stats.shapes:   # first use of this shape: it was compiled just now
            jax.block_until_ready(outs)
            elapsed = time.perf_counter() - start
            self.stats.shapes.add(key)
            self.stats.compiles += 1
            self.stats.compile_seconds += elapsed
            log.info("compiled forward #%d for T=%d block=%d positions=%d columns=%d "
                     "full_vocab=%s on %s (%.1fs, includes first run)", self.stats.compiles,
                     *key, self.backend.name, elapsed)
        return outs

    def run(self, sequences: Sequence[ScoringSequence],
            on_batch_done: Callable[[int], None] | None = None) -> dict[Hashable, SequenceOutput]:
        """Score every sequence; returns key -> (logits per score position, log-sum-exp or None).

        ``on_batch_done(n)`` is called with the number of sequences of each finished batch.
        """
        batches = pack(sequences, self.policy, self.options)
        results: dict[Hashable, SequenceOutput] = {}
        start = time.perf_counter()
        pending: tuple[list[HostBatch], Any] | None = None
        for step in plan_steps([h.shape_key for h in batches], self.backend.num_ranks):
            hosts = [batches[i] for i in step]
            outs = self._dispatch(hosts)
            if pending is not None:
                self._collect(*pending, results, on_batch_done)
            pending = (hosts, outs)
        if pending is not None:
            self._collect(*pending, results, on_batch_done)
        self.stats.run_seconds += time.perf_counter() - start
        return results

    def _collect(self, hosts: list[HostBatch], outs: Any, results: dict[Hashable, SequenceOutput],
                 on_batch_done: Callable[[int], None] | None) -> None:
        for host, (logits, lse) in zip(hosts, jax.device_get(outs[:len(hosts)])):
            for key, per_position, seq_lse in unpack(host, logits, lse):
                results[key] = (per_position, seq_lse)
            self.stats.batches += 1
            self.stats.real_tokens += host.real_tokens
            self.stats.padded_tokens += int(host.batch.tokens.shape[0]) - host.real_tokens
            if on_batch_done is not None:
                on_batch_done(len(host.sequences))
