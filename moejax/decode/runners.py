"""Decode runners: where the weights are, and how a paged step runs on them.

A runner owns the placed params and runs one :class:`~moejax.decode.programs.PagedBatch`
over the paged pool (:meth:`DecodeRunner.run`): the step, then the write of its new
keys/values into the pool (donated: in place). Runners by backend name:

* ``resident`` — every weight on one device; ``fused`` or ``layerwise`` steps.
* ``offload`` — the offload placement (``moejax.offload``: dense weights on the device,
  experts in host memory once, the same placement the ``offload`` scoring backend runs
  on): a layerwise step looks at each layer's routing and copies only the experts its
  rows chose into a device slot buffer (``moejax.offload.AlternatingSlots``: two
  buffers alternate by layer parity, so the copy of layer l+1 may overlap layer l's
  compute), then runs the MoE on the slots with the routing renumbered. Only layerwise
  steps (a fused program cannot ask the host what to copy).
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
from moejax.backends.base import (BackendError, check_expert_bias, check_fp8_experts,
                                  one_device)
from moejax.backends.resident import ResidentPlacement
from moejax.config import ModelConfig
from moejax.decode import programs
from moejax.kv import WRITE_ROWS, KVPool, block_bytes, empty_pool
from moejax.decode.programs import LayerwiseStep, PagedBatch, StepOptions, StepResult
from moejax.offload.alternating import AlternatingSlots
from moejax.offload.placement import OffloadPlacement
from moejax.offload.slots import RENUMBER_EXPERTS
from moejax.param_layout import Params, expert_names

STEP_MODES = ("fused", "layerwise")
LayerHook = Callable[[int, moe.Routing], "moe.Routing | None"]


class DecodeRunner(abc.ABC):
    """Runs paged steps for one model on one placement (module docstring)."""

    name = ""
    steps: tuple[str, ...] = STEP_MODES   # step modes this runner can run

    serves_expert_bias = False            # see moejax.backends.base.check_expert_bias
    serves_fp8_experts = False            # see moejax.backends.base.check_fp8_experts

    def __init__(self, cfg: ModelConfig, *, dtype: Any, opts: StepOptions):
        check_expert_bias(self.name, cfg, self.serves_expert_bias)
        check_fp8_experts(self.name, cfg, self.serves_fp8_experts)
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

    @property
    def counts_device(self) -> Any:
        """Where the pool's signature cache lives (default: where the pool does)."""
        return self.device

    def make_kv(self, num_blocks: int, expert_counts: bool = False) -> KVPool:
        """A zeroed pool of ``num_blocks`` blocks per rank (rank g's blocks and slots
        after rank g-1's), with the ELDR signature cache when ``expert_counts``."""
        return empty_pool(self.cfg, num_blocks * self.num_ranks, self.dtype, self.device,
                          expert_counts, self.counts_device)

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
                      ) -> tuple[dict[str, jax.Array], int | None, moe.Routing]:
        """The experts layer ``layer`` runs with under ``routing``: (a stack [L', E', ...]
        and the index into it, or one layer's experts [E', ...] and None; the routing
        renumbered for them)."""

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
            state.x = programs.MOE(stack, None if at is None else np.int32(at), x, moe_in,
                                   routing, batch.valid, opts=opts,
                                   activation=moe.expert_activation_of(cfg))
        tokens = programs.HEAD(dense, state.x, batch, samp, cfg=cfg)
        return state.result(tokens, opts.router_inputs)

    dense_params: Params


class ResidentRunner(DecodeRunner):
    """Every weight on one device: a :class:`~moejax.backends.resident.ResidentPlacement`,
    built here from ``params`` or handed in (``placement``: the one a resident scoring
    backend on the device runs on, so that the two hold one copy)."""

    name = "resident"
    serves_expert_bias = True
    serves_fp8_experts = True     # fused steps (the layerwise MOE program takes no block)

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
class OffloadRunner(DecodeRunner):
    """Dense weights on the device; the experts in host memory
    (:class:`~moejax.offload.OffloadPlacement`, built here from ``params`` or handed in:
    the one an offload scoring backend on the device runs on), copied on demand into
    alternating slot buffers (:class:`~moejax.offload.AlternatingSlots`; module
    docstring)."""

    name = "offload"
    steps = ("layerwise",)

    def __init__(self, cfg: ModelConfig, params: Params | None = None, *, dtype: Any,
                 opts: StepOptions, devices: int = 1, expert_slots: int | None = None,
                 device: Any = None, placement: OffloadPlacement | None = None):
        if placement is not None:
            dtype = placement.dtype
        super().__init__(cfg, dtype=dtype, opts=opts)
        if devices != 1:
            raise BackendError(f"backend 'offload' decodes on one device, got "
                               f"devices={devices}")
        if placement is not None and device is None:
            device = placement.devices[0]
        self._device = one_device(self.name, device)
        self.placement = OffloadPlacement.resolve(self.name, cfg, params, self.dtype,
                                                  (self._device,), placement)
        self.dense_params = self.placement.params
        self.slots = AlternatingSlots(self.placement.host, expert_slots)

    @property
    def device(self) -> Any:
        return self._device

    @property
    def experts_copied(self) -> int:
        """Experts copied host -> device so far, by every step."""
        return self.slots.experts_copied

    def precompile(self) -> None:
        self.slots.precompile()

    def layer_experts(self, layer: int, routing: moe.Routing, valid: jax.Array
                      ) -> tuple[dict[str, jax.Array], None, moe.Routing]:
        ids = np.asarray(routing.experts)[np.asarray(valid)]
        slot_of, _ = self.slots.load(layer, np.unique(ids))
        # Experts no valid row chose map to slot 0: their rows are kept out of the MoE.
        renumbered = RENUMBER_EXPERTS(np.maximum(slot_of, 0), routing.experts)
        return self.slots.buffers(layer), None, dataclasses.replace(routing, experts=renumbered)
