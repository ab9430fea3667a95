"""Decode runners: where the weights are, and how a paged step runs on them.

A runner owns the placed params and runs one :class:`~moejax.decode.programs.PagedBatch`
over the paged pool (:meth:`DecodeRunner.run`): the step, then the write of its new
keys/values into the pool (donated: in place). Runners by backend name:

* ``resident`` — every weight on one device; ``fused`` or ``layerwise`` steps.
* ``offload`` — experts in host memory (pinned where the platform has it), one buffer
  per (layer, expert): a layerwise step looks at each layer's routing and copies only
  the experts its rows chose into a device slot buffer (:class:`ExpertSlots`: an
  expert-id → slot map; two buffers alternate by layer parity, so the copy of layer
  l+1 may overlap layer l's compute), then runs the MoE on the slots with the routing
  renumbered. Only layerwise steps (a fused program cannot ask the host what to copy).
* ``sync_ep`` — ``moejax.decode.sync_ep`` (data-parallel attention, expert-parallel MoE).

:func:`moejax.decode.factory.make_runner` builds the runner of a backend name.

A layerwise step calls ``layer_hook(layer, routing)`` (when set) between a layer's
router and its experts: it may return a routing to use instead (a seam for research
code and tests; the prefetching runner overrides ``layerwise`` instead, and the μ-queue
runtime has its own loop). The traced routing is always the router's own.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from moejax import moe, sampling
from moejax.backends.base import BackendError, check_expert_bias, one_device, validated
from moejax.backends.resident import ResidentPlacement
from moejax.backends.streamed import host_memory_kind
from moejax.config import ModelConfig
from moejax.decode import programs
from moejax.kv import WRITE_ROWS, KVPool, block_bytes, empty_pool
from moejax.decode.programs import LayerwiseStep, PagedBatch, StepOptions, StepResult
from moejax.param_layout import Params, expert_names, split_experts

STEP_MODES = ("fused", "layerwise")
LayerHook = Callable[[int, moe.Routing], "moe.Routing | None"]


class DecodeRunner(abc.ABC):
    """Runs paged steps for one model on one placement (module docstring)."""

    name = ""
    steps: tuple[str, ...] = STEP_MODES   # step modes this runner can run

    serves_expert_bias = False            # see moejax.backends.base.check_expert_bias

    def __init__(self, cfg: ModelConfig, *, dtype: Any, opts: StepOptions):
        check_expert_bias(self.name, cfg, self.serves_expert_bias)
        self.cfg = cfg
        self.dtype = jnp.dtype(dtype)
        self.opts = opts
        self.layer_hook: LayerHook | None = None

    @property
    def num_ranks(self) -> int:
        """Data-parallel ranks, each with its own KV pool and rows."""
        return 1

    @property
    @abc.abstractmethod
    def device(self) -> Any:
        """Where the pool lives (a device or a sharding)."""

    def block_bytes(self) -> int:
        """Bytes of one KV block (all layers, keys and values) on one rank."""
        return block_bytes(self.cfg, self.dtype.itemsize)

    def make_kv(self, num_blocks: int, expert_counts: bool = False) -> KVPool:
        """A zeroed pool of ``num_blocks`` blocks per rank (with the ELDR signature cache
        when ``expert_counts``: one-rank runners only)."""
        if expert_counts and self.num_ranks != 1:
            raise BackendError(f"backend {self.name!r}: the signature cache (expert counts "
                               f"per KV block) needs a one-rank decode backend")
        return empty_pool(self.cfg, num_blocks, self.dtype, self.device, expert_counts)

    def precompile(self) -> None:
        """Compile what a step runs besides its programs (the scheduler's ``precompile``
        runs the programs themselves on padding rows)."""

    def check_step(self, step: str) -> None:
        if step not in self.steps:
            raise BackendError(f"backend {self.name!r} runs decode steps "
                               f"{' or '.join(map(repr, self.steps))}, not {step!r}")

    def run(self, kv: KVPool, batch: PagedBatch, samp: sampling.SamplingParams, step: str
            ) -> tuple[KVPool, StepResult]:
        """One step (``kv`` is consumed: use the returned pool)."""
        batch, samp = jax.device_put((batch, samp), self.device)
        if step == "fused":
            result = self.fused(kv, batch, samp)
        else:
            result = self.layerwise(kv, batch, samp)
        kv = WRITE_ROWS(kv, batch.write_slots, result.new_keys, result.new_values,
                        None if kv.expert_counts is None else result.experts)
        return kv, result

    def fused(self, kv: KVPool, batch: PagedBatch, samp: sampling.SamplingParams
              ) -> StepResult:
        raise BackendError(f"backend {self.name!r} has no fused decode step")

    @abc.abstractmethod
    def layer_experts(self, layer: int, routing: moe.Routing, valid: jax.Array
                      ) -> tuple[dict[str, jax.Array], int, moe.Routing]:
        """The experts layer ``layer`` runs with under ``routing``: (a stack [L', E', ...],
        the index into it, the routing renumbered for that stack)."""

    def attend(self, layer: int, state: LayerwiseStep, kv: KVPool
               ) -> tuple[jax.Array, jax.Array, moe.Routing]:
        """Layer ``layer``'s attention and router on a layerwise step: records the traced
        routing (and router inputs) in ``state``, applies the layer hook -> (the
        post-attention residual, the MoE input, the routing the experts run with)."""
        x, carry, moe_in, routing = programs.ATTENTION(self.dense_params, np.int32(layer),
                                                       state.x, kv, state.attn, cfg=self.cfg)
        state.attn = state.attn.with_carry(carry)
        state.experts.append(routing.experts)
        state.weights.append(routing.weights)
        if self.opts.router_inputs:
            state.router_inputs.append(moe_in)
        if self.layer_hook is not None:
            routing = self.layer_hook(layer, routing) or routing
        return x, moe_in, routing

    def layerwise(self, kv: KVPool, batch: PagedBatch, samp: sampling.SamplingParams
                  ) -> StepResult:
        """The host drives the layers: attention + router, (hook), experts, per layer."""
        dense, cfg, opts = self.dense_params, self.cfg, self.opts
        state = LayerwiseStep(*programs.BEGIN(dense, kv, batch, cfg=cfg, opts=opts))
        for layer in range(cfg.num_layers):
            x, moe_in, routing = self.attend(layer, state, kv)
            stack, at, routing = self.layer_experts(layer, routing, batch.valid)
            state.x = programs.MOE(stack, np.int32(at), x, moe_in, routing, batch.valid,
                                   opts=opts, activation=moe.expert_activation_of(cfg))
        tokens = programs.HEAD(dense, state.x, batch, samp, cfg=cfg)
        return state.result(tokens, opts.router_inputs)

    dense_params: Params


class ResidentRunner(DecodeRunner):
    """Every weight on one device: a :class:`~moejax.backends.resident.ResidentPlacement`,
    built here from ``params`` or handed in (``placement``: the one a resident scoring
    backend on the device runs on, so that the two hold one copy)."""

    name = "resident"
    serves_expert_bias = True

    def __init__(self, cfg: ModelConfig, params: Params | None = None, *, dtype: Any,
                 opts: StepOptions, devices: int = 1, device: Any = None,
                 placement: ResidentPlacement | None = None):
        if placement is not None:
            dtype = placement.dtype
        super().__init__(cfg, dtype=dtype, opts=opts)
        if devices != 1:
            raise BackendError(f"backend 'resident' decodes on one device, got "
                               f"devices={devices}; use sync_ep for several")
        placement = ResidentPlacement.resolve(self.name, cfg, params, self.dtype, device,
                                              placement)
        self.placement = placement
        self._device = placement.device
        self.params = placement.params
        self.dense_params = programs.dense_params(self.params)
        self.experts = {k: self.params["layers"][k]
                        for k in expert_names(self.params["layers"])}

    @property
    def device(self) -> Any:
        return self._device

    def fused(self, kv: KVPool, batch: PagedBatch, samp: sampling.SamplingParams
              ) -> StepResult:
        return programs.FUSED_STEP(self.params, kv, batch, samp, cfg=self.cfg, opts=self.opts)

    def layer_experts(self, layer: int, routing: moe.Routing, valid: jax.Array
                      ) -> tuple[dict[str, jax.Array], int, moe.Routing]:
        return self.experts, layer, routing


# ----------------------------------------------------------------------------- offload
def _set_slot(buffer: jax.Array, slot: jax.Array, weights: jax.Array) -> jax.Array:
    return buffer.at[0, slot].set(weights)


_SET_SLOT = jax.jit(_set_slot, donate_argnums=0)
# An expert-id -> slot map applied to a routing's expert ids (offload and prefetch runners).
RENUMBER_EXPERTS = jax.jit(lambda slot_of, experts: slot_of[experts])


@dataclasses.dataclass
class ExpertSlots:
    """A device buffer of ``num_slots`` expert slots ([1, S, ...] per weight name) and
    which (layer, expert) each slot holds."""

    buffers: dict[str, jax.Array]
    held: list[tuple[int, int] | None]

    @classmethod
    def empty(cls, shapes: dict[str, tuple[int, ...]], num_slots: int, dtype: Any,
              device: Any) -> "ExpertSlots":
        buffers = {k: jnp.zeros((1, num_slots, *shape), dtype, device=device)
                   for k, shape in shapes.items()}
        return cls(buffers=buffers, held=[None] * num_slots)

    def load(self, layer: int, wanted: np.ndarray, host: list[list[dict[str, Any]]],
             device: Any, num_experts: int) -> tuple[np.ndarray, int]:
        """Make every expert of ``wanted`` (layer ``layer``) resident -> (the slot of
        each expert id [E] (-1: absent), how many were copied)."""
        slot_of = np.full(num_experts, -1, np.int32)
        for slot, held in enumerate(self.held):
            if held is not None and held[0] == layer:
                slot_of[held[1]] = slot
        missing = [int(e) for e in wanted if slot_of[e] < 0]
        keep = {int(slot_of[e]) for e in wanted if slot_of[e] >= 0}
        spare = (s for s in range(len(self.held)) if s not in keep)
        for expert in missing:
            slot = next(spare)
            if self.held[slot] is not None and self.held[slot][0] == layer:
                slot_of[self.held[slot][1]] = -1
            for name, array in host[layer][expert].items():
                on_device = jax.device_put(array, device)
                self.buffers[name] = _SET_SLOT(self.buffers[name], np.int32(slot), on_device)
            self.held[slot] = (layer, expert)
            slot_of[expert] = slot
        return slot_of, len(missing)


class OffloadRunner(DecodeRunner):
    """Dense weights on the device; each (layer, expert) in host memory, copied on demand
    into alternating slot buffers (module docstring)."""

    name = "offload"
    steps = ("layerwise",)

    def __init__(self, cfg: ModelConfig, params: Params, *, dtype: Any, opts: StepOptions,
                 devices: int = 1, expert_slots: int | None = None, device: Any = None):
        super().__init__(cfg, dtype=dtype, opts=opts)
        if devices != 1:
            raise BackendError(f"backend 'offload' decodes on one device, got "
                               f"devices={devices}")
        self._device = one_device(self.name, device)
        self._on_device = jax.sharding.SingleDeviceSharding(self._device, memory_kind="device")
        host = validated(params, cfg, self.dtype)
        dense_layers, experts = split_experts(host["layers"])
        self.dense_params = jax.device_put({**host, "layers": dense_layers}, self._device)
        self.host_kind = host_memory_kind(self._device)
        place = (jax.sharding.SingleDeviceSharding(self._device, memory_kind=self.host_kind)
                 if self.host_kind else None)
        # One host buffer per (layer, expert): a step copies just the experts it needs.
        self.host_experts = [
            [{k: (jax.device_put(np.ascontiguousarray(v[layer, e]), place) if place
                  else np.ascontiguousarray(v[layer, e])) for k, v in experts.items()}
             for e in range(cfg.num_experts)]
            for layer in range(cfg.num_layers)]
        slots = cfg.num_experts if expert_slots is None else expert_slots
        if not isinstance(slots, int) or not 1 <= slots <= cfg.num_experts:
            raise BackendError(f"backend 'offload': expert_slots must be an integer in "
                               f"[1, {cfg.num_experts}], got {expert_slots!r}")
        shapes = {k: tuple(v.shape[2:]) for k, v in experts.items()}
        self.slot_buffers = [ExpertSlots.empty(shapes, slots, self.dtype, self._device)
                             for _ in range(2)]
        self.experts_copied = 0

    @property
    def device(self) -> Any:
        return self._device

    def precompile(self) -> None:
        """Compile the slot copy (padding rows copy no expert) by loading one expert into
        each buffer; the buffers then count as empty again."""
        for slots in self.slot_buffers:
            slots.load(0, np.zeros(1, np.int64), self.host_experts, self._on_device,
                       self.cfg.num_experts)
            slots.held = [None] * len(slots.held)

    def load_layer(self, layer: int, wanted: np.ndarray) -> tuple[np.ndarray, int]:
        """Make layer ``layer``'s experts ``wanted`` resident in its slot buffer -> (the
        slot of each expert id [E] (-1: absent), how many were copied)."""
        slots = self.slot_buffers[layer % 2]
        if len(wanted) > len(slots.held):
            raise BackendError(f"backend 'offload': layer {layer} needs {len(wanted)} experts "
                               f"at once, more than expert_slots={len(slots.held)}")
        slot_of, copied = slots.load(layer, wanted, self.host_experts, self._on_device,
                                     self.cfg.num_experts)
        self.experts_copied += copied
        return slot_of, copied

    def layer_experts(self, layer: int, routing: moe.Routing, valid: jax.Array
                      ) -> tuple[dict[str, jax.Array], int, moe.Routing]:
        ids = np.asarray(routing.experts)[np.asarray(valid)]
        slots = self.slot_buffers[layer % 2]
        slot_of, _ = self.load_layer(layer, np.unique(ids))
        # Experts no valid row chose map to slot 0: their rows are kept out of the MoE.
        renumbered = RENUMBER_EXPERTS(np.maximum(slot_of, 0), routing.experts)
        return slots.buffers, 0, dataclasses.replace(routing, experts=renumbered)
