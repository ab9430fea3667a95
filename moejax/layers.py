"""The decoder layer, written once, and the one loop that runs a stack of them.

A pre-norm decoder layer is ``x + attention(norm(x))`` then ``x + moe(norm(x))``. It
has two seams, and every execution path (scoring, prefix cache, generation prefill
and decode, every backend, calibration, training) is a choice of the two:

* an **attention kind** (``moejax.attention_kinds``): where keys and values come
  from and go to — packed causal blocks (scoring), packed blocks with a pooled
  prefix context (prefix cache), a fresh KV cache filled from a prompt, or one token
  per row over its KV-cache slots (decode);
* an **MoE dispatcher** (``moejax.dispatch``): where the expert weights are and how
  the routed tokens reach them (route → prepare → experts → finalize).

:func:`run_layers` is the fused driver (one ``fori_loop`` over the stacked layer
params, indexing them in place: one layer is compiled, whatever L is), and
:func:`layer` the single-layer entry a host-side driver calls layer by layer (the
offload backend does, and so will speculative prefetch, which acts between a
layer's routing and its experts: hence the ``routing`` override).

Layer params are the stacked dict of ``moejax.param_layout`` (``[L, ...]``); the
expert weights may be absent from it (a dispatcher that holds them elsewhere).
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from moejax import mla as mla_lib
from moejax.attention import MAX_WINDOW
from moejax import moe
from moejax.config import ModelConfig
from moejax.norms import rms_norm  # noqa: F401  (re-exported: the layer's norm)

LayerParams = Mapping[str, jax.Array]
# Per-layer observation of the fused loop: (layer, routing, valid, router input) -> a
# pytree that is stacked on a leading [L] axis (e.g. the top-k ids for expert tracing).
Observer = Callable[[jax.Array, moe.Routing, "jax.Array | None", jax.Array], Any]


# --------------------------------------------------------------------- stages
def rope(x: Float[Array, "n heads h"], positions: Int[Array, "n"],
         theta: float, yarn: "mla_lib.YarnScaling | None" = None) -> Float[Array, "n heads h"]:
    """Rotary embedding (rotate-half convention) on x [n, heads, h] at positions [n];
    ``yarn``: YaRN frequencies, cos/sin times its attention factor (GPT-OSS)."""
    half = x.shape[-1] // 2
    if yarn is None:
        inv_freq = 1.0 / (theta ** (jnp.arange(half, dtype=jnp.float32) / half))
        factor = None
    else:
        inv_freq, factor = mla_lib.yarn_inv_freq_and_scale(x.shape[-1], theta, yarn)
        inv_freq = jnp.asarray(inv_freq)
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
    if factor is not None:
        cos, sin = cos * factor, sin * factor
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[..., :half], x32[..., half:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def _projection(p: LayerParams, h_in: Float[Array, "n d"], weight: str, bias: str,
                cfg: ModelConfig) -> Float[Array, "n out"]:
    """h_in @ p[weight] (+ p[bias] where the family has it), clipped where it clips."""
    out = h_in @ p[weight].astype(h_in.dtype)
    if bias in p:
        out = out + p[bias].astype(out.dtype)
    if cfg.clip_qkv is not None:
        out = jnp.clip(out, -cfg.clip_qkv, cfg.clip_qkv)
    return out


def _heads(flat: Float[Array, "n out"], norm: str, p: LayerParams,
           cfg: ModelConfig) -> Float[Array, "n heads h"]:
    """[n, heads·h] -> [n, heads, h], with the family's q/k norm (per head, or over all
    heads before the split: OLMoE)."""
    if cfg.qk_norm and cfg.qk_norm_over_heads:
        flat = rms_norm(flat, p[norm], cfg.rms_norm_eps)
    out = flat.reshape(flat.shape[0], -1, cfg.head_dim)
    if cfg.qk_norm and not cfg.qk_norm_over_heads:
        out = rms_norm(out, p[norm], cfg.rms_norm_eps)
    return out


def project_q(p: LayerParams, h_in: Float[Array, "n d"], positions: Int[Array, "n"],
              cfg: ModelConfig) -> Float[Array, "n n_q hq"]:
    """Normed input [n, d] -> queries [n, n_q, h] (bias, clip, q-norm as the family has
    them, then RoPE; MLA: ``moejax.mla.mla_queries``). The head count comes from the
    weights, so a tensor-parallel shard's local heads work too."""
    if cfg.mla is not None:
        return mla_lib.mla_queries(p, h_in, positions, cfg.mla)
    q = _heads(_projection(p, h_in, "wq", "bq", cfg), "q_norm", p, cfg)
    return rope(q, positions, cfg.rope_theta, cfg.rope_yarn)


