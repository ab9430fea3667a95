"""Decode runners over G data-parallel ranks of a 1-D mesh ``('dp',)``: what ``sync_ep``
(``moejax.decode.sync_ep``) and ``async_ep`` (``moejax.decode.async_ep``) decode share.

The scheduler puts each sequence on one rank; a step's
:class:`~moejax.decode.programs.PagedBatch` is rank-major (G ranks × B rows × C tokens,
flat), so its leading axis, sharded over the mesh, gives every device exactly its own
rows. Block tables and write slots are rank-local.

* **KV pool.** ``keys``/``values`` are [L, G·S, n_kv, h] (S = num_blocks · 16 slots per
  rank), sharded on the slot axis: device g holds rank g's pool [L, S, n_kv, h], and
  inside a ``shard_map`` it is an ordinary :class:`~moejax.kv.KVPool`. Rank g's block b
  is block ``g · num_blocks + b`` of the whole pool (``Scheduler.pool_blocks``): that is how
  a hand-off copies blocks between pools of any rank counts.
* **Signature cache.** With ``expert_counts`` the pool keeps ELDR's counts
  [G·num_blocks, L, E], sharded on the block axis, so each rank counts the experts of
  its own blocks in the program that writes them (:class:`RankWrite`), as a one-device
  pool does; a sequence's prompt counts are the sum over its global blocks.
* **A step.** A subclass's :meth:`RankMeshRunner.dispatch` runs one jitted ``shard_map``
  program whose per-rank body is :func:`moejax.decode.programs.paged_forward` with the
  subclass's MoE seam; then one more ``shard_map`` program (:class:`RankWrite`) writes
  each rank's new rows into its pool (donated). Results are rank-major: tokens [G·B], experts/weights/new keys
  [L, G·B·C, ...].
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from moejax import moe, sampling
from moejax.backends.base import RANK_AXIS, BackendError
from moejax.config import ModelConfig
from moejax.decode.programs import PagedBatch, StepOptions, StepResult
from moejax.decode.runners import DecodeRunner
from moejax.distributed import fetch_global
from moejax.kv import KVPool, write_rows

AXIS = RANK_AXIS


def result_specs(router_inputs: bool) -> StepResult:
    """Out specs of a step: rows concatenated rank-major (tokens on axis 0, the per-layer
    arrays [L, rows, ...] on axis 1)."""
    rows = P(None, AXIS)
    return StepResult(tokens=P(AXIS), new_keys=rows, new_values=rows, experts=rows,
                      weights=rows, router_inputs=rows if router_inputs else None)


def _write_flat(keys: jax.Array, values: jax.Array, counts: jax.Array | None,
                slots: jax.Array, new_keys: jax.Array, new_values: jax.Array,
                experts: jax.Array | None) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """:func:`moejax.kv.write_rows` on one rank's pool, given and returned as its arrays
    (shard_map's specs are per array)."""
    kv = write_rows(KVPool(keys=keys, values=values, expert_counts=counts), slots, new_keys,
                    new_values, experts)
    return kv.keys, kv.values, kv.expert_counts


class RankWrite:
    """The jitted write of every rank's new rows (and, with ``expert_counts``, their top-k
    ids into the rank's signature cache) into its own pool (the pool donated)."""

    def __init__(self, mesh: Mesh, expert_counts: bool):
        slots, rows = P(None, AXIS), P(None, AXIS)
        counts = P(AXIS) if expert_counts else None
        self._write = jax.jit(jax.shard_map(
            _write_flat, mesh=mesh,
            in_specs=(slots, slots, counts, P(AXIS), rows, rows,
                      rows if expert_counts else None),
            out_specs=(slots, slots, counts), check_vma=False), donate_argnums=(0, 1, 2))

    def __call__(self, kv: KVPool, slots: jax.Array, new_keys: jax.Array,
                 new_values: jax.Array, experts: jax.Array | None) -> KVPool:
        keys, values, counts = self._write(kv.keys, kv.values, kv.expert_counts, slots,
                                           new_keys, new_values, experts)
        return KVPool(keys=keys, values=values, expert_counts=counts)


def rank_rows(batch: PagedBatch) -> PagedBatch:
    """Inside a step's ``shard_map``: this rank's rows with ``last`` made rank-local (the
    scheduler numbers the rows' last tokens over the whole rank-major step)."""
    offset = jax.lax.axis_index(AXIS) * batch.tokens.shape[0]
    return dataclasses.replace(batch, last=batch.last - offset)


class RankMeshRunner(DecodeRunner, abc.ABC):
    """Fused paged steps over the ranks of ``mesh`` (module docstring); a subclass gives
    the step program (:meth:`dispatch`)."""

    steps = ("fused",)

    def __init__(self, cfg: ModelConfig, *, dtype: Any, opts: StepOptions, mesh: Mesh):
        super().__init__(cfg, dtype=dtype, opts=opts)
        self.mesh = mesh
        self._devices = tuple(mesh.devices.flat)
        self._ranks = NamedSharding(mesh, P(AXIS))
        self._pool = NamedSharding(mesh, P(None, AXIS))
        self._counts = NamedSharding(mesh, P(AXIS))
        self._writes = {counts: RankWrite(mesh, counts) for counts in (False, True)}

    @property
    def num_ranks(self) -> int:
        return len(self._devices)

    @property
    def device(self) -> Any:
        """The sharding of the pool: the slot axis split over the ranks."""
        return self._pool

    @property
    def devices(self) -> tuple[jax.Device, ...]:
        return self._devices

    @property
    def counts_device(self) -> Any:
        """The signature cache's sharding: its block axis split over the ranks (rank g's
        blocks on device g, beside its slots)."""
        return self._counts

    @abc.abstractmethod
    def dispatch(self, kv: KVPool, batch: PagedBatch, samp: sampling.SamplingParams
                 ) -> StepResult:
        """Dispatch one step program over every rank (batch and samp already placed on
        the ranks); returns its (rank-major) result without waiting for it."""

    def after_dispatch(self, batch: PagedBatch) -> None:
        """Called once a step and its write are dispatched (a subclass reads back what an
        earlier step left on the device here)."""

    def run(self, kv: KVPool, batch: PagedBatch, samp: sampling.SamplingParams, step: str
            ) -> tuple[KVPool, StepResult]:
        """One step over every rank, then the writes (``kv`` is consumed). Returns once
        both are dispatched."""
        self.check_step(step)
        batch, samp = jax.device_put((batch, samp), self._ranks)
        # The step reads keys and values only (the signature cache is the write's).
        result = self.dispatch(KVPool(keys=kv.keys, values=kv.values), batch, samp)
        counts = kv.expert_counts is not None
        kv = self._writes[counts](kv, batch.write_slots, result.new_keys, result.new_values,
                                  result.experts if counts else None)
        self.after_dispatch(batch)
        if not result.tokens.is_fully_addressable:
            # Over several processes: what the host reads back (the sampled tokens, the
            # routing for traces) is gathered to every process; the KV stays sharded.
            result = dataclasses.replace(result, tokens=fetch_global(result.tokens),
                                         experts=fetch_global(result.experts),
                                         weights=fetch_global(result.weights))
        return kv, result

    def layer_experts(self, layer: int, routing: moe.Routing, valid: jax.Array
                      ) -> tuple[dict[str, jax.Array], int, moe.Routing]:
        """Never called: the experts stay in the fused program (``steps``)."""
        raise BackendError(f"backend {self.name!r} runs fused decode steps only")
