"""The engine's sequence types: what a generation request asks for (:class:`SequenceSpec`,
token ids and sampling) and what it gets (:class:`SequenceOutput`, tokens, why it stopped,
traced experts). Every generation runtime takes and returns these: the continuous
scheduler, the decoders, the static ``DecodeEngine`` and the AsyncMoE runtime.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class SequenceSpec:
    """One sequence to generate: ``prompt`` token ids (non-empty, in the vocabulary;
    prompt + max_new_tokens <= the cache the engine may build)."""

    prompt: tuple[int, ...]
    max_new_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: frozenset[int] = frozenset()
    # A label of the request's domain: read only by the domain-oracle decode routing
    # (moejax.core.decoders); never changes a token.
    domain: str | None = None


@dataclasses.dataclass
class SequenceOutput:
    """Generated ``token_ids`` (a stop token that ended generation included), the
    ``finish_reason`` ("stop" or "length"), and expert ids when traced:
    ``prefill_experts`` [L, prompt_len, k] (every prompt token), ``decode_experts``
    [L, len(token_ids) - 1, k] (every generated token that was fed back; the last one
    never runs through the model), and from the paged runtime also their gate weights
    (``*_weights``, same shapes, f32) and, when asked, router inputs (``*_router_inputs``
    [L, n, d]). ``error``: set when the runtime failed the sequence."""

    token_ids: list[int]
    finish_reason: str
    prefill_experts: np.ndarray | None = None
    decode_experts: np.ndarray | None = None
    prefill_weights: np.ndarray | None = None
    decode_weights: np.ndarray | None = None
    prefill_router_inputs: np.ndarray | None = None
    decode_router_inputs: np.ndarray | None = None
    error: str | None = None
