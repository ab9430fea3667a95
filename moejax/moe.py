"""The MoE layer in stages: route -> permute (sort by expert) -> expert compute
(grouped GEMM) -> unpermute + weighted combine.

Every stage is a pure function of arrays so that backends can reuse the ones
they do not change. Shapes: T tokens, d hidden, E experts, k experts per token,
f expert intermediate size, M = T·k routed rows.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable
from typing import Literal

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from kernels_pallas import gmm as pallas_gmm
from kernels_pallas import gmm_fp8 as pallas_gmm_fp8
from moejax import grouped_gemm as gmm_lib
from moejax.expert_views import StackLayer, layer_array
from moejax.fp8_experts import Fp8Experts, any_fp8

ExpertImpl = Literal["auto", "fused_tiles", "pallas", "gmm", "ragged_dot", "dense", "blocks"]
EXPERT_IMPLS = ("auto", "fused_tiles", "pallas", "gmm", "ragged_dot", "dense", "blocks")


@typing.no_type_check   # a pytree: JAX rebuilds it with placeholder leaves
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Routing:
    """Top-k routing of T tokens.

    weights: [T, k] float32 combine weights; experts: [T, k] int32 expert ids;
    probs: [T, E] float32 router probabilities over every expert (what a balance loss
    or a routing estimator reads; XLA drops it where nothing does), or None.
    """

    weights: jax.Array
    experts: jax.Array
    probs: jax.Array | None = None


@typing.no_type_check   # a pytree: JAX rebuilds it with placeholder leaves
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Permutation:
    """Routed rows sorted by expert.

    x_sorted: [M, d] token rows, grouped by expert (invalid tokens at the end);
    order: [M] row of the flat [T·k] routing each sorted row came from;
    group_sizes: [E] int32 rows per expert (invalid tokens are counted in none).
    """

    x_sorted: jax.Array
    order: jax.Array
    group_sizes: jax.Array


def route(x: Float[Array, "T d"], router_w: Float[Array, "d E"], k: int,
          norm_topk_prob: bool) -> Routing:
    """Softmax router: x [T, d] @ router_w [d, E] -> top-k experts and weights.

    Probabilities are computed in float32 over all E experts, as in the reference
    implementations; with ``norm_topk_prob`` the k selected ones are renormalised
    to sum to 1 (Mixtral's softmax-over-top-k logits is the same function).
    """
    logits = jnp.dot(x, router_w.astype(x.dtype), preferred_element_type=jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    weights, experts = jax.lax.top_k(probs, k)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return Routing(weights=weights, experts=experts.astype(jnp.int32), probs=probs)


def route_scored(x: Float[Array, "T d"], router_w: Float[Array, "d E"], k: int, *,
                 norm_topk_prob: bool, scoring: str = "softmax",
                 choice_bias: Float[Array, "E"] | None = None, n_group: int = 1,
                 topk_group: int = 1, group_score: str = "max",
                 scaling: float = 1.0, logit_bias: Float[Array, "E"] | None = None) -> Routing:
    """The general router of the supported families (``route`` is its softmax case).

    ``scoring``: "softmax" over the E logits, or "sigmoid" per expert (DeepSeek-V3).
    ``choice_bias`` [E] is added to the scores for choosing the experts only; the combine
    weights are the unbiased scores (DeepSeek-V3's e_score_correction_bias). With
    ``n_group`` > 1 the E experts form n_group equal groups, each scored by its best
    expert ("max", DeepSeek-V2) or the sum of its two best ("top2_sum", V3), and the k
    experts are chosen from the ``topk_group`` best groups only. ``norm_topk_prob``
    renormalises the k weights to sum to 1, then they are multiplied by ``scaling``
    (routed_scaling_factor). ``probs`` holds the scores (what a balance statistic reads).
    ``logit_bias`` [E] is added to the logits before scoring (GPT-OSS's router bias; its
    softmax over the top-k logits is softmax + top-k + renormalise).
    """
    logits = jnp.dot(x, router_w.astype(x.dtype), preferred_element_type=jnp.float32)
    if logit_bias is not None:
        logits = logits + logit_bias.astype(jnp.float32)
    if scoring == "softmax":
        scores = jax.nn.softmax(logits, axis=-1)
    elif scoring == "sigmoid":
        scores = jax.nn.sigmoid(logits)
    else:
        raise ValueError(f"unknown router scoring {scoring!r}")
    choice = scores if choice_bias is None else scores + choice_bias.astype(jnp.float32)
    if n_group > 1:
        t, e = choice.shape
        grouped = choice.reshape(t, n_group, e // n_group)
        if group_score == "top2_sum":
            group = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)
        else:
            group = jnp.max(grouped, axis=-1)
        _, best = jax.lax.top_k(group, topk_group)
        keep = jnp.zeros((t, n_group), bool).at[jnp.arange(t)[:, None], best].set(True)
        # Experts of the other groups can never be chosen (-inf; V2 masks its softmax
        # scores to 0, which picks the same experts since every kept score is > 0).
        choice = jnp.where(jnp.repeat(keep, e // n_group, axis=1), choice, -jnp.inf)
    _, experts = jax.lax.top_k(choice, k)
    return gated_routing(scores, experts, norm_topk_prob=norm_topk_prob, scoring=scoring,
                         scaling=scaling)


def gated_routing(scores: Float[Array, "T E"], experts: Int[Array, "T k"], *,
                  norm_topk_prob: bool, scoring: str, scaling: float) -> Routing:
    """The routing of the chosen ``experts``: their ``scores`` as gate weights,
    renormalised over the k (``norm_topk_prob``) and scaled (``scaling``: the routed
    scaling factor); ``probs`` are the scores."""
    weights = jnp.take_along_axis(scores, experts, axis=1)
    if norm_topk_prob:
        denominator = jnp.sum(weights, axis=-1, keepdims=True)
        if scoring == "sigmoid":
            denominator = denominator + 1e-20      # as DeepSeek-V3 (sigmoid sums may be tiny)
        weights = weights / denominator
    if scaling != 1.0:
        weights = weights * scaling
    return Routing(weights=weights, experts=experts.astype(jnp.int32), probs=scores)


def permute(x: Float[Array, "T d"], routing: Routing, num_experts: int,
            valid: Bool[Array, "T"] | None = None) -> Permutation:
    """Sort the T·k routed rows by expert.

    ``valid`` [T] bool marks real tokens; padding tokens get the sentinel expert
    id E, sort after every real row and are counted in no group, so the expert
    compute never touches them.
    """
    with jax.named_scope("permute"):
        t, k = routing.experts.shape
        flat_experts = routing.experts.reshape(-1)
        if valid is not None:
            flat_experts = jnp.where(jnp.repeat(valid, k), flat_experts, num_experts)
        order = jnp.argsort(flat_experts, stable=True).astype(jnp.int32)
        x_sorted = jnp.take(x, order // k, axis=0)
        group_sizes = jnp.bincount(flat_experts, length=num_experts + 1)[:num_experts]
    return Permutation(x_sorted=x_sorted, order=order, group_sizes=group_sizes.astype(jnp.int32))


@dataclasses.dataclass(frozen=True)
class ClampedSwiGLU:
    """GPT-OSS's expert activation: g = min(gate, limit), u = clip(up, -limit, limit),
    hidden = (u + 1) · g · sigmoid(alpha · g)."""

    alpha: float = 1.702
    limit: float = 7.0

    def __call__(self, gate: jax.Array, up: jax.Array) -> jax.Array:
        g = jnp.minimum(gate, self.limit)
        u = jnp.clip(up, -self.limit, self.limit)
        return (u + 1.0) * g * jax.nn.sigmoid(self.alpha * g)


def expert_activation_of(cfg) -> "ClampedSwiGLU | None":
    """The family's expert activation when it is not plain SwiGLU (None: silu SwiGLU)."""
    if getattr(cfg, "swiglu_limit", None) is None:
        return None
    return ClampedSwiGLU(alpha=float(cfg.swiglu_alpha), limit=float(cfg.swiglu_limit))


# The implementations that take expert biases and another activation.
BIASED_IMPLS = ("gmm", "ragged_dot", "dense")
# The implementations that take expert weights kept in FP8 (``weights_dtype="fp8"``),
# dequantizing one expert's matrix (or one weight tile, ``pallas``) where they read it.
# ``ragged_dot`` and ``blocks`` take whole stacks (``[E, d, f]``, or gathered per block):
# fed FP8 they would need the layer dequantized up front, the copy FP8 keeping avoids.
FP8_IMPLS = ("auto", "fused_tiles", "gmm", "pallas", "dense")


def _biased_experts(x: jax.Array, sizes: jax.Array, w_gate: jax.Array | StackLayer,
                    w_up: jax.Array | StackLayer, w_down: jax.Array | StackLayer,
                    biases: dict | None, activation, impl: str,
                    tile_rows) -> jax.Array:
    """Experts with per-expert biases (gathered per row from the group sizes) and/or a
    non-silu activation, on the grouped matmuls of ``impl``; padding rows stay zero."""
    num_experts, rows = w_gate.shape[0], x.shape[0]
    ids = gmm_lib.group_ids(sizes, rows)                    # E: a row of no group
    real = ids < num_experts
    row_expert = jnp.minimum(ids, num_experts - 1)
    if impl == "dense":
        one_hot = jax.nn.one_hot(ids, num_experts, dtype=jnp.float32)

        def matmul(lhs, rhs):
            # The layer as one array (a view's layer copied out: this path is never chosen
            # automatically; "auto" picks gmm's tiles).
            out = jnp.einsum("md,edf,me->mf", lhs, layer_array(rhs).astype(lhs.dtype),
                             one_hot.astype(lhs.dtype),
                             preferred_element_type=jnp.float32)
            return out.astype(lhs.dtype)
    elif impl == "gmm":
        def matmul(lhs, rhs):
            return gmm_lib.gmm(lhs, rhs, sizes, tile_rows=tile_rows)
    else:
        def matmul(lhs, rhs):
            return gmm_lib.ragged_dot_gmm(lhs, rhs, sizes)

    def bias(name: str) -> jax.Array | float:
        if biases is None or name not in biases:
            return 0.0
        return jnp.take(biases[name], row_expert, axis=0).astype(jnp.float32)

    gate = matmul(x, w_gate).astype(jnp.float32) + bias("b_gate")
    up = matmul(x, w_up).astype(jnp.float32) + bias("b_up")
    hidden = jax.nn.silu(gate) * up if activation is None else activation(gate, up)
    out = matmul(hidden.astype(x.dtype), w_down).astype(jnp.float32) + bias("b_down")
    return jnp.where(real[:, None], out, 0.0).astype(x.dtype)


def expert_compute(perm: Permutation, w_gate: Float[Array, "E d f"] | StackLayer | Fp8Experts,
                   w_up: Float[Array, "E d f"] | StackLayer | Fp8Experts,
                   w_down: Float[Array, "E f d"] | StackLayer | Fp8Experts,
                   impl: ExpertImpl = "auto",
                   tile_rows: int | tuple[int, int] | None = None, *,
                   biases: dict | None = None, activation: ClampedSwiGLU | None = None
                   ) -> Float[Array, "M d"]:
    """SwiGLU experts on sorted rows: y = (silu(x·W_gate) * (x·W_up)) · W_down.

    x_sorted [M, d]; w_gate, w_up [E, d, f]; w_down [E, f, d] -> [M, d]. Rows
    beyond sum(group_sizes) come back as zeros. ``biases`` (b_gate / b_up [E, f], b_down
    [E, d]) and ``activation`` (:class:`ClampedSwiGLU`): GPT-OSS's experts, computed by
    the implementations of :data:`BIASED_IMPLS` ("auto" picks "gmm"); the others refuse.
    A weight may be one layer of the stacked ``[L, E, ...]`` read in place
    (:class:`moejax.expert_views.StackLayer`, and FP8 views): every path reads it where
    it lies except ``ragged_dot`` and the biased ``dense``, which copy the layer out.
    Weights kept in FP8 (:class:`moejax.fp8_experts.Fp8Experts`): the implementations of
    :data:`FP8_IMPLS`, without biases; the others refuse.
    """
    with jax.named_scope("experts"):     # labels the ops for profile attribution
        return _expert_compute(perm, w_gate, w_up, w_down, impl, tile_rows, biases, activation)


def _expert_compute(perm: Permutation, w_gate: jax.Array | StackLayer | Fp8Experts,
                    w_up: jax.Array | StackLayer | Fp8Experts, w_down: jax.Array | StackLayer | Fp8Experts,
                    impl: ExpertImpl, tile_rows: int | tuple[int, int] | None,
                    biases: dict | None, activation: ClampedSwiGLU | None) -> jax.Array:
    """:func:`expert_compute`'s body (outside its named scope)."""
    x, sizes = perm.x_sorted, perm.group_sizes
    if any_fp8(w_gate, w_up, w_down):
        return _fp8_experts(x, sizes, w_gate, w_up, w_down, impl, tile_rows, biases, activation)
    if biases or activation is not None:
        if impl == "auto":
            impl = "gmm"
        if impl not in BIASED_IMPLS:
            raise ValueError(f"expert implementation {impl!r} does not compute expert biases "
                             f"or the clamped SwiGLU (GPT-OSS); use one of {BIASED_IMPLS} "
                             "or auto")
        return _biased_experts(x, sizes, w_gate, w_up, w_down, biases, activation, impl,
                               tile_rows)
    if impl == "auto":
        impl = gmm_lib.choose_expert_impl(x.shape[1], w_gate.shape[2], rows=x.shape[0],
                                          num_experts=w_gate.shape[0])
    kernel = EXPERT_KERNELS.get(impl)
    if kernel is None:
        raise ValueError(f"unknown expert implementation {impl!r}; choose one of {EXPERT_IMPLS}")
    return kernel(x, w_gate, w_up, w_down, sizes, tile_rows)


def _fp8_experts(x: jax.Array, sizes: jax.Array, w_gate: Fp8Experts, w_up: Fp8Experts,
                 w_down: Fp8Experts, impl: ExpertImpl, tile_rows, biases: dict | None,
                 activation: ClampedSwiGLU | None) -> jax.Array:
    """:func:`_expert_compute` on expert weights kept in FP8 (all three must be)."""
    if not all(isinstance(w, Fp8Experts) for w in (w_gate, w_up, w_down)):
        raise ValueError("w_gate, w_up and w_down must all be kept in FP8 or none")
    if biases or activation is not None:
        raise ValueError("expert weights kept in FP8 (weights_dtype='fp8') are computed "
                         "without expert biases or the clamped SwiGLU (GPT-OSS)")
    if impl not in FP8_IMPLS:
        raise ValueError(f"expert implementation {impl!r} does not take expert weights kept "
                         f"in FP8 (weights_dtype='fp8'); use one of {FP8_IMPLS}")
    d, f = x.shape[1], w_gate.shape[2]
    if impl == "auto":
        impl = gmm_lib.choose_expert_impl(d, f, rows=x.shape[0], num_experts=w_gate.shape[0])
        if impl not in FP8_IMPLS:
            impl = "fused_tiles"
        if impl == "pallas" and not (pallas_gmm_fp8.fits_gpu(d, f, w_gate.block)
                                     and pallas_gmm_fp8.fits_gpu(f, d, w_down.block)):
            impl = "fused_tiles"      # the FP8 kernel's tiles cannot align with the blocks
    if impl == "pallas":
        # A layer of the stack is read in place through the kernels' index maps.
        hidden = pallas_gmm_fp8.gmm_swiglu_fp8(x, w_gate.values, w_gate.scale, w_up.values,
                                               w_up.scale, sizes, block=w_gate.block,
                                               layer=w_gate.layer)
        return pallas_gmm_fp8.gmm_fp8(hidden, w_down.values, w_down.scale, sizes,
                                      block=w_down.block, layer=w_down.layer)
    return EXPERT_KERNELS[impl](x, w_gate, w_up, w_down, sizes, tile_rows)


# ------------------------------------------------------------------ the experts kernels
class ExpertKernel(typing.Protocol):
    """A grouped SwiGLU over rows sorted by expert: x [M, d] in groups of ``sizes`` [E]
    rows, weights w_gate, w_up [E, d, f] and w_down [E, f, d] -> [M, d] (rows past the
    groups: zeros). ``tile_rows``: the row tile, for the kernels that take one."""

    def __call__(self, x: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
                 sizes: jax.Array, tile_rows: int | tuple[int, int] | None) -> jax.Array: ...


def _swiglu_matmuls(matmul: Callable[..., jax.Array], x: jax.Array,
                    w_gate: jax.Array | StackLayer | Fp8Experts, w_up: jax.Array | StackLayer | Fp8Experts,
                    w_down: jax.Array | StackLayer | Fp8Experts, **kwargs: typing.Any) -> jax.Array:
    """The SwiGLU as three grouped matmuls ``matmul(lhs, rhs, sizes...)`` (f32 activation)."""
    gate = matmul(x, w_gate, **kwargs)
    up = matmul(x, w_up, **kwargs)
    hidden = (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(x.dtype)
    return matmul(hidden, w_down, **kwargs)


def _pallas_kernel(x, w_gate, w_up, w_down, sizes, tile_rows):
    if isinstance(w_gate, StackLayer):   # the layer index goes into the index maps
        layer = w_gate.layer
        w_gate, w_up, w_down = w_gate.stack, w_up.stack, w_down.stack
        return pallas_gmm.gmm(pallas_gmm.gmm_swiglu(x, w_gate, w_up, sizes, layer=layer),
                              w_down, sizes, layer=layer)
    return pallas_gmm.gmm(pallas_gmm.gmm_swiglu(x, w_gate, w_up, sizes), w_down, sizes)


def _fused_tiles_kernel(x, w_gate, w_up, w_down, sizes, tile_rows):
    return gmm_lib.grouped_swiglu_tiles(x, w_gate, w_up, w_down, sizes, tile_rows=tile_rows)


def _dense_kernel(x, w_gate, w_up, w_down, sizes, tile_rows):
    return gmm_lib.swiglu_dense(x, w_gate, w_up, w_down, sizes)


def _blocks_kernel(x, w_gate, w_up, w_down, sizes, tile_rows):
    return gmm_lib.swiglu_blocks(x, w_gate, w_up, w_down, sizes)


def _gmm_kernel(x, w_gate, w_up, w_down, sizes, tile_rows):
    return _swiglu_matmuls(lambda lhs, rhs: gmm_lib.gmm(lhs, rhs, sizes, tile_rows=tile_rows),
                           x, w_gate, w_up, w_down)


def _ragged_dot_kernel(x, w_gate, w_up, w_down, sizes, tile_rows):
    return _swiglu_matmuls(lambda lhs, rhs: gmm_lib.ragged_dot_gmm(lhs, rhs, sizes),
                           x, w_gate, w_up, w_down)


# Every name of EXPERT_IMPLS but "auto" (resolved per platform and shape first); a new
# kernel is one entry here (and its name in EXPERT_IMPLS), beside its reference and test.
EXPERT_KERNELS: dict[str, ExpertKernel] = {
    "fused_tiles": _fused_tiles_kernel, "pallas": _pallas_kernel, "gmm": _gmm_kernel,
    "ragged_dot": _ragged_dot_kernel, "dense": _dense_kernel, "blocks": _blocks_kernel}


def combine(y_sorted: Float[Array, "M d"], perm: Permutation, routing: Routing,
            valid: Bool[Array, "T"] | None = None) -> Float[Array, "T d"]:
    """Unsort the expert outputs [M, d] and sum each token's k rows with its weights -> [T, d]."""
    with jax.named_scope("permute"):     # the unpermute + combine: the permute's inverse
        inverse = jnp.argsort(perm.order).astype(jnp.int32)
        return weighted_sum(jnp.take(y_sorted, inverse, axis=0), routing, valid)


def weighted_sum(y_rows: Float[Array, "M d"], routing: Routing,
                 valid: Bool[Array, "T"] | None = None) -> Float[Array, "T d"]:
    """Each token's k expert outputs, in routing order (y_rows [T·k, d]: row t·k + j is
    token t's j-th expert), summed with its router weights in float32 -> [T, d].
    Invalid tokens weigh 0. Every dispatcher's finalize ends here."""
    t, k = routing.experts.shape
    weights = routing.weights
    if valid is not None:
        weights = jnp.where(valid[:, None], weights, 0.0)
    out = jnp.einsum("tkd,tk->td", y_rows.reshape(t, k, -1).astype(jnp.float32), weights)
    return out.astype(y_rows.dtype)
