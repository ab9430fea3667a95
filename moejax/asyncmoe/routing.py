"""Routing sources of the AsyncMoE simulator: recorded top-k (traces, or a real run's)
and synthetic exponential skew (uniform at skew 0)."""

from __future__ import annotations

import collections
from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np

from moejax.asyncmoe.checks import int_at_least, nonnegative

ROUTING_CHUNK_STEPS = 64
"""Decode steps of one request and block whose synthetic routing is drawn at once."""
ROUTING_CACHE_CHUNKS = 1 << 16
"""Drawn chunks :class:`SkewedRouting` keeps (least recently used dropped; a dropped
chunk is redrawn identically when asked again)."""


class RoutingSource(Protocol):
    """Where each token goes: the top-k expert ids and gate weights of a request's
    token at a decode step and block. Must be a pure function of its arguments (both
    simulations and repeated runs see the same routing)."""

    num_experts: int
    top_k: int

    def topk(self, request_id: int, step: int, layer: int) -> tuple[np.ndarray, np.ndarray]: ...


class TraceRouting:
    """Recorded routing: per request, ``ids[request]`` [L, steps, k] expert ids (distinct
    per token) and ``weights[request]`` [L, steps, k] gate weights."""

    def __init__(self, ids: Mapping[int, Any], weights: Mapping[int, Any],
                 num_experts: int) -> None:
        self.num_experts = int_at_least("num_experts", num_experts, 1)
        if set(ids) != set(weights):
            raise ValueError(f"TraceRouting: ids and weights cover different requests: "
                             f"{sorted(set(ids) ^ set(weights))}")
        if not ids:
            raise ValueError("TraceRouting: no requests")
        self._ids: dict[int, np.ndarray] = {}
        self._weights: dict[int, np.ndarray] = {}
        top_k = None
        for request in sorted(ids):
            rid = np.array(ids[request])
            w = np.array(weights[request], dtype=np.float64)
            where = f"TraceRouting request {request}"
            if rid.ndim != 3 or w.shape != rid.shape or min(rid.shape) < 1:
                raise ValueError(f"{where}: ids {rid.shape} and weights {w.shape} must both "
                                 f"be [layers, steps, k] with each >= 1")
            if not np.issubdtype(rid.dtype, np.integer) or rid.min() < 0 \
                    or rid.max() >= self.num_experts:
                raise ValueError(f"{where}: ids must be expert ids in [0, "
                                 f"{self.num_experts}), got dtype {rid.dtype}, range "
                                 f"[{rid.min()}, {rid.max()}]")
            if np.any(np.diff(np.sort(rid, axis=-1), axis=-1) == 0):
                raise ValueError(f"{where}: a token repeats an expert in its top-k")
            if not np.all(np.isfinite(w)):
                raise ValueError(f"{where}: weights must be finite")
            if top_k is not None and rid.shape[2] != top_k:
                raise ValueError(f"{where}: k = {rid.shape[2]}, other requests have {top_k}")
            top_k = rid.shape[2]
            rid.setflags(write=False)
            w.setflags(write=False)
            self._ids[int(request)] = rid
            self._weights[int(request)] = w
        self.top_k = int(top_k)

    def topk(self, request_id: int, step: int, layer: int) -> tuple[np.ndarray, np.ndarray]:
        ids = self._ids.get(request_id)
        if ids is None:
            raise ValueError(f"TraceRouting has no request {request_id}")
        if not (0 <= layer < ids.shape[0] and 0 <= step < ids.shape[1]):
            raise ValueError(f"TraceRouting request {request_id}: (step {step}, layer "
                             f"{layer}) outside its {ids.shape[1]} steps x {ids.shape[0]} "
                             f"layers")
        return ids[layer, step], self._weights[request_id][layer, step]


class SkewedRouting:
    """Synthetic routing with the seed's exponential load skew (§5): expert e has
    popularity p_e ∝ exp(−skew · rank_e), rank_e its position in one permutation drawn
    from ``seed`` (the same for every block); a token draws its k distinct experts
    without replacement from p (successive sampling, drawn as Gumbel-top-k: the k largest
    log p_e + Gumbel noise). ``skew`` = 0 is uniform routing (the control). Gate weights:
    the drawn experts' p, normalized to sum 1.

    The noise of (request, layer) comes in chunks of :data:`ROUTING_CHUNK_STEPS` steps,
    chunk c from a generator seeded by (seed, request, layer, c), so a token's experts
    depend on (seed, request, step, layer) only, never on call order or on which chunks
    are still cached (:data:`ROUTING_CACHE_CHUNKS`)."""

    def __init__(self, num_experts: int, k: int, skew: float, seed: int) -> None:
        self.num_experts = int_at_least("num_experts", num_experts, 1)
        self.top_k = int_at_least("k", k, 1)
        if self.top_k > self.num_experts:
            raise ValueError(f"SkewedRouting: k = {k} exceeds the {num_experts} experts")
        self.skew = nonnegative("skew", skew)
        self.seed = int_at_least("seed", seed, 0)
        order = np.random.default_rng(self.seed).permutation(self.num_experts)
        rank = np.empty(self.num_experts, dtype=np.int64)
        rank[order] = np.arange(self.num_experts)
        popularity = np.exp(-self.skew * rank)
        self.popularity = popularity / popularity.sum()
        self.popularity.setflags(write=False)
        self._log_popularity = -self.skew * rank
        self._chunks: collections.OrderedDict[tuple[int, int, int],
                                              tuple[np.ndarray, np.ndarray]] = \
            collections.OrderedDict()

    def topk(self, request_id: int, step: int, layer: int) -> tuple[np.ndarray, np.ndarray]:
        request_id = int_at_least("request_id", request_id, 0)
        step = int_at_least("step", step, 0)
        layer = int_at_least("layer", layer, 0)
        chunk, row = divmod(step, ROUTING_CHUNK_STEPS)
        key = (request_id, layer, chunk)
        if key in self._chunks:
            self._chunks.move_to_end(key)
        else:
            if len(self._chunks) >= ROUTING_CACHE_CHUNKS:
                self._chunks.popitem(last=False)
            rng = np.random.default_rng((self.seed, request_id, layer, chunk))
            keys = self._log_popularity + rng.gumbel(
                size=(ROUTING_CHUNK_STEPS, self.num_experts))
            ids = np.argsort(-keys, axis=1, kind="stable")[:, :self.top_k]
            weights = self.popularity[ids]
            weights = weights / weights.sum(axis=1, keepdims=True)
            ids.setflags(write=False)
            weights.setflags(write=False)
            self._chunks[key] = (ids, weights)
        ids, weights = self._chunks[key]
        return ids[row], weights[row]
