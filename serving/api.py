"""``Scorer``: the Python entry point for prefill-only scoring.

    from serving import Scorer
    scorer = Scorer("demo")                       # or a local Hugging Face / converted dir
    results = scorer.score([{"prompt": "Is the sky blue?", "candidates": [" yes", " no"]}])

Requests are validated and expanded into prefill ops (``serving.requests``),
packed into bucketed batches and run by an :class:`~moejax.core.scoring_engine.Engine`;
results come back in request order, bad requests as results with ``error`` set, and a
text candidate that tokenizes differently after its prompt than apart is scored as
tokenized apart with a warning in its result's ``warnings``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time
from typing import Any, Hashable, Mapping, Sequence

import numpy as np

from moejax import checkpoint, distributed
from moejax.backends import backend_class, make_backend
from moejax.backends.base import PREFIX_POOL_BACKENDS, require_devices
from moejax.calibrate import (DEFAULT_REFERENCE_SEQUENCE, DEFAULT_REFERENCE_TOKENS, Calibration,
                              calibrate, fallback_theta, uncalibrated)
from moejax.core.engine_pool import EnginePool, OpTiming
from moejax.core.prefix_plan import blocks_for_budget, sharing_flops
from moejax.core.router import make_router
from moejax.core.scoring_engine import Engine
from moejax.distributed import DistributedOptions, join as distributed_join
from moejax.model_dirs import (model_display_name,  # noqa: F401  (serving's import path)
                               resolve_model_dir)
from moejax.ops import OpKey
from moejax.packing import BucketPolicy
from serving.compilation_cache import enable_compilation_cache
from serving.limits import RequestLimits
from serving.options import ScorerOptions, load_options
from serving.requests import (ClassifierHead, NormalizeOptions, PrefillOp, RequestError, ScoreRequest,
                              ScoreResult, TokenizerAdapter, boundary_warnings,
                              normalize_requests, renamed, request_id_of, request_label)
from serving.results import combine_results

log = logging.getLogger("moejax.scorer")

RequestLike = ScoreRequest | Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class PreparedRequest:
    """One request validated, tokenized and expanded into prefill ops (no device work).

    ``index`` names the request in messages (its position in the caller's list); ``ops``
    are keyed ``OpKey(index, candidate)``; ``cost`` is what computing them costs, in
    token-equivalents (FLOPs over one token's linear FLOPs, prompt sharing counted), the
    sum of ``op_costs`` (each op's, in order: the first whole, the others after the prompt
    they share); ``error`` is set (and ``ops`` empty) for a request that cannot be scored;
    ``warnings``: what its result will carry (candidate tokenization boundaries,
    :func:`serving.requests.boundary_warnings`)."""

    index: int
    request: Any
    ops: tuple[PrefillOp, ...] = ()
    prompt_tokens: int = 0
    cost: int = 0
    error: str | None = None
    op_costs: tuple[int, ...] = ()
    warnings: tuple[str, ...] = ()


def attach_timings(results: list[ScoreResult], prepared: Sequence[PreparedRequest],
                   timings: Mapping[Hashable, OpTiming]) -> list[ScoreResult]:
    """Per request: the engine(s) and router round(s) of its ops, and the seconds from the
    start of its run until its last op was done."""
    for result, prep in zip(results, prepared):
        parts = [timings[op.key] for op in prep.ops if op.key in timings]
        if parts:
            result.timings = {"engines": sorted({t.engine for t in parts}),
                              "rounds": sorted({t.round for t in parts}),
                              "seconds": round(max(t.seconds for t in parts), 6)}
    return results


class Scorer:
    """Scores requests with one model on an execution backend.

    Options (keyword arguments; defaults in ``serving/configs/scoring.yaml``): ``dtype``
    ("float32" | "bfloat16" | "auto"), ``max_batch_tokens``, ``min_block``,
    ``expert_impl``, ``tile_rows``, ``progress_min_requests``, ``compilation_cache``
    (default None: JAX's process-wide compilation cache is left alone; ``"auto"`` or a
    directory turns it on, see ``serving.enable_compilation_cache``),
    ``backend`` (resident | offload | async_ep | hybrid | sync_ep | tp), ``devices``,
    ``backend_options`` (the backend's own keywords), ``calibrate``, ``calibration_eps``,
    ``theta``, ``weights_dtype`` ("auto": an FP8 checkpoint is dequantized on load;
    "fp8": its routed experts stay in FP8 with their block scales, resident backend
    only); plus ``deployment`` (a YAML file of options, e.g.
    ``serving/configs/deployments/async_ep.yaml`` or its name ``"async_ep"``, applied before the keyword arguments) and
    ``normalize_options`` (prompt templates of "choice" and "multi"); ``distributed``
    (:class:`moejax.distributed.DistributedOptions` or its dict: join the other processes
    of a multi-process run first; every process then builds the same Scorer and scores the
    same requests, see ``moejax.distributed``).
    """

    def __init__(self, model: str | os.PathLike = "demo", *,
                 normalize_options: NormalizeOptions | None = None,
                 deployment: str | os.PathLike | None = None,
                 distributed: DistributedOptions | dict[str, Any] | None = None,
                 **options: Any):
        # Before anything computes: over several processes the backends' meshes span them.
        distributed_join(distributed)
        self.options: ScorerOptions = load_options(options, deployment=deployment)
        enable_compilation_cache(self.options.compilation_cache)
        self.model_dir, self.is_demo = resolve_model_dir(model)
        self.demo_name = os.fspath(model) if self.is_demo else None
        self._model_name = model_display_name(model, self.model_dir, self.is_demo)
        if self.demo_name is not None:
            from moejax.demo import demo_model

            log.warning(demo_model(self.demo_name).notice)
        dtype = self.options.resolved_dtype()
        self.config, params, tokenizer = checkpoint.load_model_dir(
            self.model_dir, dtype.name, weights_dtype=self.options.weights_dtype)
        self.tokenizer = TokenizerAdapter.from_model_dir(self.model_dir, tokenizer)
        # A sequence classifier's head (requests of kind "head"), None for a language model.
        self.head = ClassifierHead.of(self.config)
        self.normalize_options = normalize_options or NormalizeOptions.from_mapping(
            self.options.templates)
        opts = self.options
        self.limits = RequestLimits.resolve(self.config.max_context,
                                            max_text_bytes=opts.max_text_bytes,
                                            max_token_ids=opts.max_token_ids,
                                            max_candidates=opts.max_candidates)
        self.shares_prompts = self._shares_prompts()
        policy = BucketPolicy(max_batch_tokens=self.options.resolved_batch_tokens(),
                              min_block=self.options.min_block)
        self.engines = [self._engine(params, dtype, policy, g)
                        for g in range(self.options.engines)]
        del params  # the backends hold the placed copies
        self.engine = self.engines[0]
        self.calibration = self._calibrate(self.engine.backend, policy.max_batch_tokens)
        self._route_ranks(policy.max_batch_tokens)
        self.pool = None
        if self._schedules_engines():
            theta = self.calibration.theta or fallback_theta(self.config, policy.max_batch_tokens)
            self.pool = EnginePool(self.engines, self._engine_router(theta),
                                   max_num_seqs=self.options.max_num_seqs)
            self.pool.router_theta = theta

    def _engine_router(self, theta: float):
        """The router over the engines (fresh: no blocks known)."""
        return make_router(self.options.routing, self.config, len(self.engines), theta=theta,
                           seed=self.options.routing_seed, shares_prefixes=self.shares_prompts)

    def _schedules_engines(self) -> bool:
        """Whether a call's ops go through the router and the engine pool: with several
        engines, and with one when it runs PrefillOnly's scheduler (``routing=
        "prefill_only"``: shortest prefill first) or ``max_num_seqs`` sequences at a time."""
        opts = self.options
        return (len(self.engines) > 1 or opts.routing == "prefill_only"
                or opts.max_num_seqs is not None)

    def _route_ranks(self, max_batch_tokens: int) -> None:
        """An engine of several data-parallel ranks with a prefix pool routes a call's
        ops over its ranks by the Scorer's ``routing``, each rank a target with a Θ of its
        own: the Scorer's Θ (calibrated on the backend: the work that hides a layer's
        weight transfer), but at least one full batch of work, since a step runs one
        batch on every rank (a smaller Θ would spread a prefix's siblings over ranks
        that each recompute it, without filling any step more)."""
        theta = max(self.calibration.theta or 0.0,
                    fallback_theta(self.config, max_batch_tokens))
        for engine in self.engines:
            if engine.rank_router is not None:
                engine.route_ranks(self.options.routing, theta, seed=self.options.routing_seed)

    def _engine(self, params, dtype, policy: BucketPolicy, index: int) -> Engine:
        """Engine ``index``: with several engines, the backend on its own ``devices``
        devices (engine g on devices g·D … g·D + D-1; resident: device g)."""
        opts = self.options
        if opts.engines > 1:
            count = opts.devices
            every = require_devices(f"{opts.backend} (engines={opts.engines})",
                                    opts.engines * count)
            mine = every[index * count:(index + 1) * count]
            if opts.backend == "resident":
                backend = make_backend("resident", self.config, params, dtype=dtype,
                                       device=mine[0])
            else:
                backend = make_backend(opts.backend, self.config, params, devices=count,
                                       dtype=dtype, device_pool=mine,
                                       **dict(opts.backend_options))
        else:
            backend = make_backend(opts.backend, self.config, params, devices=opts.devices,
                                   dtype=dtype, **dict(opts.backend_options))
        return Engine(self.config, backend, policy=policy, expert_impl=opts.expert_impl,
                      tile_rows=opts.tile_rows, prefix_cache_blocks=self._prefix_blocks(dtype),
                      kv_cache_free=self.kv_cache_free)

    def _shares_prompts(self) -> bool:
        """Whether a prompt is computed once for all of a request's ops (and those of other
        requests sharing it) in a call: option ``share_prompts`` ("auto": where the backend
        holds a prefix pool)."""
        opts = self.options
        backend = opts.backend
        holds = backend_class(backend).holds_prefix_pool
        if opts.share_prompts is True and not holds:
            raise ValueError(f"share_prompts=true needs a backend that holds a prefix pool "
                             f"({', '.join(PREFIX_POOL_BACKENDS)}); backend {backend!r} "
                             f"does not (use "
                             f"share_prompts='auto' or false)")
        if opts.share_prompts is False and (opts.kv_cache_free or opts.prefix_cache_blocks):
            raise ValueError("share_prompts=false contradicts kv_cache_free / "
                             "prefix_cache_blocks, which share prompts")
        return holds and opts.share_prompts is not False

    @property
    def kv_cache_free(self) -> bool:
        """Prompt sharing within a call only (no prefix cache kept across calls)."""
        return self.options.kv_cache_free or (self.shares_prompts
                                              and not self.options.prefix_cache_blocks)

    def _prefix_blocks(self, dtype) -> int:
        """Pool blocks of the prefix cache: the option, or ``auto`` = ``prefix_cache_mib``
        worth; KV-cache-free mode (prompt sharing without a cache) needs a pool too."""
        blocks = self.options.prefix_cache_blocks
        if blocks == "auto" or (blocks == 0 and self.kv_cache_free):
            blocks = blocks_for_budget(self.config, self.options.prefix_cache_mib << 20,
                                       np.dtype(dtype).itemsize)
        return int(blocks)

    def _calibrate(self, backend, max_batch_tokens: int) -> Calibration:
        opts = self.options
        if opts.theta is not None or opts.calibrate:
            # Over several processes every one must route with the same Θ: process 0's.
            return distributed.agree(calibrate(
                backend, eps=opts.calibration_eps, theta=opts.theta,
                max_batch_tokens=max_batch_tokens,
                reference_tokens=min(DEFAULT_REFERENCE_TOKENS, max_batch_tokens),
                reference_sequence=min(DEFAULT_REFERENCE_SEQUENCE, max_batch_tokens),
                expert_impl=opts.expert_impl))
        return uncalibrated(backend, max_batch_tokens, opts.calibration_eps)

    def warm_up(self) -> tuple[int, float]:
        """Compile the common scoring shapes before the first request -> (programs
        compiled, seconds). For every token bucket up to the batch size (and the context),
        one sequence of that many token ids with two single-token candidates, read over
        the candidates and over the vocabulary, runs alone on every engine (each its own
        batch, of that bucket's shape). Shapes with more score positions or candidates, or
        on the prefix pool with cached context, still compile on first use. The prefix
        caches are reset afterwards (the warm-up prompts are no real prefixes)."""
        start = time.perf_counter()
        before = sum(engine.stats.compiles for engine in self.engines)
        cfg = self.config
        top = min(self.engine.policy.max_batch_tokens, cfg.max_context)
        for length in self.engine.policy.token_buckets(cfg.max_context):
            if length > top:
                break
            prompt = [(7 * i + 3) % cfg.vocab_size for i in range(length)]
            for normalize in ("candidates", "vocab"):
                prepared = self.prepare({"prompt_token_ids": prompt, "normalize": normalize,
                                         "candidate_token_ids": [[1], [2]]})
                if prepared.error is not None:      # (a context shorter than the bucket)
                    continue
                for engine in self.engines:
                    engine.run(list(prepared.ops))
        self.reset_prefix_cache()
        compiled = sum(engine.stats.compiles for engine in self.engines) - before
        return compiled, time.perf_counter() - start

    def reset_prefix_cache(self) -> None:
        """Forget every engine's cached prefixes and the router's view of them."""
        for engine in self.engines:
            engine.reset_prefix_cache()
        if self.pool is not None:
            self.pool.router = self._engine_router(self.pool.router_theta)

    @property
    def info(self) -> dict[str, Any]:
        """What is being served: architecture, sizes, dtype, batching, backend, Θ."""
        cfg = self.config
        backend = self.engine.backend
        return {"model_dir": self.model_dir, "model_name": self.model_name, "demo": self.is_demo,
                "model_type": cfg.model_type,
                "vocab_size": cfg.vocab_size, "max_context": cfg.max_context,
                "num_layers": cfg.num_layers, "num_experts": cfg.num_experts,
                "experts_per_token": cfg.num_experts_per_tok,
                "dtype": self.engine.dtype.name, "device": str(self.engine.device),
                "weights_dtype": self.options.weights_dtype,
                "max_batch_tokens": self.engine.policy.max_batch_tokens,
                **backend.describe(), "theta_flops": self.calibration.theta,
                "theta_source": self.calibration.source,
                "memory": backend.memory_report().as_dict(),
                "engines": len(self.engines),
                "routing": self.options.routing if self.pool is not None else None,
                "prefix_cache_blocks": (self.engine.prefix_cache.num_blocks
                                        if self.engine.prefix_cache else 0),
                "kv_cache_free": self.kv_cache_free, "share_prompts": self.shares_prompts,
                "limits": self.limits.as_dict(),
                "labels": list(cfg.id2label) if self.head else None,
                "problem_type": (cfg.problem_type or None) if self.head else None}

    @property
    def model_name(self) -> str:
        """The model's name, safe to show a remote caller: a built-in model's name
        ("demo", "demo-e32"), a hub model's id ("Qwen/Qwen3-30B-A3B"), or the name of its
        directory (never the path)."""
        return self._model_name

    def prepare(self, request: RequestLike, index: int = 0) -> PreparedRequest:
        """Validate, tokenize and expand one request (``index``: its position in the
        caller's list, naming it in messages). Needs no device and may run on any thread
        (the tokenizer releases the GIL), beside a :meth:`run_ops` of another thread."""
        try:
            self.limits.check(request, index)
        except RequestError as exc:
            return PreparedRequest(index=index, request=request, error=str(exc))
        except Exception:  # noqa: BLE001  (a malformed request: the parser names the problem)
            pass
        ops, errors, prompt_tokens = normalize_requests(
            [request], self.tokenizer, vocab_size=self.config.vocab_size,
            max_context=self.config.max_context, options=self.normalize_options, start=index,
            head=self.head)
        if errors:
            return PreparedRequest(index=index, request=request, error=errors[index])
        flops = (sharing_flops(ops, self.config) if self.shares_prompts
                 else [op.flops(self.config) for op in ops])
        op_costs = tuple(self.token_equivalents(f) for f in flops)
        return PreparedRequest(index=index, request=request, ops=tuple(ops),
                               prompt_tokens=prompt_tokens[index], cost=sum(op_costs),
                               op_costs=op_costs,
                               warnings=self._warnings(request, index))

    def _warnings(self, request: RequestLike, index: int) -> tuple[str, ...]:
        """The warnings of a request that will be scored (a check that fails is logged and
        skipped: a warning never costs a request its scores)."""
        try:
            return tuple(boundary_warnings(request, index, self.tokenizer))
        except Exception as exc:  # noqa: BLE001
            log.warning("request #%d: the candidate boundary check failed (%s: %s)", index,
                        type(exc).__name__, exc, extra={"request_id": request_id_of(request)})
            return ()

    def token_equivalents(self, flops: int) -> int:
        """A cost in FLOPs as tokens: over one token's linear FLOPs (at least 1)."""
        return max(1, -(-int(flops) // self.config.linear_flops_per_token))

    def run_ops(self, ops: Sequence[PrefillOp], on_batch_done: Any = None
                ) -> tuple[dict[Hashable, Any], dict[Hashable, OpTiming]]:
        """Run prefill ops (keys distinct) -> (output by op key: its OpOutput or the
        exception of the step that failed it; timing by op key). Not thread-safe: one
        thread runs the model."""
        start = time.perf_counter()
        timings: Mapping[Hashable, OpTiming] | None = None
        try:
            if self.pool is not None:
                raw, by_index = self.pool.run(ops, on_batch_done)
                timings = {op.key: by_index[i] for i, op in enumerate(ops)}
            else:
                raw = self.engine.run(ops, on_batch_done=on_batch_done)
        except Exception as error:   # noqa: BLE001
            # A run that raises (a failed step on the prefix pool fails its run: the engine
            # has recovered) fails every op of it; a failed plain step fails only its own
            # ops, whose outputs are then the exception.
            log.error("scoring run failed: %s: %s", type(error).__name__, error)
            raw = {op.key: error for op in ops}
        if timings is None:
            done = time.perf_counter() - start
            timings = {op.key: OpTiming(engine=0, round=0, seconds=done) for op in ops}
        return raw, dict(timings)

    def combine(self, prepared: Sequence[PreparedRequest], raw: Mapping[Hashable, Any],
                timings: Mapping[Hashable, OpTiming] | None = None) -> list[ScoreResult]:
        """One result per prepared request, in order, from the outputs of their ops."""
        requests, ops, outputs = [], [], []
        errors: dict[int, str] = {}
        prompt_tokens: dict[int, int] = {}
        for position, prep in enumerate(prepared):
            requests.append(prep.request)
            if prep.error is not None:
                errors[position] = prep.error
                continue
            prompt_tokens[position] = prep.prompt_tokens
            for op in prep.ops:
                out = raw[op.key]
                if prep.index != position:
                    op = dataclasses.replace(op, key=OpKey(position, op.candidate_index))
                ops.append(op)
                outputs.append(out)
        results = combine_results(requests, ops, outputs, errors, prompt_tokens, self.head)
        for position, (result, prep) in enumerate(zip(results, prepared)):
            if position not in errors and position != prep.index:
                # combine_results names an id-less request by its position here.
                result.error = renamed(result.error, position, request_label(None, prep.index))
            if prep.warnings:
                result.warnings = list(prep.warnings)
        return attach_timings(results, prepared, timings or {})

    def score(self, requests: Sequence[RequestLike], *, progress: bool | None = None
              ) -> list[ScoreResult]:
        """Score ``requests`` (dicts or :class:`ScoreRequest`); one result per request, in order.

        ``progress``: show a progress bar (default: when there are at least
        ``progress_min_requests`` requests and stderr is a terminal).
        """
        if isinstance(requests, (str, bytes, Mapping, ScoreRequest)):
            raise TypeError("score() takes a list of requests; wrap a single request in a list")
        prepared = [self.prepare(request, index) for index, request in enumerate(requests)]
        ops = [op for prep in prepared for op in prep.ops]
        if progress is None:
            progress = (len(prepared) >= self.options.progress_min_requests
                        and sys.stderr.isatty())
        bar = None
        if progress and ops:
            from tqdm import tqdm

            bar = tqdm(total=len(ops), unit="seq", desc="scoring", file=sys.stderr)
        try:
            raw, timings = self.run_ops(ops, bar.update if bar else None)
        finally:
            if bar is not None:
                bar.close()
        return self.combine(prepared, raw, timings)

