"""How a :class:`serving.Generator` runs: :class:`GeneratorOptions` (validated on
construction), and the check that a configuration can decode over several processes."""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Mapping

import jax

from moejax.backends import check_multi_process
from moejax.backends.base import BackendError
from moejax.eldr.policies import POLICIES, Policy, check_tau
from serving.options import ScorerOptions
from serving.pipeline_config import (STEPS, DecoderStage, PipelineConfig, PrefillStage,
                                     as_config, check_positive_int, resolved_step,
                                     with_prefetch_defaults)


BATCHING = ("continuous", "static")
SPLIT_BACKENDS = ("resident", "offload")   # the backends a decoder of several may use
RUNTIMES = ("continuous", "mu_queue")
DEFAULT_KV_CACHE_MIB = 1024


@dataclasses.dataclass(frozen=True)
class GeneratorOptions:
    """How a :class:`Generator` runs.

    * ``dtype`` ("float32" | "bfloat16" | "auto": bfloat16 on GPU, float32 on CPU);
    * ``batching``: "continuous" (default: sequences join and leave the running batch at
      every step, ``moejax.core.continuous``) or "static" (the old baseline: batches of
      ``max_batch_size`` run to their longest sequence; resident, fused only);
    * ``step``: "fused" (every layer in one program), "layerwise" (the host drives each
      layer: it sees the routing between attention and experts) or "auto" (layerwise
      where the backend needs it, i.e. offload; fused otherwise);
    * ``backend`` ("resident" | "offload" | "sync_ep"), ``devices`` and
      ``backend_options`` (a dict of the backend's own options) as for the Scorer;
    * ``max_batch_size``: sequences decoded together; ``max_prefill_tokens``: prompt
      tokens prefilled per step (longer prompts take several steps), in rows of
      ``prefill_row_tokens`` (default 64) packed from several prompts;
    * ``precompile``: compile every step program when the Generator is built (a few
      seconds per program on CPU; no request then waits on a compile); continuous
      batching only;
    * ``pipelined`` (default True): continuous batching plans and dispatches each step
      before it reads the last one's tokens, which reach the next step on the device
      (``moejax.core.continuous``); False: plan, run, read, in turn (the same tokens);
    * ``kv_cache_blocks`` or ``kv_cache_mib`` (at most one): the paged KV pool's size
      in 16-token blocks or MiB per rank; default: enough for ``max_batch_size``
      sequences at the model's full context, capped at 1024 MiB;
    * ``trace_experts`` (every token's top-k ids and gate weights) and
      ``trace_router_inputs`` (also the router inputs; needs ``trace_experts``);
    * ``expert_impl`` and ``tile_rows`` (as for the Scorer), ``compilation_cache`` (as
      for the Scorer: default None leaves JAX's process-wide compilation cache alone);
    * ``decoders`` (default 1): with K >= 2, prefill runs on a prefill engine (device 0)
      and decode on K decoders, decoder i on device i (``moejax.core.decoders``); resident or
      offload backend on one device each. Each decoder runs up to ``max_batch_size``
      sequences and has its own pool (``kv_cache_*``: per decoder; the prefill engine's
      pool has the same size). ``routing`` picks each request's decoder at the
      hand-off: "jsq" (default), "round_robin", "p2c", "random", "domain" (the label
      oracle: the requests' ``domain`` field) or "eldr" (expert locality,
      ``moejax.eldr``: needs ``eldr_fit``, a fit file made by ``moejax eldr-fit`` for
      this model and K decoders, and takes ``eldr_tau`` in [0, 1], default 0.1);
      ``routing_seed`` seeds random and p2c; ``routing`` may also be a
      ``moejax.eldr.policies.Policy`` object over K decoders (custom routing). Tokens do
      not depend on the routing.
    * ``prefetch`` (offload backend, layerwise decode; ``moejax.prefetch``): "none"
      (default: each layer's experts are copied after it routes), "router", "quasi",
      "estimator", "hybrid" (predict layer l+1's experts from layer l and copy them while
      layer l computes), "oracle" (the true experts) or "layer" (every expert of the next
      layer); ``prefetch_mode`` "exact" (default: compute with the true experts, copy
      misses on demand: tokens equal resident decode) or "speculative" (compute layer
      l >= 1 with the predicted experts and gate weights, never copy a miss: tokens may
      change); ``prefetch_files``: the default-vector file (``moejax prefetch-calibrate``,
      for quasi/estimator/hybrid) and the estimator file (``python -m
      moejax.prefetch.train``, for estimator/hybrid), one path or a list.
    * ``runtime``: "continuous" (default: the paged decode runtime above) or "mu_queue"
      (AsyncMoE, ``moejax.asyncmoe``: every one of ``devices`` is an attention rank and
      hosts a contiguous share of the experts; tokens wait in per-(layer, expert) and
      per-layer queues, and ``scheduler`` — "defrag" (default), "most_tokens" or
      "first_layer" — picks what an idle device runs). It takes whole calls (no
      ``start_loop``), the resident backend's options only, and no expert traces.
    * ``pipeline``: a prefill→decode pipeline described once
      (:class:`serving.pipeline_config.PipelineConfig`, a dict of one, or a TOML/JSON file
      path): a prefill stage on any paged backend (``async_ep`` on a group, for one) and
      K decoders of any placement, each with its own options (an offload decoder's
      prefetch, a sync_ep decoder's replica router apart from prefill's), with the
      routing between them. It replaces ``decoders``/``routing``/``eldr_*`` and the
      top-level ``backend``/``devices``/``backend_options``/``prefetch*``/``step``
      (each stage has its own); ``decoders=K`` is the pipeline of K decoders alike.
    * ``weights_dtype``: "auto" (an FP8 checkpoint is dequantized on load) or "fp8" (its
      routed experts stay in FP8 with their block scales: backend resident, one decoder,
      continuous batching with fused steps, the continuous runtime).
    """

    dtype: str = "auto"
    trace_experts: bool = False
    trace_router_inputs: bool = False
    batching: str = "continuous"
    step: str = "auto"
    backend: str = "resident"
    devices: int = 1
    backend_options: Mapping[str, Any] | None = None
    max_batch_size: int = 8
    max_prefill_tokens: int = 512
    prefill_row_tokens: int = 64
    precompile: bool = False
    pipelined: bool = True
    kv_cache_blocks: int | None = None
    kv_cache_mib: float | None = None
    expert_impl: str = "auto"
    tile_rows: int | None = None
    compilation_cache: str | bool | None = None
    decoders: int = 1
    routing: "str | Policy | None" = None
    eldr_tau: float | None = None
    eldr_fit: str | os.PathLike | None = None
    routing_seed: int = 0
    prefetch: str | None = None
    prefetch_mode: str | None = None
    prefetch_files: Any = None
    runtime: str = "continuous"
    scheduler: str | None = None
    weights_dtype: str = "auto"
    pipeline: Any = None

    def __post_init__(self) -> None:
        for name in ("trace_experts", "trace_router_inputs", "precompile", "pipelined"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.trace_router_inputs and not self.trace_experts:
            raise ValueError("trace_router_inputs needs trace_experts=True")
        for name in ("max_batch_size", "max_prefill_tokens", "prefill_row_tokens", "devices"):
            check_positive_int(name, getattr(self, name), ValueError)
        if self.kv_cache_blocks is not None:
            check_positive_int("kv_cache_blocks", self.kv_cache_blocks, ValueError)
        if self.kv_cache_mib is not None and (
                isinstance(self.kv_cache_mib, bool)
                or not isinstance(self.kv_cache_mib, (int, float)) or not self.kv_cache_mib > 0):
            raise ValueError(f"kv_cache_mib must be a positive number, got {self.kv_cache_mib!r}")
        if self.kv_cache_blocks is not None and self.kv_cache_mib is not None:
            raise ValueError("give kv_cache_blocks or kv_cache_mib, not both")
        if self.batching not in BATCHING:
            raise ValueError(f"batching must be one of {BATCHING}, got {self.batching!r}")
        if self.step not in STEPS:
            raise ValueError(f"step must be one of {STEPS}, got {self.step!r}")
        if self.backend_options is not None and not isinstance(self.backend_options, Mapping):
            raise ValueError(f"backend_options must be a dict, got "
                             f"{type(self.backend_options).__name__}")
        if self.batching == "static" and (self.backend != "resident" or self.step == "layerwise"
                                          or self.trace_router_inputs):
            raise ValueError("batching='static' is the resident, fused baseline (no other "
                             "backend, no layerwise step, no router-input traces); use "
                             "batching='continuous'")
        if self.batching == "static" and self.precompile:
            raise ValueError("precompile applies to batching='continuous' (static batches "
                             "compile per prompt length)")
        self.scorer_view()   # validates dtype, expert_impl, tile_rows as the Scorer does
        self._check_pipeline()
        self._check_decoders()
        self._check_prefetch()
        self._check_runtime()
        self._check_weights_dtype()

    def _check_weights_dtype(self) -> None:
        """``weights_dtype="fp8"`` decodes on the resident runner's fused steps only (the
        layerwise MoE program, the static batcher, several decoders and the μ-queue
        runtime place or compute the experts without their FP8 block scales)."""
        if self.weights_dtype != "fp8":
            return
        if self.backend != "resident":
            from moejax.backends.base import fp8_experts_refusal

            raise ValueError(fp8_experts_refusal(self.backend))
        clashes = [name for name, bad in (
            ("batching='static'", self.batching != "continuous"),
            ("step='layerwise'", self.resolved_step() != "fused"),
            ("decoders", self.decoders != 1),
            ("pipeline", self.pipeline is not None),
            ("runtime='mu_queue'", self.runtime != "continuous")) if bad]
        if clashes:
            raise ValueError(f"weights_dtype='fp8' decodes with continuous batching and fused "
                             f"steps on one resident decoder; it does not take "
                             f"{', '.join(clashes)}")

    def _check_runtime(self) -> None:
        from moejax.asyncmoe.schedulers import SCHEDULER_NAMES

        if self.runtime not in RUNTIMES:
            raise ValueError(f"runtime must be one of {RUNTIMES}, got {self.runtime!r}")
        if self.runtime == "continuous":
            if self.scheduler is not None:
                raise ValueError("scheduler picks the μ-queue runtime's next queue: give it "
                                 "with runtime='mu_queue'")
            return
        if self.scheduler is not None and self.scheduler not in SCHEDULER_NAMES:
            raise ValueError(f"scheduler must be one of {SCHEDULER_NAMES}, got "
                             f"{self.scheduler!r}")
        clashes = [name for name, bad in (
            ("batching='static'", self.batching != "continuous"),
            (f"backend={self.backend!r}", self.backend != "resident"),
            ("backend_options", bool(self.backend_options)),
            ("decoders", self.decoders != 1),
            ("prefetch", self.prefetch_options() != {}),
            ("trace_experts", self.trace_experts),
            ("precompile", self.precompile),
            ("kv_cache_mib", self.kv_cache_mib is not None),
            ("step='layerwise'", self.step == "layerwise")) if bad]
        if clashes:
            raise ValueError(f"runtime='mu_queue' places the experts itself over `devices` and "
                             f"runs whole calls; it does not take {', '.join(clashes)}")

    def _check_prefetch(self) -> None:
        from moejax.prefetch.runner import check_choice

        given = [name for name in ("prefetch", "prefetch_mode", "prefetch_files")
                 if getattr(self, name) is not None]
        if not given:
            return
        if self.backend != "offload" or self.batching != "continuous" \
                or self.resolved_step() != "layerwise":
            raise ValueError(f"{', '.join(given)}: expert prefetch runs on backend='offload' "
                             f"with continuous batching and layerwise steps (got backend="
                             f"{self.backend!r}, batching={self.batching!r}, step={self.step!r})")
        try:
            check_choice(self.prefetch or "none", self.prefetch_mode or "exact")
        except BackendError as exc:
            raise ValueError(str(exc)) from None

    def prefetch_options(self) -> dict[str, Any]:
        """The offload runner's prefetch keywords ({} when prefetch is not asked for)."""
        return with_prefetch_defaults({
            name: getattr(self, name) for name in ("prefetch", "prefetch_mode", "prefetch_files")
            if getattr(self, name) is not None})

    def _check_pipeline(self) -> None:
        """A ``pipeline`` as a :class:`PipelineConfig`, refused beside the options it
        replaces (each named with the pipeline) and the runtimes it cannot run on."""
        if self.pipeline is None:
            return
        object.__setattr__(self, "pipeline", as_config(self.pipeline))
        clashes = [name for name, bad in (
            ("decoders", self.decoders != 1),
            ("routing", self.routing is not None),
            ("eldr_fit", self.eldr_fit is not None),
            ("eldr_tau", self.eldr_tau is not None),
            (f"routing_seed={self.routing_seed!r}", self.routing_seed != 0),
            (f"backend={self.backend!r}", self.backend != "resident"),
            (f"devices={self.devices}", self.devices != 1),
            ("backend_options", bool(self.backend_options)),
            ("prefetch", self.prefetch_options() != {}),
            (f"step={self.step!r}", self.step != "auto"),
            ("batching='static'", self.batching != "continuous"),
            ("runtime='mu_queue'", self.runtime != "continuous")) if bad]
        if clashes:
            raise ValueError(f"pipeline describes the prefill stage, the decoders and the "
                             f"routing between them; it does not take {', '.join(clashes)} "
                             f"beside it (give each stage's in the pipeline)")

    @property
    def splits(self) -> bool:
        """Whether prefill and decode run apart (a pipeline, or decoders >= 2): whether
        :meth:`resolved_pipeline` is not None, without building it."""
        return self.pipeline is not None or self.decoders != 1

    def resolved_pipeline(self) -> PipelineConfig | None:
        """The prefill→decode pipeline these options run: ``pipeline``, or ``decoders=K``
        as K decoders alike on the backend (with its options), decoder i on device i and
        the prefill stage on device 0; None for one decoder."""
        if self.pipeline is not None:
            return self.pipeline
        if self.decoders == 1:
            return None
        options = {**dict(self.backend_options or {}), **self.prefetch_options()}
        return PipelineConfig(
            prefill=PrefillStage(backend=self.backend, step=self.step, options=options),
            decoders=(DecoderStage(placement=self.backend, count=self.decoders,
                                   step=self.step, options=options),),
            routing=self.resolved_routing(), eldr_fit=self.eldr_fit, eldr_tau=self.eldr_tau,
            routing_seed=self.routing_seed)

    def _check_decoders(self) -> None:
        check_positive_int("decoders", self.decoders, ValueError)
        if not isinstance(self.routing_seed, int) or isinstance(self.routing_seed, bool) \
                or self.routing_seed < 0:
            raise ValueError(f"routing_seed must be a non-negative integer, got "
                             f"{self.routing_seed!r}")
        if self.decoders == 1:
            given = [name for name in ("routing", "eldr_tau", "eldr_fit")
                     if getattr(self, name) is not None]
            if given:
                raise ValueError(f"{', '.join(given)} choose among several decoders; give "
                                 f"decoders >= 2 (decoders=1 prefills and decodes together)")
            return
        if self.batching != "continuous":
            raise ValueError("decoders >= 2 needs batching='continuous'")
        if self.backend not in SPLIT_BACKENDS or self.devices != 1:
            raise ValueError(f"decoders >= 2 runs each decoder on one device with backend "
                             f"{' or '.join(map(repr, SPLIT_BACKENDS))}, devices=1; got "
                             f"backend={self.backend!r}, devices={self.devices}")
        routing = self.resolved_routing()
        if isinstance(routing, Policy):
            if routing.num_decoders != self.decoders or self.eldr_tau is not None \
                    or self.eldr_fit is not None:
                raise ValueError(f"a routing policy object routes over its own "
                                 f"{routing.num_decoders} decoders (decoders={self.decoders}) "
                                 f"and takes no eldr_tau or eldr_fit")
            return
        if routing not in POLICIES:
            raise ValueError(f"routing must be one of {POLICIES}, got {routing!r}")
        if self.eldr_tau is not None:
            if routing != "eldr":
                raise ValueError(f"eldr_tau applies to routing='eldr', not {routing!r}")
            check_tau(self.eldr_tau)
        if routing == "eldr" and self.eldr_fit is None:
            raise ValueError("routing='eldr' needs eldr_fit=PATH, a fit file made by "
                             "`moejax eldr-fit TRACES -o PATH --decoders K`")
        if routing != "eldr" and self.eldr_fit is not None:
            raise ValueError(f"eldr_fit applies to routing='eldr', not {routing!r}")

    def resolved_routing(self) -> "str | Policy":
        """The decode routing policy (decoders >= 2): "jsq" unless given."""
        return "jsq" if self.routing is None else self.routing

    def resolved_step(self) -> str:
        """The step mode: "auto" is layerwise on offload (the host picks the experts to
        copy each layer), fused elsewhere."""
        return resolved_step(self.backend, self.step)

    def scorer_view(self) -> ScorerOptions:
        """The options shared with the Scorer, resolved by the same code."""
        return ScorerOptions(dtype=self.dtype, expert_impl=self.expert_impl,
                             tile_rows=self.tile_rows, compilation_cache=self.compilation_cache,
                             weights_dtype=self.weights_dtype)


def make_options(options: Mapping[str, Any]) -> GeneratorOptions:
    """Keyword options -> :class:`GeneratorOptions` (None values mean the default)."""
    known = {f.name for f in dataclasses.fields(GeneratorOptions)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise TypeError(f"unknown Generator option(s) {unknown}; known: {sorted(known)}")
    return GeneratorOptions(**{k: v for k, v in options.items() if v is not None})



def check_decode_processes(opts: GeneratorOptions) -> None:
    """BackendError unless ``opts`` can decode over the processes of this run (no-op in one
    process): only continuous batching on ``sync_ep`` spans them (its one mesh holds every
    process's devices); the other runners place the model on one device."""
    if jax.process_count() == 1:
        return
    single = [f"{name}={value!r}" for name, value, ok in (
        ("backend", opts.backend, opts.backend == "sync_ep"),
        ("runtime", opts.runtime, opts.runtime == "continuous"),
        ("batching", opts.batching, opts.batching == "continuous"),
        ("decoders", opts.decoders, opts.decoders == 1),
        ("pipeline", "given", opts.pipeline is None)) if not ok]
    if single:
        raise BackendError(f"generation over {jax.process_count()} processes runs on "
                           f"backend='sync_ep' with continuous batching and one decoder; "
                           f"got {', '.join(single)}")
    check_multi_process(opts.backend, opts.devices)


