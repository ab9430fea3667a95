"""Executes packed scoring batches on one device.

The engine owns the device copy of the params and one jitted forward. It packs
sequences into bucketed batches (``moejax.packing``), dispatches each batch
before fetching the previous one's results (JAX dispatch is asynchronous, so the
host packs and unpacks while the device computes), and logs every new program
shape it compiles so that an operator can see the bucket count stay bounded.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any, Callable, Hashable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from moejax import model as model_lib
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
    """Runs :class:`ScoringSequence` s through the model on one device."""

    def __init__(self, cfg: ModelConfig, params: model_lib.Params, *, dtype: Any = jnp.float32,
                 policy: BucketPolicy | None = None, expert_impl: str = "auto",
                 tile_rows: int | None = None, device: jax.Device | None = None):
        model_lib.check_params(params, cfg)
        self.cfg = cfg
        self.dtype = jnp.dtype(dtype)
        self.policy = policy or BucketPolicy()
        self.options = model_lib.ForwardOptions(attn_block=self.policy.min_block,
                                                expert_impl=expert_impl, tile_rows=tile_rows)
        self.device = device or jax.devices()[0]
        self.params = jax.device_put(
            jax.tree.map(lambda a: jnp.asarray(a, self.dtype), params), self.device)
        self.stats = EngineStats()
        self._forward = jax.jit(model_lib.forward, static_argnames=("cfg", "opts"))

    def _dispatch(self, host: HostBatch):
        batch = jax.device_put(host.batch, self.device)
        key = host.shape_key
        start = time.perf_counter()
        out = self._forward(self.params, batch, cfg=self.cfg, opts=host.options)
        if key not in self.stats.shapes:   # first use of this shape: it was compiled just now
            jax.block_until_ready(out)
            elapsed = time.perf_counter() - start
            self.stats.shapes.add(key)
            self.stats.compiles += 1
            self.stats.compile_seconds += elapsed
            log.info("compiled forward #%d for T=%d block=%d positions=%d columns=%d "
                     "full_vocab=%s (%.1fs, includes first run)", self.stats.compiles, *key, elapsed)
        return out

    def run(self, sequences: Sequence[ScoringSequence],
            on_batch_done: Callable[[int], None] | None = None) -> dict[Hashable, SequenceOutput]:
        """Score every sequence; returns key -> (logits per score position, log-sum-exp or None).

        ``on_batch_done(n)`` is called with the number of sequences of each finished batch.
        """
        batches = pack(sequences, self.policy, self.options)
        results: dict[Hashable, SequenceOutput] = {}
        start = time.perf_counter()
        pending: tuple[HostBatch, Any] | None = None
        for host in batches:
            out = self._dispatch(host)
            if pending is not None:
                self._collect(*pending, results, on_batch_done)
            pending = (host, out)
        if pending is not None:
            self._collect(*pending, results, on_batch_done)
        self.stats.run_seconds += time.perf_counter() - start
        return results

    def _collect(self, host: HostBatch, out: Any, results: dict[Hashable, SequenceOutput],
                 on_batch_done: Callable[[int], None] | None) -> None:
        logits, lse = jax.device_get(out)
        for key, per_position, seq_lse in unpack(host, logits, lse):
            results[key] = (per_position, seq_lse)
        self.stats.batches += 1
        self.stats.real_tokens += host.real_tokens
        self.stats.padded_tokens += int(host.batch.tokens.shape[0]) - host.real_tokens
        if on_batch_done is not None:
            on_batch_done(len(host.sequences))
