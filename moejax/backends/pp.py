"""``pp``: pipeline parallelism over layers with micro-batches (the paper's PP+PP
baseline, MoE-Prefill Table 1).

G devices are G stages; stage s holds layers [a_s, a_{s+1}) whole (attention and
experts; the layers split as evenly as L allows, earlier stages taking the extra ones)
plus the embeddings, final norm and LM head it needs (the first stage embeds, the last
runs the last layer and the head). A step carries G packed batches of one shape, the
*micro-batches*: micro-batch m enters stage 0 while m-1 is in stage 1, and so on. The
host dispatches stage s of micro-batch m after stage s-1 of it and moves the hidden
states [T, d] to the next stage's device; JAX dispatch is asynchronous and each device
runs its own queue, so the stages of different micro-batches run at once (the pipeline
fills in G-1 stage times and drains in as many: the bubble).

No collective, no weight moves; per micro-batch and stage boundary the activations
[T, d] move once. Memory per device: its layers' weights, a 1/G share of the model's.
"""

from __future__ import annotations

import functools
from typing import Any, Sequence

import jax
import jax.numpy as jnp

from moejax import model, moe
from moejax.attention_kinds import PackedCausal
from moejax.backends.base import (BackendError, MemoryReport, MeshBackend, StepOutput,
                                  dense_bytes, expert_bytes_per_layer, require_devices,
                                  validated)
from moejax.config import ModelConfig
from moejax.dispatch import StackedExperts, local_dispatcher
from moejax.distributed import fetch_global
from moejax.model import ForwardOptions, PackedBatch
from moejax.param_layout import Params
from moejax.program_traffic import Traffic


def stage_bounds(num_layers: int, stages: int) -> list[tuple[int, int]]:
    """[a_s, a_{s+1}) per stage: L split as evenly as it goes, earlier stages one more."""
    if not 1 <= stages <= num_layers:
        raise BackendError(f"backend 'pp' splits {num_layers} layers over its devices: "
                           f"devices must be in [1, {num_layers}], got {stages}")
    base, extra = divmod(num_layers, stages)
    bounds, start = [], 0
    for s in range(stages):
        stop = start + base + (s < extra)
        bounds.append((start, stop))
        start = stop
    return bounds


def stage_program(params: Params, x: jax.Array | None, batch: PackedBatch, *,
                  cfg: ModelConfig, opts: ForwardOptions, start: int, stop: int,
                  last: bool) -> Any:
    """One stage on one micro-batch: (embed the tokens when ``x`` is None), layers
    [start, stop) of the stage's stack (which begins at layer ``start``), and on the last
    stage the last layer and the head -> x [T, d], or the readout."""
    module = model.decoder(cfg, params)
    dispatcher = local_dispatcher(StackedExperts(module.layers.experts(), first_layer=start),
                                  cfg.num_experts, opts.expert_impl, opts.tile_rows,
                                  activation=moe.expert_activation_of(cfg))
    if x is None:
        x = module.embed_tokens(batch.tokens)
    attn = PackedCausal.of(batch.positions, batch.segment_ids, opts.attn_block)
    through = stop - 1 if last else stop
    x, attn, carry, _ = module.run_layers(x, attn, dispatcher, start=start, stop=through,
                                          stack_offset=start)
    if not last:
        return x
    out = module.finish(batch, opts, x, attn, dispatcher, carry, stack_offset=start)
    return out.readout


class PPBackend(MeshBackend):
    """G pipeline stages over the layers; a step's G batches are its micro-batches."""

    name = "pp"
    no_prefix_pool_reason = ("each stage holds some layers' keys and values only, and its "
                             "stage programs have no pooled attention kind")

    def __init__(self, cfg: ModelConfig, params: Params, *, dtype: Any = jnp.float32,
                 devices: int = 1, device_pool: Sequence[jax.Device] | None = None):
        super().__init__(cfg, dtype=dtype)
        self._devices = require_devices(self.name, devices, device_pool)
        self.bounds = stage_bounds(cfg.num_layers, len(self._devices))
        host = validated(params, cfg, self.dtype)
        outer = {k: v for k, v in host.items() if k != "layers"}
        self.stage_params = [
            jax.device_put({**outer, "layers": {k: v[a:b] for k, v in host["layers"].items()}},
                           device)
            for (a, b), device in zip(self.bounds, self._devices)]
        per_layer_experts = expert_bytes_per_layer(host)
        layer_bytes = dense_bytes(host) - dense_bytes({**host, "layers": {}})
        widest = max(b - a for a, b in self.bounds)
        self._memory = MemoryReport(
            dense_weight_bytes=dense_bytes({**host, "layers": {}})
            + layer_bytes * widest // cfg.num_layers,
            expert_weight_bytes=per_layer_experts * widest,
            expert_bytes_all_layers=per_layer_experts * cfg.num_layers,
            detail={"stages": [list(b) for b in self.bounds]})
        self._programs: dict[Any, Any] = {}

    def _program(self, stage: int, opts: ForwardOptions, first: bool):
        key = (stage, opts, first)
        if key not in self._programs:
            start, stop = self.bounds[stage]
            body = functools.partial(stage_program, cfg=self.cfg, opts=opts, start=start,
                                     stop=stop, last=stage == len(self.bounds) - 1)
            if first:
                self._programs[key] = jax.jit(lambda params, batch: body(params, None, batch))
            else:
                self._programs[key] = jax.jit(body)
        return self._programs[key]

    def step(self, batches: Sequence[PackedBatch], opts: ForwardOptions) -> list[StepOutput]:
        self._check_step(batches)
        outputs = []
        for batch in batches:               # micro-batch m: stage s after stage s-1
            x = None
            for stage, device in enumerate(self._devices):
                on_stage = jax.device_put(batch, device)
                if x is None:
                    x = self._program(stage, opts, True)(self.stage_params[stage], on_stage)
                else:
                    x = self._program(stage, opts, False)(self.stage_params[stage],
                                                          jax.device_put(x, device), on_stage)
            outputs.append(x)
        return [jax.tree.map(fetch_global, readout) for readout in outputs]

    def lowered_steps(self, batches: Sequence[PackedBatch], opts: ForwardOptions) -> list[Any]:
        """Each stage's program, lowered for the first micro-batch."""
        batch = batches[0]
        lowered = [self._program(0, opts, True).lower(self.stage_params[0], batch)]
        x = jax.eval_shape(self._program(0, opts, True), self.stage_params[0], batch)
        for stage in range(1, len(self._devices)):
            lowered.append(self._program(stage, opts, False).lower(
                self.stage_params[stage], x, batch))
            x = jax.eval_shape(self._program(stage, opts, False), self.stage_params[stage], x,
                               batch)
        return lowered

    def step_traffic(self, batches: Sequence[PackedBatch], opts: ForwardOptions) -> Traffic:
        """Per micro-batch, each stage but the last hands its hidden states (its program's
        output, counted from the lowered program) to the next stage's device: critical
        (the next stage waits for them). Averaged over the G devices, for the step's G
        micro-batches. The programs themselves hold no collective."""
        lowered = self.lowered_steps(batches, opts)
        inside = sum((self.traffic_of(p) for p in lowered), Traffic())
        handed = sum(leaf.size * leaf.dtype.itemsize for p in lowered[:-1]
                     for leaf in jax.tree.leaves(p.out_info))
        per_micro_batch = inside + Traffic(critical=handed / len(self._devices))
        return per_micro_batch.times(len(batches))

    def memory_report(self) -> MemoryReport:
        return self._memory

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "stages": [list(b) for b in self.bounds]}


__all__ = ("PPBackend", "stage_bounds", "stage_program")
