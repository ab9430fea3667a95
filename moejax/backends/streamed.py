"""``offload`` and ``hybrid``: expert weights live in host memory and stream to the devices.

Both keep the attention weights (and everything else that is not an expert) on the
device, and hold every layer's experts in host memory (the ``pinned_host`` memory
kind where the platform has it). A window of W layers of experts is on the device
at any time: the copy of layer l+W is issued as soon as layer l has finished, so it
runs while layers l+1 … l+W-1 compute (JAX dispatch is asynchronous; copies from
pinned host memory go over their own DMA engine on a GPU). The window is cyclic:
while a step computes its last layers, the first layers of the next step are
already coming in. Each layer is its own jitted program (one compile for all
layers: the layer index is an argument).

* ``offload`` (one device): the window holds whole layers.
* ``hybrid`` (G devices, data-parallel attention as in ``async_ep``): the window
  holds each device's E/G shard of a layer; the program of layer l also all-gathers
  the shards of layer l+1 (issued before its compute, as ``async_ep`` does), so a
  device holds W shard-layers plus two gathered layers.

The device-resident expert bytes are bounded by the window, and measured from the
live arrays when ``track_memory=True`` (``peak_window_bytes``).
"""

from __future__ import annotations

import collections
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from moejax import attention
from moejax import model as model_lib
from moejax.backends import xla_flags
from moejax.backends.async_ep import AXIS, gather_layer, pad_experts, with_experts
from moejax.backends.base import (BackendError, MemoryReport, MeshBackend, StepOutput, dense_bytes,
                                  expert_bytes_per_layer, require_devices, stack_batches,
                                  unstack_outputs, validated)
from moejax.config import ModelConfig
from moejax.model import ForwardOptions, PackedBatch
from moejax.param_layout import Params, split_experts

DEFAULT_WINDOW = 2
HOST_MEMORY_KINDS = ("pinned_host", "unpinned_host")


def host_memory_kind(device: jax.Device) -> str | None:
    """The best host memory kind ``device`` can address, or None (host NumPy then)."""
    kinds = {m.kind for m in device.addressable_memories()}
    return next((k for k in HOST_MEMORY_KINDS if k in kinds), None)


def free(arrays: dict[str, jax.Array]) -> None:
    """Delete device buffers now rather than when Python drops them."""
    for array in arrays.values():
        array.delete()


# ------------------------------------------------------------ per-layer programs
def embed_stacked(params: Params, batch: PackedBatch) -> jax.Array:
    """[G, T] tokens -> [G, T, d] embeddings."""
    return jax.vmap(model_lib.embed_tokens, in_axes=(None, 0))(params, batch)


def layer_program(dense_layers, layer, experts, next_shards, x, batch, *, cfg: ModelConfig,
                  opts: ForwardOptions, gather: bool):
    """Per device (inside shard_map): layer ``layer`` on x [1, T, d] with ``experts``
    [E, ...]; when ``gather``, also all-gather ``next_shards`` (issued first) and return
    them as the next layer's experts."""
    batch = jax.tree.map(lambda a: a[0], batch)
    next_experts = (gather_layer({k: v[None] for k, v in next_shards.items()}, 0,
                                 cfg.num_experts) if gather else None)
    bias = attention.attention_bias(batch.segment_ids, opts.attn_block)
    out = model_lib.decoder_layer(with_experts(dense_layers, layer, experts), x[0], batch, bias,
                                  cfg, opts)
    return out[None], next_experts


def last_layer_program(params, layer, experts, x, batch, *, cfg: ModelConfig,
                       opts: ForwardOptions):
    """Per device: the last layer and the LM head at the scoring rows."""
    batch = jax.tree.map(lambda a: a[0], batch)
    bias = attention.attention_bias(batch.segment_ids, opts.attn_block)
    last = with_experts(params["layers"], layer, experts)
    logits, lse = model_lib.finish_scoring(params, last, x[0], batch, bias, cfg, opts)
    return logits[None], None if lse is None else lse[None]


