"""``offload`` and ``hybrid``: expert weights live in host memory and stream to the devices.

Both run on an :class:`~moejax.offload.OffloadPlacement` (the one the offload decode
runners run on too): the attention weights (and everything else that is not an expert)
on the device, every layer's experts in host memory once (the ``pinned_host`` memory
kind where the platform has it). A window of W layers of experts
(:class:`~moejax.offload.ExpertWindow`, scoring's policy over the expert slots) is on
the device at any time: the copy of layer l+W is issued as soon as layer l has finished, so it
runs while layers l+1 … l+W-1 compute (JAX dispatch is asynchronous; copies from
pinned host memory go over their own DMA engine on a GPU). The window is cyclic:
while a step computes its last layers, the first layers of the next step are
already coming in.

The host drives the layers one at a time: each is ``MoEDecoder.layer`` (the
single-layer entry of ``moejax.layers``) in a jitted program of its own (one compile
for all layers: the layer index is an argument), and the last layer and the LM head
are ``MoEDecoder.finish``, the end of ``MoEDecoder.score``. Only the expert source
differs from the fused forward:

* ``offload`` (one device): the window holds whole layers, handed to each layer's
  program as ``GivenExperts``.
* ``hybrid`` (G devices, data-parallel attention as in ``async_ep``): the window
  holds each device's E/G shard of a layer; the program of layer l gets layer l's
  experts (gathered by the program before it) and layer l+1's shards, whose
  all-gather it issues when it fetches layer l's experts (``GatheredAhead`` over the
  one layer the window hands in), so a device holds W shard-layers plus two
  gathered layers (one more per lagged layer, below).

Both run the prefix cache: the pool stays on the device(s) and is threaded (donated)
through the layer programs as the ``PrefixPooled`` attention kind; with several devices
its token slots are split over the ranks, each rank reading and writing its own blocks
(as ``async_ep``'s).

Synchronization (``sync_lag``, default :data:`DEFAULT_SYNC_LAG` = 1). The host must see
a layer finish before it frees that layer's experts and issues the next copy. Waiting
for layer l before dispatching layer l+1 (``sync_lag=0``) leaves the device idle while
the host notices, frees, issues the copy and dispatches the next program. With
``sync_lag=k`` the host dispatches layer l+k first and only then waits for layer l, so
the device always has a program queued. A copy is still issued when the layer W
before it has finished, so it has the same W-1 layers of compute to hide under; the
host waits for the last program of a step before it returns (a step leaves nothing
running but the window's copies). The lag is at most W-1 (the window must already
hold the experts of the layers dispatched ahead), and 0 where several CPU devices
run collectives (``serialize_steps``: two collective programs in flight can deadlock
XLA:CPU's rendezvous).

The device-resident expert bytes are bounded by the window, and measured from the
live arrays when ``track_memory=True`` (``peak_window_bytes``):

* ``offload``: W layers, whatever the lag (the layers the host has not yet seen
  finish are counted in the window: a copy is issued only after one is freed).
* ``hybrid``: W shard-layers plus 2 + k gathered layers (k = the lag): the layer a
  program runs, the layer it gathers, and the k layers of the programs the host has
  not yet seen finish. (A layer's shards are freed once the program that gathered
  them has finished.)

A step that raises (a copy, a program, anything in between) leaves the window out of
step with the layers; the backend then waits out what the step left running, frees
every expert array it held and restarts the window at layer 0, so the next step runs
as on a fresh backend.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from moejax import model as model_lib
from moejax import moe
from moejax.attention_kinds import PackedCausal, PrefixContext, PrefixPooled
from moejax.backends import xla_flags
from moejax.backends.async_ep import AXIS, local_rank
from moejax.backends.base import (BackendError, MemoryReport, MeshBackend,
                                  StepOutput, rank_axis, require_devices, stack_batches,
                                  unstack_outputs)
from moejax.config import ModelConfig
from moejax.program_traffic import Traffic
from moejax.kv import KVPool
from moejax.dispatch import (ExpertWeights, GatheredAhead, GivenExperts, gather_layer,
                             local_dispatcher)
from moejax.distributed import place_local_ranks
from moejax.model import ForwardOptions, PackedBatch
from moejax.offload.host import LayerArrays
from moejax.offload.placement import OffloadPlacement
from moejax.offload.slots import free
from moejax.offload.window import ExpertWindow
from moejax.param_layout import Params

DEFAULT_WINDOW = 2
# Layer programs the host dispatches ahead of the one it waits for (see the docstring).
DEFAULT_SYNC_LAG = 1


# ------------------------------------------------------------ per-layer programs
@dataclasses.dataclass(frozen=True)
class GatheredFromWindow(GatheredAhead):
    """hybrid's expert source: :class:`GatheredAhead` over the one layer of shards the
    window hands to layer l's program (``shards`` [1, E/G, ...]: layer l+1's), with
    ``first`` the experts of layer l (gathered by the program before). Fetching layer
    l's experts issues the all-gather of l+1, which the program returns in its carry."""

    def layer_experts(self, layer, carry: Any) -> tuple[ExpertWeights, Any]:
        return carry, gather_layer(self.shards, 0, self.axis, self.num_experts)


