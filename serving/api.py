"""``Scorer``: the Python entry point for prefill-only scoring.

    from serving import Scorer
    scorer = Scorer("demo")                       # or a local Hugging Face / converted dir
    results = scorer.score([{"prompt": "Is the sky blue?", "candidates": [" yes", " no"]}])

Requests are validated and expanded into prefill ops (``serving.requests``),
packed into bucketed batches and run by an :class:`~serving.engine.Engine`;
results come back in request order, bad requests as results with ``error`` set.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any, Mapping, Sequence

import numpy as np

from moejax import checkpoint
from moejax.backends import make_backend
from moejax.backends.base import require_devices
from moejax.calibrate import (DEFAULT_REFERENCE_SEQUENCE, DEFAULT_REFERENCE_TOKENS, Calibration,
                              calibrate, fallback_theta, uncalibrated)
from moejax.packing import BucketPolicy
from serving.compilation_cache import enable_compilation_cache
from serving.engine import Engine
from serving.dispatch import EnginePool, OpTiming
from serving.options import ScorerOptions, load_options
from serving.router import make_router
from serving.prefix_cache import blocks_for_budget
from serving.requests import (NormalizeOptions, OpOutput, PrefillOp, ScoreRequest, ScoreResult,
                              TokenizerAdapter, normalize_requests)
from serving.results import combine_results

log = logging.getLogger("moejax.scorer")

RequestLike = ScoreRequest | Mapping[str, Any]


def resolve_model_dir(model: str | os.PathLike) -> tuple[str, bool]:
    """``"demo"`` -> the built-in demo model (created on first use); else a local directory.

    Returns (path, is_demo)."""
    if os.fspath(model) == "demo":
        from moejax import demo

        return demo.ensure_demo_model(), True
    path = os.fspath(model)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"model directory {path!r} does not exist (give a local Hugging "
                                f"Face model directory, a converted moejax directory, or 'demo')")
    return path, False


def attach_timings(results: list[ScoreResult], ops: Sequence[PrefillOp],
                   timings: Mapping[int, OpTiming]) -> list[ScoreResult]:
    """Per request: the engine(s) and router round(s) of its ops, and the seconds from the
    start of the call until its last op was done."""
    by_request: dict[int, list[OpTiming]] = {}
    for i, op in enumerate(ops):
        by_request.setdefault(op.request_index, []).append(timings[i])
    for index, parts in by_request.items():
        results[index].timings = {"engines": sorted({t.engine for t in parts}),
                                  "rounds": sorted({t.round for t in parts}),
                                  "seconds": round(max(t.seconds for t in parts), 6)}
    return results


class Scorer:
    """Scores requests with one model on an execution backend.

    Options (keyword arguments; defaults in ``configs/scoring.yaml``): ``dtype``
    ("float32" | "bfloat16" | "auto"), ``max_batch_tokens``, ``min_block``,
    ``expert_impl``, ``tile_rows``, ``progress_min_requests``, ``compilation_cache``
    (default None: JAX's process-wide compilation cache is left alone; ``"auto"`` or a
    directory turns it on, see ``serving.enable_compilation_cache``),
    ``backend`` (resident | offload | async_ep | hybrid | sync_ep | tp), ``devices``,
    ``backend_options`` (the backend's own keywords), ``calibrate``, ``calibration_eps``,
    ``theta``; plus ``deployment`` (a YAML file of options, e.g.
    ``configs/deployments/async_ep.yaml``, applied before the keyword arguments) and
    ``normalize_options`` (prompt templates of "choice" and "multi").
    """

    def __init__(self, model: str | os.PathLike = "demo", *,
                 normalize_options: NormalizeOptions | None = None,
                 deployment: str | os.PathLike | None = None, **options: Any):
        self.options: ScorerOptions = load_options(options, deployment=deployment)
        enable_compilation_cache(self.options.compilation_cache)
        self.model_dir, self.is_demo = resolve_model_dir(model)
        if self.is_demo:
            from moejax.demo import DEMO_NOTICE

            log.warning(DEMO_NOTICE)
        dtype = self.options.resolved_dtype()
        self.config, params, tokenizer = checkpoint.load_model_dir(self.model_dir, dtype.name)
        self.tokenizer = TokenizerAdapter(tokenizer)
        self.normalize_options = normalize_options or NormalizeOptions()
        policy = BucketPolicy(max_batch_tokens=self.options.resolved_batch_tokens(),
                              min_block=self.options.min_block)
        self.engines = [self._engine(params, dtype, policy, g)
                        for g in range(self.options.engines)]
        del params  # the backends hold the placed copies
        self.engine = self.engines[0]
        self.calibration = self._calibrate(self.engine.backend, policy.max_batch_tokens)
        self.pool = None
        if len(self.engines) > 1:
            theta = self.calibration.theta or fallback_theta(self.config, policy.max_batch_tokens)
            router = make_router(self.options.routing, self.config, len(self.engines),
                                 theta=theta, seed=self.options.routing_seed)
            self.pool = EnginePool(self.engines, router)
            self.pool.router_theta = theta

    def _engine(self, params, dtype, policy: BucketPolicy, index: int) -> Engine:
        """Engine ``index``: with several engines, a resident backend on device ``index``."""
        opts = self.options
        if opts.engines > 1:
            devices = require_devices("resident (engines)", opts.engines)
            backend = make_backend("resident", self.config, params, dtype=dtype,
                                   device=devices[index])
        else:
            backend = make_backend(opts.backend, self.config, params, devices=opts.devices,
                                   dtype=dtype, **dict(opts.backend_options))
        return Engine(self.config, backend, policy=policy, expert_impl=opts.expert_impl,
                      tile_rows=opts.tile_rows, prefix_cache_blocks=self._prefix_blocks(dtype),
                      kv_cache_free=opts.kv_cache_free)

    def _prefix_blocks(self, dtype) -> int:
        """Pool blocks of the prefix cache: the option, or ``auto`` = ``prefix_cache_mib``
        worth; KV-cache-free mode needs a pool too (for in-run sharing)."""
        blocks = self.options.prefix_cache_blocks
        if blocks == "auto" or (blocks == 0 and self.options.kv_cache_free):
            blocks = blocks_for_budget(self.config, self.options.prefix_cache_mib << 20,
                                       np.dtype(dtype).itemsize)
        return int(blocks)

    def _calibrate(self, backend, max_batch_tokens: int) -> Calibration:
        opts = self.options
        if opts.theta is not None or opts.calibrate:
            return calibrate(backend, eps=opts.calibration_eps, theta=opts.theta,
                             max_batch_tokens=max_batch_tokens,
                             reference_tokens=min(DEFAULT_REFERENCE_TOKENS, max_batch_tokens),
                             reference_sequence=min(DEFAULT_REFERENCE_SEQUENCE, max_batch_tokens),
                             expert_impl=opts.expert_impl)
        return uncalibrated(backend, max_batch_tokens, opts.calibration_eps)

    def reset_prefix_cache(self) -> None:
        """Forget every engine's cached prefixes and the router's view of them."""
        for engine in self.engines:
            engine.reset_prefix_cache()
        if self.pool is not None:
            self.pool.router = make_router(self.options.routing, self.config, len(self.engines),
                                           theta=self.pool.router_theta,
                                           seed=self.options.routing_seed)

    @property
    def info(self) -> dict[str, Any]:
        """What is being served: architecture, sizes, dtype, batching, backend, Θ."""
        cfg = self.config
        backend = self.engine.backend
        return {"model_dir": self.model_dir, "demo": self.is_demo, "model_type": cfg.model_type,
                "vocab_size": cfg.vocab_size, "max_context": cfg.max_context,
                "num_layers": cfg.num_layers, "num_experts": cfg.num_experts,
                "experts_per_token": cfg.num_experts_per_tok,
                "dtype": self.engine.dtype.name, "device": str(self.engine.device),
                "max_batch_tokens": self.engine.policy.max_batch_tokens,
                **backend.describe(), "theta_flops": self.calibration.theta,
                "theta_source": self.calibration.source,
                "memory": backend.memory_report().as_dict(),
                "engines": len(self.engines),
                "routing": self.options.routing if self.pool is not None else None,
                "prefix_cache_blocks": (self.engine.prefix_cache.num_blocks
                                        if self.engine.prefix_cache else 0),
                "kv_cache_free": self.options.kv_cache_free}

    def score(self, requests: Sequence[RequestLike], *, progress: bool | None = None
              ) -> list[ScoreResult]:
        """Score ``requests`` (dicts or :class:`ScoreRequest`); one result per request, in order.

        ``progress``: show a progress bar (default: when there are at least
        ``progress_min_requests`` requests and stderr is a terminal).
        """
        if isinstance(requests, (str, bytes, Mapping, ScoreRequest)):
            raise TypeError("score() takes a list of requests; wrap a single request in a list")
        requests = list(requests)
        ops, errors, prompt_tokens = normalize_requests(
            requests, self.tokenizer, vocab_size=self.config.vocab_size,
            max_context=self.config.max_context, options=self.normalize_options)
        if progress is None:
            progress = (len(requests) >= self.options.progress_min_requests
                        and sys.stderr.isatty())
        bar = None
        if progress and ops:
            from tqdm import tqdm

            bar = tqdm(total=len(ops), unit="seq", desc="scoring", file=sys.stderr)
        start = time.perf_counter()
        timings: Mapping[int, OpTiming] | None = None
        try:
            if self.pool is not None:
                raw, timings = self.pool.run(ops, bar.update if bar else None)
            else:
                raw = self.engine.run(ops, on_batch_done=bar.update if bar else None)
        except Exception as error:   # noqa: BLE001
            # A run that raises (a failed step on the prefix pool fails its run: the engine
            # has recovered) fails every op of it; a failed plain step fails only its own
            # ops, whose outputs are then the exception.
            log.error("scoring run failed: %s: %s", type(error).__name__, error)
            raw = {op.key: error for op in ops}
        finally:
            if bar is not None:
                bar.close()
        if timings is None:
            done = time.perf_counter() - start
            timings = {i: OpTiming(engine=0, round=0, seconds=done) for i in range(len(ops))}
        outputs = [raw[op.key] if isinstance(raw[op.key], Exception)
                   else OpOutput(logits=raw[op.key][0], logsumexp=raw[op.key][1]) for op in ops]
        results = combine_results(requests, ops, outputs, errors, prompt_tokens)
        return attach_timings(results, ops, timings)
