"""Predictors of layer l+1's top-k experts from layer l, one code for runtime and study.

The runtime (``moejax.prefetch.runner``) calls :data:`PREDICT` between a layer's router
and its experts; the offline evaluation (:func:`predict_states`, the benchmark's recall)
calls the same :func:`predict_next` on replayed layer states.

Predictors (``r_l``: layer l's post-attention residual; ``Norm_{l+1}`` and
``router_{l+1}``: layer l+1's pre-MoE RMSNorm and router):

* ``router``    — router_{l+1}(Norm_{l+1}(r_l)): the seed's baseline;
* ``quasi``     — router_{l+1}(q_l), q_l = Norm_{l+1}(r_l + Σ_{e∈E_l} g_{l,e}·d_{l,e}) with the
  default vectors d (``moejax.prefetch.defaults``) and layer l's own top-k and gates;
* ``estimator`` — the trained network on q_l (``moejax.prefetch.estimator``);
* ``hybrid``    — the estimator at the layers its file lists (quasi's recall there is
  below the threshold, :func:`hybrid_layers`), quasi elsewhere;
* ``oracle``    — the true top-k (the runtime learns it only when the layer routes);
* ``layer``     — every expert of the next layer (the whole-layer window; copies only).

Floors, for recall only: ``random`` (k distinct experts, seeded), ``popularity`` (each
layer's k most chosen experts in calibration) and ``previous`` (the experts the same
request's previous token chose at that layer).

A prediction is a :class:`moejax.moe.Routing` (ids and weights), so the speculative mode
can compute with it as it is.

A population prior (issue 44: e.g. the expert frequencies of the ELDR cluster a decoder
serves, ``moejax.eldr.priors``) re-ranks a learned predictor's experts: with ``prior``
[L, E] (each layer's row normalised to sum 1) and weight w in [0, 1], layer l+1's top-k
are the k largest of (1 − w)·s / Σs + w·prior[l+1], s the predictor's scores over every
expert (the router's softmax, or sigmoid, scores; the estimator's softmax). The
predicted weights are the predictor's own scores at the chosen experts, renormalised and
scaled as the router does. w = 0 runs today's predictor unchanged (the prior is not
traced in: ``use_prior=False``); w = 1 predicts the prior's top-k for every token. The
mixed ranking is over all E experts (a group-limited router's group choice and a
choice bias do not enter it).
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from moejax import layers as layers_lib
from moejax import moe
from moejax.config import ModelConfig
from moejax.prefetch import estimator as estimator_lib

PREDICTORS = ("router", "quasi", "estimator", "hybrid", "oracle", "layer")
LEARNED = ("router", "quasi", "estimator", "hybrid")   # computed by predict_next
FLOORS = ("random", "popularity", "previous")
NEEDS_DEFAULTS = ("quasi", "estimator", "hybrid")
NEEDS_ESTIMATOR = ("estimator", "hybrid")
# Hybrid: the estimator predicts target layer j when quasi's recall@k at j (on the
# estimator's training requests) is below the threshold; by default the mean of
# quasi's recall over layers >= 1 (the model's own "low" layers: the early ones, where
# the seed sees the drift), or a fixed value given instead.
EVAL_TOKENS_PER_CHUNK = 8192


@typing.no_type_check   # a pytree: JAX rebuilds it with placeholder leaves
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PrefetchTables:
    """The arrays a predictor reads besides the model: default vectors [L, E, d]
    (zeros when unused), the estimator's params (a dict, empty when unused),
    ``use_estimator`` [L] bool: target layers the hybrid predicts with the estimator,
    ``prior`` [L, E] float32: the population prior, each row summing to 1 (zeros when
    unused) and ``prior_weight`` [] float32: its weight w (0 when unused)."""

    defaults: jax.Array
    estimator: dict[str, jax.Array]
    use_estimator: jax.Array
    prior: jax.Array
    prior_weight: jax.Array


def check_prior(prior: Any, weight: Any, cfg: ModelConfig) -> tuple[np.ndarray | None, float]:
    """(the prior [L, E] float64 with each layer's row normalised to sum 1, or None; the
    weight as a float), or a ValueError naming what is wrong: a weight that is not a
    number in [0, 1], a positive weight without a prior, a prior that is not a finite
    [num_layers, num_experts] array, has a negative entry or a layer summing to 0."""
    if isinstance(weight, (bool, np.bool_)) or not isinstance(weight, (int, float, np.integer,
                                                                       np.floating)) \
            or not math.isfinite(weight) or not 0 <= weight <= 1:
        raise ValueError(f"prefetch_prior_weight must be a number in [0, 1] (0: the predictor "
                         f"alone, 1: the prior alone), got {weight!r}")
    weight = float(weight)
    if prior is None:
        if weight > 0:
            raise ValueError(f"prefetch_prior_weight={weight} needs a prefetch_prior (an "
                             f"[L, E] expert-frequency array, e.g. moejax.eldr.priors)")
        return None, weight
    array = np.asarray(prior)
    shape = (cfg.num_layers, cfg.num_experts)
    if array.dtype.kind not in "fiu" or array.shape != shape:
        raise ValueError(f"prefetch_prior must be a numeric [num_layers, num_experts] = "
                         f"{list(shape)} array, got {array.dtype} of shape {array.shape}")
    array = array.astype(np.float64)
    if not np.isfinite(array).all():
        raise ValueError("prefetch_prior holds a NaN or an infinity")
    if (array < 0).any():
        layer, expert = (int(i) for i in np.argwhere(array < 0)[0])
        raise ValueError(f"prefetch_prior holds a negative value {float(array[layer, expert])!r} "
                         f"(layer {layer}, expert {expert}): it is a frequency")
    sums = array.sum(axis=1)
    if (sums <= 0).any():
        raise ValueError(f"prefetch_prior: layer {int(np.argmin(sums))} sums to 0; every "
                         f"layer's row must give some expert a positive weight")
    return array / sums[:, None], weight


def make_tables(cfg: ModelConfig, defaults: np.ndarray | None = None,
                estimator: dict[str, Any] | None = None,
                estimator_layers: tuple[int, ...] = (), device: Any = None,
                prior: np.ndarray | None = None, prior_weight: float = 0.0) -> PrefetchTables:
    """:class:`PrefetchTables` on ``device`` (absent parts as zeros / empty); ``prior``
    and ``prior_weight`` are checked and the prior normalised by :func:`check_prior`."""
    if defaults is None:
        defaults = np.zeros((cfg.num_layers, cfg.num_experts, cfg.hidden_size), np.float32)
    prior, prior_weight = check_prior(prior, prior_weight, cfg)
    if prior is None:
        prior = np.zeros((cfg.num_layers, cfg.num_experts))
    mask = np.zeros(cfg.num_layers, bool)
    mask[list(estimator_layers)] = True
    tables = PrefetchTables(defaults=np.asarray(defaults, np.float32),
                            estimator=dict(estimator or {}), use_estimator=mask,
                            prior=prior.astype(np.float32),
                            prior_weight=np.float32(prior_weight))
    return jax.device_put(tables, device)


def uses_prior(tables: PrefetchTables) -> bool:
    """Whether the tables' prior takes part in predictions (its weight is above 0): the
    ``use_prior`` of :data:`PREDICT`."""
    return float(np.asarray(tables.prior_weight)) > 0


def residual_state(residual: Float[Array, "T d"], norm_next: Float[Array, "d"],
                   eps: float) -> jax.Array:
    """Norm_{l+1}(r_l): the baseline's guess at layer l+1's router input."""
    return layers_lib.rms_norm(residual, norm_next, eps)


def quasi_state(residual: Float[Array, "T d"], experts: Int[Array, "T k"],
                weights: Float[Array, "T k"], defaults_l: Float[Array, "E d"],
                norm_next: Float[Array, "d"], eps: float) -> jax.Array:
    """q_l = Norm_{l+1}(r_l + Σ_j g_j·d_{l,e_j}) (in the residual's dtype; the sum in f32)."""
    default_out = jnp.einsum("tk,tkd->td", weights.astype(jnp.float32),
                             jnp.take(defaults_l, experts, axis=0).astype(jnp.float32))
    quasi = (residual.astype(jnp.float32) + default_out).astype(residual.dtype)
    return layers_lib.rms_norm(quasi, norm_next, eps)


def predict_next(kind: str, layer_params: dict[str, jax.Array], tables: PrefetchTables,
                 layer: Int[Array, ""], residual: Float[Array, "T d"],
                 experts: Int[Array, "T k"], weights: Float[Array, "T k"],
                 cfg: ModelConfig, use_prior: bool = False) -> moe.Routing:
    """Layer ``layer + 1``'s predicted routing from layer ``layer``'s residual and top-k
    (``layer_params``: the stacked layer params; experts may be absent). ``use_prior``:
    re-rank with the tables' prior (module docstring); False runs the predictor alone."""
    routing, scores = predict_with_scores(kind, layer_params, tables, layer, residual,
                                          experts, weights, cfg)
    if not use_prior:
        return routing
    prior_next = jax.lax.dynamic_index_in_dim(tables.prior, layer + 1, keepdims=False)
    return prior_routing(scores, prior_next, tables.prior_weight, cfg)


def predict_with_scores(kind: str, layer_params: dict[str, jax.Array], tables: PrefetchTables,
                        layer: Int[Array, ""], residual: Float[Array, "T d"],
                        experts: Int[Array, "T k"], weights: Float[Array, "T k"],
                        cfg: ModelConfig) -> tuple[moe.Routing, jax.Array]:
    """(the predictor's routing of layer ``layer + 1``, its scores [T, E] over every
    expert: the router's scores for router and quasi, the estimator's softmax where the
    estimator predicts)."""
    if kind not in LEARNED:
        raise ValueError(f"predict_next computes {LEARNED}, not {kind!r}")
    nxt = layers_lib.layer_slice({k: layer_params[k] for k in ("mlp_norm", "router",
                                                                "score_bias")
                                  if k in layer_params}, layer + 1)
    eps = cfg.rms_norm_eps
    if kind == "router":
        routing = layers_lib.route_layer(nxt, residual_state(residual, nxt["mlp_norm"], eps),
                                         cfg)
        return routing, routing.probs
    defaults_l = jax.lax.dynamic_index_in_dim(tables.defaults, layer, keepdims=False)
    q = quasi_state(residual, experts, weights, defaults_l, nxt["mlp_norm"], eps)
    quasi = layers_lib.route_layer(nxt, q, cfg)
    if kind == "quasi":
        return quasi, quasi.probs
    rows = jnp.full(q.shape[:1], layer, jnp.int32)
    est_scores = jax.nn.softmax(estimator_lib.logits(tables.estimator, q, rows), axis=-1)
    est_weights, est_experts = estimator_lib.topk_of_probs(
        est_scores, cfg.num_experts_per_tok, cfg.norm_topk_prob)
    if kind == "hybrid":
        use = tables.use_estimator[layer + 1]
        est_weights = jnp.where(use, est_weights, quasi.weights)
        est_experts = jnp.where(use, est_experts, quasi.experts)
        est_scores = jnp.where(use, est_scores, quasi.probs)
    return moe.Routing(weights=est_weights, experts=est_experts), est_scores


def prior_routing(scores: Float[Array, "T E"], prior: Float[Array, "E"],
                  weight: Float[Array, ""], cfg: ModelConfig) -> moe.Routing:
    """The top-k of (1 − w)·scores / Σ scores + w·prior per token; the weights are the
    scores at the chosen experts, renormalised (``norm_topk_prob``) and scaled
    (``routed_scaling_factor``) as ``moejax.moe.route_scored`` does."""
    scores = scores.astype(jnp.float32)
    total = jnp.sum(scores, axis=-1, keepdims=True)
    shares = scores / jnp.where(total > 0, total, 1.0)
    weight = weight.astype(jnp.float32)
    mixed = (1.0 - weight) * shares + weight * prior.astype(jnp.float32)[None, :]
    _, chosen = jax.lax.top_k(mixed, cfg.num_experts_per_tok)
    return moe.gated_routing(scores, chosen, norm_topk_prob=cfg.norm_topk_prob,
                             scoring=cfg.router_scoring, scaling=cfg.routed_scaling_factor)


def _predict_program(layer_params: dict[str, jax.Array], tables: PrefetchTables,
                     layer: Int[Array, ""], residual: jax.Array, experts: jax.Array,
                     weights: jax.Array, *, kind: str, cfg: ModelConfig,
                     use_prior: bool = False) -> tuple[jax.Array, jax.Array]:
    routing = predict_next(kind, layer_params, tables, layer, residual, experts, weights, cfg,
                           use_prior)
    return routing.weights, routing.experts


# One compile per predictor and shape: the layer index is an argument.
PREDICT = jax.jit(_predict_program, static_argnames=("kind", "cfg", "use_prior"))


# ------------------------------------------------------------------ offline, on states
def predict_states(kind: str, cfg: ModelConfig, layer_params: dict[str, Any],
                   tables: PrefetchTables, residual: Float[np.ndarray, "L T d"],
                   experts: Int[np.ndarray, "L T k"], weights: Float[np.ndarray, "L T k"]
                   ) -> np.ndarray:
    """Predicted top-k ids [L, T, k] of every layer j >= 1 from layer j - 1 (row 0 is
    layer 0's true top-k: no predictor runs there) for replayed states; the tables'
    prior takes part when its weight is above 0 (:func:`uses_prior`)."""
    use_prior = uses_prior(tables)
    out = np.array(experts, copy=True)
    for layer in range(cfg.num_layers - 1):
        for start in range(0, residual.shape[1], EVAL_TOKENS_PER_CHUNK):
            part = slice(start, start + EVAL_TOKENS_PER_CHUNK)
            _, ids = PREDICT(layer_params, tables, np.int32(layer), residual[layer, part],
                             experts[layer, part], weights[layer, part], kind=kind, cfg=cfg,
                             use_prior=use_prior)
            out[layer + 1, part] = np.asarray(ids)
    return out


def floor_predictions(kind: str, experts: Int[np.ndarray, "L T k"], request: Int[np.ndarray, "T"],
                      counts: Int[np.ndarray, "L E"] | None = None, seed: int = 0) -> np.ndarray:
    """The floors' top-k [L, T, k] (layer 0 rows: the true ids, as for every predictor).

    ``previous`` needs tokens in sequence order per request (``request`` [T]); a
    request's first token has no previous token: its prediction is -1 (a miss).
    ``popularity`` needs the calibration ``counts`` [L, E]."""
    num_layers, tokens, k = experts.shape
    if kind == "random":
        rng = np.random.default_rng(seed)
        num_experts = int(counts.shape[1]) if counts is not None else int(experts.max()) + 1
        out = np.argsort(rng.random((num_layers, tokens, num_experts)), axis=-1)[..., :k]
    elif kind == "popularity":
        if counts is None:
            raise ValueError("the popularity floor needs calibration counts")
        top = np.argsort(-counts, axis=-1, kind="stable")[:, :k]
        out = np.broadcast_to(top[:, None, :], experts.shape).copy()
    elif kind == "previous":
        out = np.full_like(experts, -1)
        same = np.concatenate([[False], request[1:] == request[:-1]])
        out[:, same] = experts[:, np.flatnonzero(same) - 1]
    else:
        raise ValueError(f"unknown floor {kind!r}; choose one of {FLOORS}")
    out = out.astype(experts.dtype)
    out[0] = experts[0]
    return out


def recall_at_k(predicted: Int[np.ndarray, "L T k"], true: Int[np.ndarray, "L T k"]
                ) -> np.ndarray:
    """Per layer, the mean over tokens of |predicted ∩ true| / k -> [L]."""
    hits = (predicted[..., :, None] == true[..., None, :]).any(-1).sum(-1)
    return hits.mean(axis=1) / true.shape[-1]


def hybrid_layers(quasi_recall: np.ndarray, threshold: float | None = None
                  ) -> tuple[tuple[int, ...], float]:
    """(the target layers >= 1 whose quasi recall@k is below ``threshold``, the threshold
    used: by default the mean of ``quasi_recall[1:]``)."""
    if threshold is None:
        threshold = float(np.mean(quasi_recall[1:]))
    layers = tuple(int(j) for j in range(1, len(quasi_recall)) if quasi_recall[j] < threshold)
    return layers, float(threshold)