class StreamedBackend(MeshBackend):
    """Experts in host memory, a cyclic window of W layers on the device(s)."""

    name = "streamed"

    def __init__(self, cfg: ModelConfig, params: Params, *, dtype: Any = jnp.float32,
                 devices: int = 1, window: int = DEFAULT_WINDOW, track_memory: bool = False):
        super().__init__(cfg, dtype=dtype)
        self._devices = require_devices(self.name, devices)
        # With several devices a layer's shards and the next layer's are held together.
        smallest = 2 if len(self._devices) > 1 else 1
        if not isinstance(window, int) or window < smallest:
            raise BackendError(f"backend {self.name!r}: window must be at least {smallest} "
                               f"layer(s) on {len(self._devices)} device(s), got {window!r}")
        self.window = min(window, cfg.num_layers)
        if len(self._devices) > 1:
            xla_flags.warn_if_overlap_flags_missing(self.name)
        self.mesh = Mesh(np.array(self._devices), (AXIS,))
        self.gather = len(self._devices) > 1
        self.track_memory = track_memory
        self.peak_window_bytes = 0

        host = validated(params, cfg, self.dtype)
        dense_layers, experts = split_experts(host["layers"])
        if self.gather:
            experts = pad_experts(experts, len(self._devices))
        replicated = NamedSharding(self.mesh, P())
        self.params = jax.device_put({**{k: v for k, v in host.items() if k != "layers"},
                                      "layers": dense_layers}, replicated)
        layer_spec = P(AXIS) if self.gather else P()
        self.host_kind = host_memory_kind(self._devices[0])
        self._device_layer = NamedSharding(self.mesh, layer_spec, memory_kind="device")
        host_layer = (NamedSharding(self.mesh, layer_spec, memory_kind=self.host_kind)
                      if self.host_kind else None)
        # One host copy per layer (pinned where possible), copied in as a unit.
        self.host_experts = [
            {k: (jax.device_put(v[layer], host_layer) if host_layer
                 else np.ascontiguousarray(v[layer]))
             for k, v in experts.items()}
            for layer in range(cfg.num_layers)]
        self._window: collections.deque = collections.deque()
        self._batch_sharding = NamedSharding(self.mesh, P(AXIS))
        self._programs: dict[Any, Any] = {}

        per_layer = expert_bytes_per_layer(host)
        padded_layer = per_layer * experts["w_gate"].shape[1] // cfg.num_experts
        window_layer = padded_layer // len(self._devices)
        gathered = 2 * per_layer if self.gather else 0
        self._memory = MemoryReport(
            dense_weight_bytes=dense_bytes(host),
            expert_weight_bytes=self.window * window_layer + gathered,
            expert_bytes_all_layers=per_layer * cfg.num_layers,
            host_weight_bytes=per_layer * cfg.num_layers,
            detail={"window": self.window * window_layer, "window_layers": self.window,
                    "gathered": gathered})
        self._expert_shapes = {tuple(v.shape[1:]) for v in experts.values()} | {
            tuple(v.shape[1:]) for v in split_experts(host["layers"])[1].values()}
        self._foreign = {id(a) for a in self._live_expert_arrays()}  # not ours: never counted
        self._next_layer = 0
        self._prefill_window()

    # ------------------------------------------------------------------ window
    def _copy_in(self) -> None:
        """Start the copy of the next layer (cyclically) into the window."""
        layer = self._next_layer % self.cfg.num_layers
        self._next_layer += 1
        self._window.append((layer, jax.device_put(self.host_experts[layer], self._device_layer)))

    def _prefill_window(self) -> None:
        for _ in range(self.window):
            self._copy_in()

    def _take(self, layer: int) -> dict[str, jax.Array]:
        held, arrays = self._window.popleft()
        if held != layer:
            raise RuntimeError(f"expert window out of order: wanted layer {layer}, holds {held}")
        return arrays

    def _release(self, layer_experts: dict[str, jax.Array]) -> None:
        """Free a finished layer's experts now and copy in the next layer."""
        free(layer_experts)
        self._copy_in()

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

    # ---------------------------------------------------------------- programs
    def _program(self, kind: str, opts: ForwardOptions):
        key = (kind, opts)
        if key in self._programs:
            return self._programs[key]
        cfg = self.cfg
        if kind == "embed":
            fn = jax.jit(embed_stacked, out_shardings=self._batch_sharding)
        elif kind == "layer":
            shard_spec = P(AXIS) if self.gather else P()
            body = jax.shard_map(
                lambda d, l, e, n, x, b: layer_program(d, l, e, n, x, b, cfg=cfg, opts=opts,
                                                       gather=self.gather),
                mesh=self.mesh,
                in_specs=(P(), P(), P(), shard_spec, P(AXIS), P(AXIS)),
                out_specs=(P(AXIS), P() if self.gather else None), check_vma=False)
            fn = jax.jit(body)
        else:
            body = jax.shard_map(
                lambda p, l, e, x, b: last_layer_program(p, l, e, x, b, cfg=cfg, opts=opts),
                mesh=self.mesh, in_specs=(P(), P(), P(), P(AXIS), P(AXIS)),
                out_specs=(P(AXIS), P(AXIS) if opts.full_vocab else None), check_vma=False)
            fn = jax.jit(body)
        self._programs[key] = fn
        return fn

    def _gather_first(self, shards: dict[str, jax.Array]) -> dict[str, jax.Array]:
        """Layer 0's shards gathered by a program of their own (no compute to hide under)."""
        key = ("gather", None)
        if key not in self._programs:
            num_experts = self.cfg.num_experts
            self._programs[key] = jax.jit(jax.shard_map(
                lambda s: gather_layer({k: v[None] for k, v in s.items()}, 0, num_experts),
                mesh=self.mesh, in_specs=(P(AXIS),), out_specs=P(), check_vma=False))
        return self._programs[key](shards)

    def lowered_steps(self, batches: Sequence[PackedBatch], opts: ForwardOptions) -> list[Any]:
        """The layer program (one for every layer but the last) and the last layer's."""
        batch = jax.device_put(stack_batches(batches), self._batch_sharding)
        host_layer = self.host_experts[0]
        held = {k: jax.ShapeDtypeStruct(np.shape(v), v.dtype, sharding=self._device_layer)
                for k, v in host_layer.items()}
        whole = {k: jax.ShapeDtypeStruct((self.cfg.num_experts,) + tuple(np.shape(v)[1:]),
                                         v.dtype) for k, v in host_layer.items()}
        current = whole if self.gather else held
        x = jax.eval_shape(self._program("embed", opts), self.params, batch)
        x = jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=self._batch_sharding)
        layer = np.int32(0)
        return [self._program("layer", opts).lower(self.params["layers"], layer, current,
                                                   held if self.gather else {}, x, batch),
                self._program("last", opts).lower(self.params, layer, current, x, batch)]

    def _measure(self) -> None:
        if self.track_memory:
            self.peak_window_bytes = max(self.peak_window_bytes, self.live_window_bytes())

    def step(self, batches: Sequence[PackedBatch], opts: ForwardOptions) -> list[StepOutput]:
        self._check_step(batches)
        last = self.cfg.num_layers - 1
        batch = jax.device_put(stack_batches(batches), self._batch_sharding)
        x = self._program("embed", opts)(self.params, batch)
        layer_fn = self._program("layer", opts)
        held = self._take(0)                 # what the window gave for the current layer
        current = self._gather_first(held) if self.gather else held
        if self.serialize_steps:    # one collective program in flight at a time on CPU
            jax.block_until_ready(current)
        for layer in range(last):
            self._measure()
            # hybrid: the next layer's shards are gathered inside this layer's program
            incoming = self._take(layer + 1) if self.gather else {}
            x, gathered = layer_fn(self.params["layers"], jnp.int32(layer), current, incoming,
                                   x, batch)
            jax.block_until_ready(x)         # layer done: free its experts, start the next copy
            self._release(held)
            if self.gather:
                free(current)
                held, current = incoming, gathered
            else:
                held = current = self._take(layer + 1)
        self._measure()
        logits, lse = self._program("last", opts)(self.params, jnp.int32(last), current, x, batch)
        jax.block_until_ready(logits)
        self._release(held)
        if self.gather:
            free(current)
        return unstack_outputs(logits, lse, self.num_ranks)

    def memory_report(self) -> MemoryReport:
        return self._memory

    def time_expert_transfer(self, repeats: int) -> tuple[str, float]:
        """Host-to-device copy of one layer's experts (its shards, with several devices),
        and with several devices also their all-gather: the slower of the two."""
        from moejax.calibrate import median_seconds

        layer = self.host_experts[min(1, self.cfg.num_layers - 1)]

        def copy_in():
            free(jax.block_until_ready(jax.device_put(layer, self._device_layer)))

        timings = {"host_to_device": median_seconds(copy_in, repeats)}
        if self.gather:
            shards = jax.device_put(layer, self._device_layer)
            timings["all_gather"] = median_seconds(
                lambda: free(jax.block_until_ready(self._gather_first(shards))), repeats)
            free(shards)
        channel = max(timings, key=timings.get)
        return channel, timings[channel]

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "window": self.window,
                "host_memory": self.host_kind or "numpy"}


class OffloadBackend(StreamedBackend):
    """One device; all experts in host memory, a window of W layers on the device."""

    name = "offload"

    def __init__(self, cfg: ModelConfig, params: Params, *, devices: int = 1, **options: Any):
        if devices != 1:
            raise BackendError(f"backend 'offload' runs on one device, got devices={devices}; "
                               f"use 'hybrid' to stream expert shards to several")
        super().__init__(cfg, params, devices=1, **options)


class HybridBackend(StreamedBackend):
    """``async_ep`` whose expert shards come from host memory a window ahead."""

    name = "hybrid"