def _attention(batch: PackedBatch, opts: ForwardOptions, context: PrefixContext | None,
               pool: KVPool | None):
    """Packed causal attention, or the prefix pool's kind when a pool is given."""
    if pool is None:
        return PackedCausal.of(batch.positions, batch.segment_ids, opts.attn_block)
    return PrefixPooled.of(batch.positions, batch.segment_ids, opts.attn_block, context,
                           pool.keys, pool.values)


def _pool_after(attn: Any, pool: KVPool | None) -> KVPool | None:
    """The pool as the layer left it (None without one)."""
    return (None if pool is None
            else dataclasses.replace(pool, keys=attn.pool_k, values=attn.pool_v))


def _source(current: ExpertWeights, incoming: ExpertWeights | None, cfg: ModelConfig):
    """The expert source of one layer's program: the given experts (offload), or those
    plus the next layer's shards to gather (hybrid)."""
    if incoming is None:
        return GivenExperts(current)
    return GatheredFromWindow(shards={k: v[None] for k, v in incoming.items()}, first=current,
                              axis=AXIS, num_experts=cfg.num_experts, num_layers=cfg.num_layers)


def layer_program(params: Params, layer: jax.Array, current: ExpertWeights,
                  incoming: ExpertWeights | None, x: jax.Array, batch: PackedBatch,
                  context: PrefixContext | None, pool: KVPool | None, *, cfg: ModelConfig,
                  opts: ForwardOptions):
    """Per device (inside shard_map): layer ``layer`` on this rank's x [1, T, d] with the
    experts ``current`` [E, ...]. ``incoming`` (hybrid): the next layer's local shards,
    all-gathered here and returned as its experts; ``pool`` (offload's prefix cache):
    read and written, returned (``context``: this rank's [1, ...]; ``pool``: this rank's
    blocks). -> (x [1, T, d], next experts | None, pool | None)."""
    batch, context = local_rank(batch), local_rank(context)
    source = _source(current, incoming, cfg)
    dispatcher = local_dispatcher(source, cfg.num_experts, opts.expert_impl, opts.tile_rows,
                                  activation=moe.expert_activation_of(cfg))
    module = model_lib.decoder(cfg, params, with_experts=False)
    out = module.layer(layer, x[0], _attention(batch, opts, context, pool), dispatcher)
    gathered = None if incoming is None else out.moe_carry[0]
    return out.x[None], gathered, _pool_after(out.attn, pool)