def project_kv(p: LayerParams, h_in: Float[Array, "n d"], positions: Int[Array, "n"],
               cfg: ModelConfig) -> tuple[Float[Array, "n s hk"], Float[Array, "n s hv"]]:
    """Normed input [n, d] -> what a KV cache stores per token: keys, values [n, n_kv, h]
    (bias, clip, k-norm, RoPE on keys), or for MLA the normed latent [n, 1, r] and the
    roped shared key [n, 1, rope] (:func:`expand_kv` turns either into attention keys
    and values)."""
    if cfg.mla is not None:
        return mla_lib.mla_latent(p, h_in, positions, cfg.mla)
    k = _heads(_projection(p, h_in, "wk", "bk", cfg), "k_norm", p, cfg)
    v = _projection(p, h_in, "wv", "bv", cfg).reshape(h_in.shape[0], -1, cfg.head_dim)
    return rope(k, positions, cfg.rope_theta, cfg.rope_yarn), v


def expand_kv(p: LayerParams, keys: Float[Array, "*m s hk"], values: Float[Array, "*m s hv"],
              cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """Stored keys/values (:func:`project_kv`, any leading shape) -> the attention's keys
    [..., n_kv, h_qk] and values [..., n_kv, h_v]: the identity, except for MLA, whose
    latents are expanded to per-head keys and values."""
    if cfg.mla is None:
        return keys, values
    lead = keys.shape[:-2]
    k, v = mla_lib.mla_expand(p, keys.reshape(-1, *keys.shape[-2:]),
                              values.reshape(-1, *values.shape[-2:]), cfg.mla)
    return k.reshape(*lead, *k.shape[1:]), v.reshape(*lead, *v.shape[1:])


def resident_mlp(p: LayerParams, moe_in: Float[Array, "n d"], layer,
                 cfg: ModelConfig) -> Float[Array, "n d"] | None:
    """The layer's resident MLP on the normed MoE input: the shared experts of an MoE
    layer (times sigmoid(x·g) where the family gates them), or a dense layer's MLP; None
    when the family has neither."""
    if "mlp_gate" not in p:
        return None
    # The stack is as wide as the wider of the two MLPs; each branch runs only its own
    # columns (the rest are zero padding), so a layer pays for its own MLP's width.
    if not cfg.dense_layers:
        return _shared_experts(p, moe_in, cfg)
    if isinstance(layer, int):      # a host-side driver: the kind is known statically
        return (_swiglu_columns(p, moe_in, cfg.dense_intermediate_size)
                if layer in cfg.dense_layers else _shared_experts(p, moe_in, cfg))
    return jax.lax.cond(_is_dense(layer, cfg),
                        lambda x: _swiglu_columns(p, x, cfg.dense_intermediate_size),
                        lambda x: _shared_experts(p, x, cfg), moe_in)


def _swiglu_columns(p: LayerParams, x: Float[Array, "n d"], width: int) -> Float[Array, "n d"]:
    """SwiGLU over the first ``width`` columns of the resident MLP stack (0: zeros)."""
    if width == 0:
        return jnp.zeros_like(x)
    gate = x @ p["mlp_gate"][:, :width].astype(x.dtype)
    up = x @ p["mlp_up"][:, :width].astype(x.dtype)
    hidden = (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(x.dtype)
    return hidden @ p["mlp_down"][:width].astype(x.dtype)


def _shared_experts(p: LayerParams, x: Float[Array, "n d"], cfg: ModelConfig
                    ) -> Float[Array, "n d"]:
    """An MoE layer's shared experts, times sigmoid(x·g) where the family gates them."""
    out = _swiglu_columns(p, x, cfg.shared_intermediate_size)
    if "shared_gate" in p:
        scale = jax.nn.sigmoid(jnp.dot(x, p["shared_gate"].astype(x.dtype),
                                       preferred_element_type=jnp.float32))
        out = (out.astype(jnp.float32) * scale[:, None]).astype(x.dtype)
    return out


def _is_dense(layer, cfg: ModelConfig) -> jax.Array:
    """Is ``layer`` (static or traced) a dense layer? A constant table indexed by it."""
    table = jnp.asarray([i in cfg.dense_layers for i in range(cfg.num_layers)])
    return table[layer]


def attention_options(p: LayerParams, layer, cfg: ModelConfig) -> dict[str, Any]:
    """The keyword arguments of the family's attention for this layer: ``sinks`` [n_q]
    (GPT-OSS) and ``window`` (its sliding layers; a full layer passes a window above any
    context: one compiled body serves both). Empty for the other families."""
    out: dict[str, Any] = {}
    if "sinks" in p:
        out["sinks"] = p["sinks"]
    if cfg.sliding_layers:
        table = jnp.asarray([cfg.sliding_window if i in cfg.sliding_layers else MAX_WINDOW
                             for i in range(cfg.num_layers)], jnp.int32)
        out["window"] = table[layer]
    return out


def layer_slice(layer_params: LayerParams, index) -> dict[str, jax.Array]:
    """One layer's params out of the stacked ones (``index`` static or traced)."""
    return {name: jax.lax.dynamic_index_in_dim(a, index, axis=0, keepdims=False)
            for name, a in layer_params.items()}


# --------------------------------------------------------------------- the layer
@typing.no_type_check   # a pytree: JAX rebuilds it with placeholder leaves
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerOutput:
    """What one layer returns: the residual stream ``x`` ([n, d], or [P, d] at rows), the
    attention kind and dispatcher carry after it (pools, caches, gathered experts, stats),
    the layer's routing (top-k ids and weights of the rows it ran) and the router's input
    (the normed hidden state the MoE ran on)."""

    x: jax.Array
    attn: Any
    moe_carry: Any
    routing: moe.Routing
    moe_in: jax.Array | None = None


def attention_block(p: LayerParams, layer, x: Float[Array, "n d"], attn, cfg: ModelConfig, *,
                    rows: Int[Array, "r"] | None = None, psum_axis: str | None = None
                    ) -> tuple[jax.Array, Any, jax.Array, "jax.Array | None"]:
    """The attention half of a layer: (x + attn(norm(x)), the attention kind after it, the
    normed MoE input, the valid rows). See :func:`decoder_layer` for the keywords."""
    # Named scopes (``attention``, ``norm``, ``experts``, ...) label the compiled ops'
    # metadata, so that a profile can be attributed to stages (benchmarks/time_breakdown.py).
    with jax.named_scope("norm"):
        h_in = rms_norm(x, p["attn_norm"], cfg.rms_norm_eps)
    with jax.named_scope("attention"):
        heads, attn = attn.attend(p, layer, h_in, rows, cfg)
        out = heads.reshape(heads.shape[0], -1) @ p["wo"].astype(x.dtype)
        if psum_axis is not None:
            out = jax.lax.psum(out, psum_axis)
        if "bo" in p:       # the output projection's bias, once (after any partial-sum)
            out = out + p["bo"].astype(out.dtype)
        x = (x if rows is None else jnp.take(x, rows, axis=0)) + out
    with jax.named_scope("norm"):
        moe_in = rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps)
    # The resident MLP (shared experts, a dense layer's MLP) is added here, with the
    # attention half: every driver (fused, layerwise, host-side) then sums in one order,
    # and the routed experts are all that is left for the MoE seam.
    with jax.named_scope("experts"):
        resident = resident_mlp(p, moe_in, layer, cfg)
    if resident is not None:
        x = x + resident
    return x, attn, moe_in, attn.valid_rows(rows)


def route_layer(p: LayerParams, moe_in: Float[Array, "n d"], cfg: ModelConfig,
                layer=None) -> moe.Routing:
    """The layer's router on the normed MoE input (the family's scoring, groups and
    scaling). A dense layer (``layer`` given) routes with weight 0: its zero experts add
    nothing, and every layer keeps one structure."""
    with jax.named_scope("route"):
        routing = moe.route_scored(
            moe_in, p["router"], cfg.num_experts_per_tok, norm_topk_prob=cfg.norm_topk_prob,
            scoring=cfg.router_scoring, choice_bias=p.get("score_bias"), n_group=cfg.n_group,
            topk_group=cfg.topk_group, group_score=cfg.group_score,
            scaling=cfg.routed_scaling_factor, logit_bias=p.get("router_bias"))
        if cfg.dense_layers and layer is not None:
            routing = dataclasses.replace(
                routing, weights=jnp.where(_is_dense(layer, cfg), 0.0, routing.weights))
    return routing


def decoder_layer(p: LayerParams, layer, x: Float[Array, "n d"], attn, dispatcher,
                  moe_carry: Any, cfg: ModelConfig, *, rows: Int[Array, "r"] | None = None,
                  routing: moe.Routing | None = None,
                  psum_axis: str | None = None) -> LayerOutput:
    """One pre-norm decoder layer: x + attn(norm(x)), then + moe(norm(x)).

    ``p``: this layer's params (experts may be absent); ``attn``: the attention kind;
    ``dispatcher``/``moe_carry``: the MoE seam and its loop state. ``rows``: run the
    queries, the output projection and the MoE at these rows only (keys and values
    still come from every row); the output is then [r, d]. ``routing``: use this
    routing instead of the router's (speculative decode). ``psum_axis``: the mesh axis
    over which attention outputs are partial sums (tensor parallelism).
    """
    x, attn, moe_in, valid = attention_block(p, layer, x, attn, cfg, rows=rows,
                                             psum_axis=psum_axis)
    if routing is None:
        routing = route_layer(p, moe_in, cfg, layer)
    if cfg.dense_layers and not isinstance(layer, int) and dispatcher.skippable:
        # A dense layer's routed experts are zero: skip their compute where nothing in
        # the dispatcher communicates (elsewhere they run, weighted 0, in lockstep).
        y, moe_carry = jax.lax.cond(
            _is_dense(layer, cfg), lambda: (jnp.zeros_like(moe_in), moe_carry),
            lambda: dispatcher.apply(layer, moe_in, routing, valid, moe_carry))
    else:
        y, moe_carry = dispatcher.apply(layer, moe_in, routing, valid, moe_carry)
    return LayerOutput(x=x + y, attn=attn, moe_carry=moe_carry, routing=routing,
                       moe_in=moe_in)


def layer(layer_params: LayerParams, index, x: Float[Array, "n d"], attn, dispatcher,
          moe_carry: Any, cfg: ModelConfig, *, stack_offset: int = 0,
          **kwargs: Any) -> LayerOutput:
    """The single-layer entry: layer ``index`` of the stacked params (see
    :func:`decoder_layer` for the keywords). ``stack_offset``: the global index of the
    stack's first layer (a pipeline stage holds layers [a, b) only: layer i is row i - a)."""
    return decoder_layer(layer_slice(layer_params, index - stack_offset), index, x, attn,
                         dispatcher, moe_carry, cfg, **kwargs)


# --------------------------------------------------------------------- the driver
def run_layers(layer_params: LayerParams, x: Float[Array, "n d"], attn, dispatcher,
               moe_carry: Any, cfg: ModelConfig, *, start: int = 0, stop: int | None = None,
               observe: Observer | None = None, psum_axis: str | None = None,
               stack_offset: int = 0) -> tuple[jax.Array, Any, Any, Any]:
    """Layers [start, stop) (default: all) on x [n, d], in one loop over the stacked
    params (indexed in place: slicing the stack first would copy it; ``stack_offset``:
    the global index of the stack's first layer, for a stack of some layers only).

    Only the attention kind's *carry* (its pools or caches) travels through the loop;
    the rest of it (positions, masks) is a constant of the body. Returns (x, attention
    kind, dispatcher carry, observations stacked [stop - start, ...] or None).
    """
    stop = cfg.num_layers if stop is None else stop
    count = stop - start
    observed = None
    if observe is not None:
        probe = jax.eval_shape(lambda: observe(jnp.int32(0), _abstract_routing(x, cfg), None, x))
        observed = jax.tree.map(lambda s: jnp.zeros((count,) + s.shape, s.dtype), probe)

    def body(i, carry):
        x, attn_carry, moe_carry, observed = carry
        out = layer(layer_params, i, x, attn.with_carry(attn_carry), dispatcher, moe_carry,
                    cfg, psum_axis=psum_axis, stack_offset=stack_offset)
        if observe is not None:
            seen = observe(i, out.routing, out.attn.valid_rows(None), out.moe_in)
            observed = jax.tree.map(lambda acc, v: acc.at[i - start].set(v), observed, seen)
        return out.x, out.attn.carry(), out.moe_carry, observed

    x, attn_carry, moe_carry, observed = jax.lax.fori_loop(
        start, stop, body, (x, attn.carry(), moe_carry, observed))
    return x, attn.with_carry(attn_carry), moe_carry, observed


def _abstract_routing(x: jax.Array, cfg: ModelConfig) -> moe.Routing:
    """A routing of x's rows (for the shapes of an observation; traced abstractly only)."""
    return moe.route_scored(x, jnp.zeros((x.shape[1], cfg.num_experts), x.dtype),
                            cfg.num_experts_per_tok, norm_topk_prob=cfg.norm_topk_prob)
