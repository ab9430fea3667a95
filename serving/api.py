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
from typing import Any, Mapping, Sequence

import numpy as np

from moejax import checkpoint
from moejax.backends import make_backend
from moejax.calibrate import (DEFAULT_REFERENCE_SEQUENCE, DEFAULT_REFERENCE_TOKENS, Calibration,
                              calibrate, uncalibrated)
from moejax.packing import BucketPolicy, ScoringSequence
from serving.engine import Engine
from serving.options import ScorerOptions, load_options
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


def _sequence(index: int, op: PrefillOp) -> ScoringSequence:
    return ScoringSequence(key=index, token_ids=np.asarray(op.token_ids, np.int32),
                           score_positions=op.score_positions,
                           score_token_ids=op.score_token_ids,
                           full_vocab=op.need_vocab_logsumexp)


def enable_compilation_cache(directory: str | None) -> None:
    """Point JAX's persistent compilation cache at ``directory`` so that a restarted job
    does not recompile its shape buckets; a cache the user configured is left alone."""
    import jax

    if directory is None or jax.config.jax_compilation_cache_dir:
        return
    jax.config.update("jax_compilation_cache_dir", directory)


class Scorer:
    """Scores requests with one model on an execution backend.

    Options (keyword arguments; defaults in ``configs/scoring.yaml``): ``dtype``
    ("float32" | "bfloat16" | "auto"), ``max_batch_tokens``, ``min_block``,
    ``expert_impl``, ``tile_rows``, ``progress_min_requests``, ``compilation_cache``,
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
        enable_compilation_cache(self.options.resolved_compilation_cache())
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
        backend = make_backend(self.options.backend, self.config, params,
                               devices=self.options.devices, dtype=dtype,
                               **dict(self.options.backend_options))
        del params  # the backend holds the placed copy
        self.engine = Engine(self.config, backend, policy=policy,
                             expert_impl=self.options.expert_impl,
                             tile_rows=self.options.tile_rows)
        self.calibration = self._calibrate(backend, policy.max_batch_tokens)

    def _calibrate(self, backend, max_batch_tokens: int) -> Calibration:
        opts = self.options
        if opts.theta is not None or opts.calibrate:
            return calibrate(backend, eps=opts.calibration_eps, theta=opts.theta,
                             max_batch_tokens=max_batch_tokens,
                             reference_tokens=min(DEFAULT_REFERENCE_TOKENS, max_batch_tokens),
                             reference_sequence=min(DEFAULT_REFERENCE_SEQUENCE, max_batch_tokens),
                             expert_impl=opts.expert_impl)
        return uncalibrated(backend, max_batch_tokens, opts.calibration_eps)

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
                "memory": backend.memory_report().as_dict()}

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
        sequences = [_sequence(i, op) for i, op in enumerate(ops)]
        if progress is None:
            progress = (len(requests) >= self.options.progress_min_requests
                        and sys.stderr.isatty())
        bar = None
        if progress and sequences:
            from tqdm import tqdm

            bar = tqdm(total=len(sequences), unit="seq", desc="scoring", file=sys.stderr)
        try:
            raw = self.engine.run(sequences, on_batch_done=bar.update if bar else None)
        finally:
            if bar is not None:
                bar.close()
        outputs = [OpOutput(logits=raw[i][0], logsumexp=raw[i][1]) for i in range(len(ops))]
        return combine_results(requests, ops, outputs, errors, prompt_tokens)
