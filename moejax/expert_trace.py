"""Expert traces of one prompt without generating: the top-k expert ids of every prompt
token at every layer (the static runtime's prefill program, which returns them), and
per-layer activation counts of traced ids."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from moejax import sampling
from moejax.config import ModelConfig
from moejax.moe import ExpertImpl
from moejax.param_layout import Params
from moejax.sequences import SequenceSpec
from moejax.sizes import bucket
from moejax.static.decode import MIN_PROMPT_BUCKET, PREFILL, DecodeOptions, pad_prompts


def trace_prefill_experts(params: Params, cfg: ModelConfig, token_ids: Sequence[int], *,
                          expert_impl: ExpertImpl = "auto") -> np.ndarray:
    """Top-k expert ids of every prompt token at every layer: [L, n, k] int32, for one
    prompt of n token ids (ids in descending router probability)."""
    ids = [int(t) for t in token_ids]
    if not ids:
        raise ValueError("token_ids is empty")
    if any(not 0 <= t < cfg.vocab_size for t in ids):
        raise ValueError(f"token ids must lie in [0, {cfg.vocab_size})")
    if len(ids) > cfg.max_context:
        raise ValueError(f"{len(ids)} tokens exceed the model's context ({cfg.max_context})")
    prompt_len = bucket(len(ids), MIN_PROMPT_BUCKET)
    spec = SequenceSpec(prompt=tuple(ids), max_new_tokens=1)
    tokens, lengths = pad_prompts([spec], prompt_len)
    samp = sampling.make_sampling_params([0.0], [1.0], [0])
    out = PREFILL(params, tokens, lengths, samp, cfg=cfg, opts=DecodeOptions(expert_impl),
                  cache_len=prompt_len)
    return np.asarray(out.experts)[:, 0, :len(ids)]


def expert_counts(expert_ids: np.ndarray, num_experts: int) -> np.ndarray:
    """Per-layer activation counts [L, E] of traced ids [L, n, k] (each token counts once
    for each of its k experts)."""
    ids = np.asarray(expert_ids)
    counts = np.zeros((ids.shape[0], num_experts), np.int64)
    for layer in range(ids.shape[0]):
        counts[layer] = np.bincount(ids[layer].reshape(-1), minlength=num_experts)
    return counts
