"""What a :class:`serving.Generator` runs on, built from its options: one of four runtimes,
looked up by name in :data:`RUNTIMES` rather than branched over.

* ``continuous`` — a continuous-batching :class:`moejax.core.continuous.Scheduler` on a
  decode runner (resident, offload, prefetching offload, sync_ep; fused or layerwise
  steps) and a KV store of its own or shared with a Scorer (``share_with``);
* ``split`` — a :class:`moejax.core.decoders.DecoderPool`: the prefill→decode pipeline
  (``pipeline``, or ``decoders=K``): a prefill scheduler on its stage's backend and
  devices handing prompts to K decode schedulers, each on its own placement;
* ``static`` — the static batcher (:class:`moejax.static.decode.DecodeEngine`), the
  baseline;
* ``mu_queue`` — AsyncMoE's μ-queue runtime (:mod:`moejax.asyncmoe.runtime`).

The first two run through the engine core (``moejax.core.engine_core``) and serve
``Generator.start_loop``; the last two take whole calls.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from moejax.backends.base import BackendError, require_devices
from moejax.config import ModelConfig
from moejax.core.continuous import Scheduler, SchedulerOptions
from moejax.core.decoders import DecoderPool
from moejax.decode.factory import MESH_RUNNERS, make_runner
from moejax.decode.programs import StepOptions
from moejax.eldr import fitfile
from moejax.eldr.policies import DEFAULT_TAU, Policy, make_policy
from moejax.eldr.priors import cluster_priors_from_files
from moejax.param_layout import Params
from moejax.prefix_hash import BLOCK_SIZE
from moejax.static.decode import DecodeEngine
from serving.generation_options import DEFAULT_KV_CACHE_MIB, GeneratorOptions
from serving.pipeline_config import MU_QUEUE, DecoderStage, PipelineConfig, resolved_step
from serving.scorer_sharing import ScorerSharing


@dataclasses.dataclass(frozen=True)
class GenerationRuntime:
    """The built runtime: exactly one of ``engine`` (static), ``scheduler`` (continuous
    or split) and ``mu_queue`` is set; ``name`` says which runtime it is."""

    name: str
    engine: DecodeEngine | None = None
    scheduler: Scheduler | DecoderPool | None = None
    mu_queue: Any = None


def runtime_name(options: GeneratorOptions) -> str:
    """The runtime ``options`` select (module docstring)."""
    if options.runtime == "mu_queue":
        return "mu_queue"
    if options.batching == "static":
        return "static"
    return "split" if options.splits else "continuous"


@dataclasses.dataclass(frozen=True)
class RuntimeInputs:
    """What every runtime is built from: the model, its host params (placed by the
    runtime), the dtype, the Generator's options and what it shares with a Scorer."""

    config: ModelConfig
    params: Params
    dtype: Any
    options: GeneratorOptions
    sharing: ScorerSharing | None = None

    def runner(self, params: Params | None, **placement: Any) -> Any:
        """The decode runner of the options' backend, on the Scorer's placement where one
        is shared."""
        opts = self.options
        if self.sharing is not None and self.sharing.placement is not None:
            params, placement["placement"] = None, self.sharing.placement
        return self._make_runner(opts.backend, params, placement,
                                 {**dict(opts.backend_options or {}), **opts.prefetch_options()})

    def stage_runner(self, backend: str, devices: Sequence[Any], options: dict[str, Any],
                     placement: Any = None) -> Any:
        """The decode runner of one pipeline stage: ``backend`` on ``devices`` (one device,
        or a mesh group) with the stage's options, on ``placement`` when one is shared."""
        if placement is not None:
            return self._make_runner(backend, None, {"placement": placement}, options)
        where = ({"device_pool": tuple(devices), "devices": len(devices)}
                 if backend in MESH_RUNNERS else {"device": devices[0]})
        return self._make_runner(backend, self.params, where, options)

    def _make_runner(self, backend: str, params: Params | None, where: dict[str, Any],
                     options: dict[str, Any]) -> Any:
        """``make_runner`` with the Generator's step options (one place for both kinds of
        runner: the options' backend and a pipeline stage's)."""
        opts = self.options
        return make_runner(backend, self.config, params, dtype=self.dtype,
                           opts=StepOptions(expert_impl=opts.expert_impl,
                                            tile_rows=opts.tile_rows,
                                            router_inputs=opts.trace_router_inputs),
                           **where, **options)

    def scheduler_options(self, **changes: Any) -> SchedulerOptions:
        opts = self.options
        return dataclasses.replace(SchedulerOptions(
            max_batch_size=opts.max_batch_size, max_prefill_tokens=opts.max_prefill_tokens,
            prefill_row_tokens=opts.prefill_row_tokens, step=opts.resolved_step(),
            trace=opts.trace_experts, pipelined=opts.pipelined), **changes)

    def kv_cache_blocks(self, runner: Any) -> int:
        """The paged pool's blocks per rank of ``runner`` (:meth:`kv_cache_blocks_for` of
        its block bytes and ranks)."""
        return self.kv_cache_blocks_for(runner.block_bytes(), runner.num_ranks)

    def kv_cache_blocks_for(self, block: int, num_ranks: int = 1) -> int:
        """The paged pool's blocks per rank (:class:`GeneratorOptions`) for blocks of
        ``block`` bytes over ``num_ranks`` data-parallel ranks."""
        opts = self.options
        if opts.kv_cache_blocks is not None:
            return opts.kv_cache_blocks
        if opts.kv_cache_mib is not None:
            blocks = int(opts.kv_cache_mib * 2**20 // block)
            if blocks < 1:
                raise ValueError(f"kv_cache_mib={opts.kv_cache_mib} holds no KV block "
                                 f"({block} bytes each)")
            return blocks
        per_rank = -(-opts.max_batch_size // num_ranks)
        full = per_rank * -(-self.config.max_context // BLOCK_SIZE)
        return max(1, min(full, DEFAULT_KV_CACHE_MIB * 2**20 // block))

    def policy(self, count: int, pipeline: PipelineConfig) -> Policy:
        """The hand-off routing policy of ``pipeline`` over its ``count`` decoders."""
        routing = pipeline.routing
        if isinstance(routing, Policy):
            return routing
        fit = None
        if routing == "eldr":
            fit = fitfile.load(pipeline.eldr_fit)
            fit.check_model(self.config, fitfile.model_fingerprint(
                self.config, self.params["layers"]["router"]), count,
                where=f"eldr_fit {os.fspath(pipeline.eldr_fit)!r}")
        return make_policy(routing, count, fit=fit,
                           tau=DEFAULT_TAU if pipeline.eldr_tau is None else pipeline.eldr_tau,
                           seed=pipeline.routing_seed)


def build_continuous(inputs: RuntimeInputs) -> GenerationRuntime:
    runner = inputs.runner(inputs.params, devices=inputs.options.devices)
    store = None if inputs.sharing is None else inputs.sharing.kv_store
    blocks = inputs.kv_cache_blocks(runner) if store is None else store.num_blocks
    return GenerationRuntime("continuous", scheduler=Scheduler(
        runner, blocks, inputs.scheduler_options(), store=store))


def build_split(inputs: RuntimeInputs) -> GenerationRuntime:
    """The prefill→decode pipeline of the options (``GeneratorOptions.resolved_pipeline``:
    ``pipeline``, or ``decoders=K`` alike): the prefill stage's scheduler handing prompts
    to one scheduler per decoder, behind the routing policy."""
    opts = inputs.options
    pipeline = opts.resolved_pipeline()
    devices = jax.devices()
    count = pipeline.num_decoders
    if opts.pipeline is None and count > len(devices):
        hint = (" (on CPU, set XLA_FLAGS=--xla_force_host_platform_device_count=N before "
                "JAX starts)" if devices[0].platform == "cpu" else "")
        raise BackendError(f"decoders={count} needs one device per decoder, but only "
                           f"{len(devices)} {devices[0].platform} device(s) exist{hint}")
    prefill_at, decoders_at = pipeline.device_indices(len(devices))
    policy = inputs.policy(count, pipeline)
    stage = pipeline.prefill
    prefill_runner = inputs.stage_runner(stage.backend, [devices[i] for i in prefill_at],
                                         stage.runner_options())
    # The prefill stage holds prompts only, each until its decoder adopts it (when it runs
    # short, prefill waits for adoptions to free blocks): one decoder's pool size.
    prefill = Scheduler(prefill_runner, inputs.kv_cache_blocks(prefill_runner),
                        inputs.scheduler_options(
                            max_batch_size=count * opts.max_batch_size, handoff=True,
                            expert_counts=policy.reads_counts,
                            step=resolved_step(stage.backend, stage.step)))
    decoders: list[Any] = []
    eldr_priors: dict[str, np.ndarray] = {}    # [K, L, E] by the traces named
    for index, (decoder, at) in enumerate(zip(pipeline.decoder_list(), decoders_at)):
        if decoder.placement == MU_QUEUE:
            decoders.append(mu_queue_decoder(inputs, decoder, [devices[i] for i in at]))
            continue
        # A one-device decoder of the prefill stage's backend on its device runs on its
        # weights (one copy).
        shared = (getattr(prefill_runner, "placement", None)
                  if (decoder.placement, at) == (stage.backend, prefill_at)
                  and len(at) == 1 else None)
        options = decoder.runner_options()
        if decoder.eldr_prior:
            # The decoder's prefetch prior: the expert frequencies of the cluster ELDR
            # routes to it (the cross-technique signal of moejax.eldr.priors). Every
            # cluster's prior comes of one read of the fit and the traces, kept for the
            # other decoders naming the same traces. (The policy checked the fit's K.)
            traces = decoder.options["prefetch_prior_traces"]
            key = repr(traces)     # any value the option takes (the reader checks it)
            if key not in eldr_priors:
                eldr_priors[key] = cluster_priors_from_files(pipeline.eldr_fit, traces,
                                                             inputs.config)
            options["prefetch_prior"] = eldr_priors[key][index]
        runner = inputs.stage_runner(decoder.placement, [devices[i] for i in at], options,
                                     placement=shared)
        decoders.append(Scheduler(runner, inputs.kv_cache_blocks(runner),
                                  inputs.scheduler_options(
                                      record_steps=True,
                                      step=resolved_step(decoder.placement, decoder.step))))
    return GenerationRuntime("split", scheduler=DecoderPool(prefill, decoders, policy))


def mu_queue_decoder(inputs: RuntimeInputs, stage: DecoderStage, devices: Sequence[Any]
                     ) -> Any:
    """A pipeline's μ-queue decoder (``moejax.asyncmoe.decoder``) on ``devices``: the
    runtime with the stage's options, its pool per rank sized as a one-rank decoder's."""
    from moejax.asyncmoe.decoder import MuQueueDecoder   # imported when used: mesh code
    from moejax.asyncmoe.runtime import MuQueueRuntime
    from moejax.kv import block_bytes

    itemsize = jax.numpy.dtype(inputs.dtype).itemsize
    # One rank's share: the decoder admits only what fits on any one rank.
    blocks = inputs.kv_cache_blocks_for(block_bytes(inputs.config, itemsize), num_ranks=1)
    # The stage's options (PLACEMENT_OPTIONS["mu_queue"]) are the runtime's keywords by
    # name; what the stage leaves out takes the runtime's defaults.
    runtime = MuQueueRuntime(inputs.config, inputs.params, devices, dtype=inputs.dtype,
                             blocks_per_rank=blocks, **stage.options)
    return MuQueueDecoder(runtime, blocks, inputs.options.max_batch_size)


def build_static(inputs: RuntimeInputs) -> GenerationRuntime:
    opts = inputs.options
    return GenerationRuntime("static", engine=DecodeEngine(
        inputs.params, inputs.config, expert_impl=opts.expert_impl, tile_rows=opts.tile_rows,
        max_batch_size=opts.max_batch_size))


def build_mu_queue(inputs: RuntimeInputs) -> GenerationRuntime:
    from moejax.asyncmoe.runtime import MuQueueRuntime   # imported when used: mesh code

    opts = inputs.options
    return GenerationRuntime("mu_queue", mu_queue=MuQueueRuntime(
        inputs.config, inputs.params, require_devices("mu_queue", opts.devices),
        scheduler=opts.scheduler or "defrag", dtype=inputs.dtype,
        blocks_per_rank=opts.kv_cache_blocks))


RUNTIMES: dict[str, Callable[[RuntimeInputs], GenerationRuntime]] = {
    "continuous": build_continuous, "split": build_split, "static": build_static,
    "mu_queue": build_mu_queue}


def build_runtime(config: ModelConfig, params: Params, dtype: Any, options: GeneratorOptions,
                  sharing: ScorerSharing | None = None) -> GenerationRuntime:
    """The runtime ``options`` select, built (and precompiled when ``options.precompile``:
    the schedulers' step programs)."""
    runtime = RUNTIMES[runtime_name(options)](
        RuntimeInputs(config, params, dtype, options, sharing))
    if runtime.scheduler is not None and options.precompile:
        runtime.scheduler.precompile()
    return runtime