def last_layer_program(params: Params, current: ExpertWeights, x: jax.Array,
                       batch: PackedBatch, context: PrefixContext | None,
                       pool: KVPool | None, *, cfg: ModelConfig, opts: ForwardOptions):
    """Per device: the last layer and the LM head (``MoEDecoder.finish``) -> (the readout
    with a leading axis of 1, pool | None)."""
    batch, context = local_rank(batch), local_rank(context)
    dispatcher = local_dispatcher(GivenExperts(current), cfg.num_experts, opts.expert_impl,
                                  opts.tile_rows, activation=moe.expert_activation_of(cfg))
    module = model_lib.decoder(cfg, params, with_experts=False)
    out = module.finish(batch, opts, x[0], _attention(batch, opts, context, pool), dispatcher)
    return rank_axis(out.readout), _pool_after(out.attn, pool)


def embed_program(params: Params, tokens: jax.Array, *, cfg: ModelConfig) -> jax.Array:
    """[G, T] tokens -> [G, T, d] embeddings."""
    return model_lib.decoder(cfg, params, with_experts=False).embed_tokens(tokens)


class StreamedBackend(MeshBackend):
    """Experts in host memory, a cyclic window of W layers on the device(s)."""

    name = "streamed"
    # The expert biases travel in each layer's expert dict (split_experts), and the
    # programs pass the family's activation: GPT-OSS streams like any family.
    serves_expert_bias = True
    # hybrid: layer l+1's shards are all-gathered under layer l's compute
    overlapped_collectives = ("all-gather",)
    # The prefix pool is threaded (donated) through the layer programs; with several
    # devices each rank holds its own blocks.
    holds_prefix_pool = True

    def __init__(self, cfg: ModelConfig, params: Params | None = None, *,
                 dtype: Any = jnp.float32, devices: int = 1, window: int = DEFAULT_WINDOW,
                 sync_lag: int = DEFAULT_SYNC_LAG, track_memory: bool = False,
                 placement: OffloadPlacement | None = None,
                 device_pool: Sequence[jax.Device] | None = None):
        if placement is not None:
            dtype = placement.dtype
            device_pool = placement.devices if device_pool is None else device_pool
        super().__init__(cfg, dtype=dtype)
        # The first ``devices`` of ``device_pool`` (default: of the platform's devices).
        self._devices = require_devices(self.name, devices, device_pool)
        # With several devices a layer's shards and the next layer's are held together.
        smallest = 2 if len(self._devices) > 1 else 1
        if not isinstance(window, int) or window < smallest:
            raise BackendError(f"backend {self.name!r}: window must be at least {smallest} "
                               f"layer(s) on {len(self._devices)} device(s), got {window!r}")
        self.window = min(window, cfg.num_layers)
        if isinstance(sync_lag, bool) or not isinstance(sync_lag, int) or sync_lag < 0:
            raise BackendError(f"backend {self.name!r}: sync_lag must be an integer >= 0, "
                               f"got {sync_lag!r}")
        self.requested_sync_lag = sync_lag
        self.sync_lag = self._usable_lag(sync_lag)
        if len(self._devices) > 1:
            xla_flags.warn_if_overlap_flags_missing(self.name)
        self.placement = OffloadPlacement.resolve(self.name, cfg, params, self.dtype,
                                                  self._devices, placement)
        self.mesh = self.placement.mesh
        self.gather = len(self._devices) > 1
        self.track_memory = track_memory
        self.peak_window_bytes = 0
        self._replicated = self.placement.replicated
        self.params = self.placement.params
        self.host_experts = self.placement.host
        self.host_kind = self.host_experts.memory_kind
        self._device_layer = self.host_experts.device_sharding
        self._batch_sharding = NamedSharding(self.mesh, P(AXIS))
        self._programs: dict[Any, Any] = {}
        # Placed once: an index made per layer would be a host->device copy per layer.
        self._layer_index = [jax.device_put(np.int32(layer), self._replicated)
                             for layer in range(cfg.num_layers)]

        self._memory = self._memory_report()
        stored = self.host_experts.expert_shapes
        self._expert_shapes = {(n, *shape) for shape in stored.values()
                               for n in (self.host_experts.num_experts, cfg.num_experts)}
        self._foreign = {id(a) for a in self._live_expert_arrays()}  # not ours: never counted
        self._window = ExpertWindow(self.host_experts, self.window)

    def _usable_lag(self, requested: int) -> int:
        """The lag the layer loop runs with: at most W-1 (the layers dispatched ahead
        must already be in the window), 0 where steps are serialized (CPU collectives)."""
        if self.serialize_steps:
            return 0
        return min(requested, self.window - 1)

    def _memory_report(self) -> MemoryReport:
        cfg, window, placement = self.cfg, self.window, self.placement
        per_layer = placement.expert_bytes_per_layer
        padded_layer = per_layer * placement.host.num_experts // cfg.num_experts
        window_layer = padded_layer // len(self._devices)
        # hybrid: the layer a program runs, the one it gathers, and one per lagged program.
        gathered = (2 + self.sync_lag) * per_layer if self.gather else 0
        return MemoryReport(
            dense_weight_bytes=placement.dense_weight_bytes,
            expert_weight_bytes=window * window_layer + gathered,
            expert_bytes_all_layers=per_layer * cfg.num_layers,
            host_weight_bytes=per_layer * cfg.num_layers,
            detail={"window": window * window_layer, "window_layers": window,
                    "gathered": gathered, "sync_lag": self.sync_lag})

    # ------------------------------------------------------------------ memory
    def _live_expert_arrays(self) -> list[jax.Array]:
        ours = set(self._devices)
        return [a for a in jax.live_arrays()
                if tuple(a.shape) in self._expert_shapes and not a.is_deleted()
                and a.sharding.memory_kind == "device" and set(a.sharding.device_set) <= ours]

    def live_window_bytes(self) -> int:
        """Expert bytes per device held now, measured from JAX's live arrays (window and
        gathered layers), not from this backend's bookkeeping."""
        total = 0
        for array in self._live_expert_arrays():
            if id(array) not in self._foreign:   # (reading shard data would create new arrays)
                shard_shape = array.sharding.shard_shape(array.shape)
                total += int(np.prod(shard_shape)) * array.dtype.itemsize
        return total

    def _measure(self) -> None:
        if self.track_memory:
            self.peak_window_bytes = max(self.peak_window_bytes, self.live_window_bytes())

    # ---------------------------------------------------------------- programs
    def _program(self, kind: str, opts: ForwardOptions):
        """The jitted program ``kind`` (embed | layer | last) for ``opts``, built once."""
        key = (kind, opts)
        if key not in self._programs:
            self._programs[key] = self._build(kind, opts)
        return self._programs[key]

    def _build(self, kind: str, opts: ForwardOptions):
        # The functions are named so that a profiler trace tells the programs apart
        # (jit_streamed_embed, jit_streamed_layer, jit_streamed_last, jit_streamed_gather):
        # benchmarks/backends.py reads the gaps between layers from them.
        cfg = self.cfg
        if kind == "embed":
            def streamed_embed(params, tokens):
                return embed_program(params, tokens, cfg=cfg)

            return jax.jit(streamed_embed, out_shardings=self._batch_sharding)
        # Arguments: params, (layer), experts, (next shards), x, batch, context, pool. The
        # pool is donated: each layer writes its slots in place.
        if kind == "layer":
            def streamed_layer(*args):
                return layer_program(*args, cfg=cfg, opts=opts)

            shards = P(AXIS) if self.gather else P()
            body = jax.shard_map(
                streamed_layer, mesh=self.mesh,
                in_specs=(P(), P(), P(), shards, P(AXIS), P(AXIS), P(AXIS), self._pool_spec),
                out_specs=(P(AXIS), P(), self._pool_spec), check_vma=False)
            return jax.jit(body, donate_argnums=(7,))

        def streamed_last(*args):
            return last_layer_program(*args, cfg=cfg, opts=opts)

        body = jax.shard_map(
            streamed_last, mesh=self.mesh,
            in_specs=(P(), P(), P(AXIS), P(AXIS), P(AXIS), self._pool_spec),
            out_specs=(P(AXIS), self._pool_spec),
            check_vma=False)
        return jax.jit(body, donate_argnums=(5,))

    @property
    def _pool_spec(self) -> P:
        """The prefix pool's split: its token slots over the ranks (each rank its own
        blocks); whole on one device."""
        return P(None, AXIS) if self.gather else P()

    @property
    def kv_placement(self) -> Any:
        return NamedSharding(self.mesh, self._pool_spec)

    def prefix_steps(self, batches: Sequence[PackedBatch], contexts: Sequence[PrefixContext],
                     pool: KVPool, opts: ForwardOptions) -> tuple[list[StepOutput], KVPool]:
        self._check_step(batches)
        batch = place_local_ranks(stack_batches(batches), self._batch_sharding)
        context = place_local_ranks(stack_batches(contexts), self._batch_sharding)
        readout, pool = self._recovering(self._forward, batch, opts, context, pool)
        return unstack_outputs(readout, self.num_ranks), pool

    def _gather_first(self, shards: LayerArrays) -> LayerArrays:
        """Layer 0's shards gathered by a program of their own (no compute to hide under)."""
        return self._gather_program()(shards)

    def _gather_program(self):
        key = ("gather", None)
        if key not in self._programs:
            num_experts = self.cfg.num_experts

            def streamed_gather(s):
                return gather_layer({k: v[None] for k, v in s.items()}, 0, AXIS, num_experts)

            self._programs[key] = jax.jit(jax.shard_map(
                streamed_gather, mesh=self.mesh, in_specs=(P(AXIS),), out_specs=P(),
                check_vma=False))
        return self._programs[key]

    def lowered_steps(self, batches: Sequence[PackedBatch], opts: ForwardOptions) -> list[Any]:
        """The layer program (one for every layer but the last) and the last layer's."""
        batch = place_local_ranks(stack_batches(batches), self._batch_sharding)
        host_layer = self.host_experts.layers[0]
        held = self._held_layer()
        whole = {k: jax.ShapeDtypeStruct((self.cfg.num_experts,) + tuple(np.shape(v)[1:]),
                                         v.dtype) for k, v in host_layer.items()}
        current = whole if self.gather else held
        x = jax.eval_shape(self._program("embed", opts), self.params, batch.tokens)
        x = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self._batch_sharding)
        incoming = held if self.gather else None
        return [self._program("layer", opts).lower(self.params, np.int32(0), current, incoming,
                                                   x, batch, None, None),
                self._program("last", opts).lower(self.params, current, x, batch, None, None)]

    def step_traffic(self, batches: Sequence[PackedBatch], opts: ForwardOptions) -> Traffic:
        """Counted from the programs as a step runs them: the layer program L-1 times,
        the last layer's once and (hybrid) layer 0's gather once; plus each layer's
        experts (this device's shard) copied in from host memory under the compute
        before it (background)."""
        layer, last = (self.traffic_of(p) for p in self.lowered_steps(batches, opts))
        traffic = layer.times(self.cfg.num_layers - 1) + last
        if self.gather:
            traffic = traffic + self.traffic_of(self._gather_program().lower(self._held_layer()))
        host = self.host_experts
        copied = host.expert_bytes * host.num_experts / len(self._devices)   # a layer's shard
        return traffic + Traffic(background=copied * self.cfg.num_layers)

    def _held_layer(self) -> dict[str, jax.ShapeDtypeStruct]:
        """One layer's experts as the window holds them on the device(s), abstract."""
        return {k: jax.ShapeDtypeStruct(np.shape(v), v.dtype, sharding=self._device_layer)
                for k, v in self.host_experts.layers[0].items()}

    # ------------------------------------------------------------------ steps
    def step(self, batches: Sequence[PackedBatch], opts: ForwardOptions) -> list[StepOutput]:
        self._check_step(batches)
        batch = place_local_ranks(stack_batches(batches), self._batch_sharding)
        readout, _ = self._recovering(self._forward, batch, opts)
        return unstack_outputs(readout, self.num_ranks)

    def _recovering(self, forward, *args: Any):
        """``forward(*args)``; if it raises, the window restarts at layer 0 first (a
        failure part-way leaves it holding the wrong layers)."""
        try:
            return forward(*args)
        except BaseException:
            self._window.reset()
            raise

    def _first_experts(self) -> LayerArrays:
        """Layer 0's experts as its program takes them (hybrid: gathered from the shards
        by a program of their own, which is their last reader)."""
        held = self._window.take(0)
        if not self.gather:
            return held
        current = self._window.adopt(self._gather_first(held))
        self._window.dispatched(next(iter(current.values())), release=[held])
        if self.serialize_steps:    # one collective program in flight at a time on CPU
            jax.block_until_ready(current)
        return current

    def _dispatched_layer(self, done: jax.Array, current: LayerArrays,
                          incoming: LayerArrays | None) -> None:
        """Note a layer program just dispatched with what it reads last: offload's layer
        (back to the window), or hybrid's gathered layer (dropped) and the next layer's
        shards, which it gathered (back to the window)."""
        if self.gather:        # (the last layer's program gathers nothing)
            shards = [] if incoming is None else [incoming]
            self._window.dispatched(done, release=shards, drop=[current])
        else:
            self._window.dispatched(done, release=[current])

    def _forward(self, batch: PackedBatch, opts: ForwardOptions,
                 context: PrefixContext | None = None, pool: KVPool | None = None):
        """Every layer of one step, each with its experts from the window -> (readout,
        pool). After dispatching a layer the host waits for the one ``sync_lag``
        layers back, frees its experts and issues the next copy."""
        window = self._window
        window.fill()                          # refills from layer 0 after a failed step
        x = self._program("embed", opts)(self.params, batch.tokens)
        layer_fn = self._program("layer", opts)
        current = self._first_experts()
        for layer in range(self.cfg.num_layers - 1):
            # hybrid: the next layer's shards are gathered inside this layer's program
            incoming = window.take(layer + 1) if self.gather else None
            x, gathered, pool = layer_fn(self.params, self._layer_index[layer], current,
                                         incoming, x, batch, context, pool)
            if self.gather:
                window.adopt(gathered)           # (freed by a reset from here on)
            self._measure()                      # (the peak: the new program's outputs are in)
            self._dispatched_layer(x, current, incoming)
            window.settle(self.sync_lag)
            current = gathered if self.gather else window.take(layer + 1)
        readout, pool = self._program("last", opts)(self.params, current, x, batch, context,
                                                    pool)
        self._measure()
        self._dispatched_layer(readout.logits, current, None)
        window.settle(0)                 # the step leaves no program of its own running
        return readout, pool

    def memory_report(self) -> MemoryReport:
        return self._memory

    def time_expert_transfer(self, repeats: int) -> tuple[str, float]:
        """Host-to-device copy of one layer's experts (its shards, with several devices),
        and with several devices also their all-gather: the slower of the two."""
        from moejax.calibrate import median_seconds

        layer = min(1, self.cfg.num_layers - 1)

        def copy_in():
            free(jax.block_until_ready(self.host_experts.layer_to_device(layer)))

        timings = {"host_to_device": median_seconds(copy_in, repeats)}
        if self.gather:
            shards = self.host_experts.layer_to_device(layer)
            timings["all_gather"] = median_seconds(
                lambda: free(jax.block_until_ready(self._gather_first(shards))), repeats)
            free(shards)
        channel = max(timings, key=timings.get)
        return channel, timings[channel]

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "window": self.window, "sync_lag": self.sync_lag,
                "host_memory": self.host_kind or "numpy"}


class OffloadBackend(StreamedBackend):
    """One device; all experts in host memory, a window of W layers on the device. Runs
    the prefix cache too (the pool on the device)."""

    name = "offload"

    def __init__(self, cfg: ModelConfig, params: Params | None = None, *, devices: int = 1,
                 **options: Any):
        if devices != 1:
            raise BackendError(f"backend 'offload' runs on one device, got devices={devices}; "
                               f"use 'hybrid' to stream expert shards to several")
        super().__init__(cfg, params, devices=1, **options)


class HybridBackend(StreamedBackend):
    """``async_ep`` whose expert shards come from host memory a window ahead."""

    name = "hybrid"
