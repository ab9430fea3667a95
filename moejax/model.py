"""Flax NNX MoE decoder (Qwen3-MoE and Mixtral) over packed input.

Input is a flat token array with segment ids and positions (``PackedBatch``):
requests of different lengths share one batch without padding to the longest.
Attention is causal within a segment, computed block-locally (``moejax.attention``):
the flat array is cut into blocks of ``attn_block`` tokens and the packer
(``moejax.packing``) never lets a segment cross a block boundary, so each block
attends only to itself and attention costs at most T·B instead of T².

Params are the nested dict of ``moejax.param_layout`` (all layers stacked on a
leading L axis, matrices [in, out]).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from moejax import attention, moe
from moejax.config import ModelConfig
from moejax.param_layout import Params, param_shapes, shape_problems


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedBatch:
    """One packed forward.

    tokens, positions, segment_ids: [T] int32 (segment_ids -1 marks padding);
    score_positions: [P] int32 flat indices whose next-token logits are read;
    score_token_ids: [P, C] int32 vocabulary ids whose logits are returned.
    """

    tokens: jax.Array
    positions: jax.Array
    segment_ids: jax.Array
    score_positions: jax.Array
    score_token_ids: jax.Array


@dataclasses.dataclass(frozen=True)
class ForwardOptions:
    """Static choices of one compiled forward (part of the compile key)."""

    attn_block: int
    full_vocab: bool = True
    expert_impl: moe.ExpertImpl = "auto"
    tile_rows: int | tuple[int, int] | None = None   # None: grouped_gemm.TILE_ROWS


# --------------------------------------------------------------------- stages
def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm in float32, cast back to x's dtype (as the HF reference does)."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (weight.astype(jnp.float32) * x32).astype(x.dtype)


def rope(x: jax.Array, positions: jax.Array, theta: float) -> jax.Array:
    """Rotary embedding (rotate-half convention) on x [T, heads, h] at positions [T]."""
    half = x.shape[-1] // 2
    inv_freq = 1.0 / (theta ** (jnp.arange(half, dtype=jnp.float32) / half))
    angles = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    cos, sin = jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[..., :half], x32[..., half:]
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def project_q(p: Mapping[str, jax.Array], h_in: jax.Array, positions: jax.Array,
              cfg: ModelConfig) -> jax.Array:
    """Normed input [n, d] -> queries [n, n_q, h] (q-norm for Qwen3, then RoPE)."""
    q = (h_in @ p["wq"].astype(h_in.dtype)).reshape(-1, cfg.num_heads, cfg.head_dim)
    if cfg.qk_norm:
        q = rms_norm(q, p["q_norm"], cfg.rms_norm_eps)
    return rope(q, positions, cfg.rope_theta)


def project_kv(p: Mapping[str, jax.Array], h_in: jax.Array, positions: jax.Array,
               cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """Normed input [n, d] -> keys, values [n, n_kv, h] (k-norm for Qwen3, RoPE on keys)."""
    k = (h_in @ p["wk"].astype(h_in.dtype)).reshape(-1, cfg.num_kv_heads, cfg.head_dim)
    v = (h_in @ p["wv"].astype(h_in.dtype)).reshape(-1, cfg.num_kv_heads, cfg.head_dim)
    if cfg.qk_norm:
        k = rms_norm(k, p["k_norm"], cfg.rms_norm_eps)
    return rope(k, positions, cfg.rope_theta), v


def attention_block(p: Mapping[str, jax.Array], x: jax.Array, batch: PackedBatch,
                    bias: jax.Array | None, cfg: ModelConfig, opts: ForwardOptions) -> jax.Array:
    """Pre-norm residual input x [T, d] -> attention output [T, d] (one layer's params)."""
    q = project_q(p, x, batch.positions, cfg)
    k, v = project_kv(p, x, batch.positions, cfg)
    out = attention.packed_attention(q, k, v, batch.segment_ids, opts.attn_block, bias)
    return out.reshape(x.shape[0], -1) @ p["wo"].astype(x.dtype)


def moe_residual(p: Mapping[str, jax.Array], x: jax.Array, valid: jax.Array | None,
                 cfg: ModelConfig, opts: ForwardOptions) -> jax.Array:
    """x [n, d] + MoE(RMSNorm(x)); ``valid`` [n] marks real tokens (None: all)."""
    return moe_residual_with_routing(p, x, valid, cfg, opts)[0]


def moe_residual_with_routing(p: Mapping[str, jax.Array], x: jax.Array,
                              valid: jax.Array | None, cfg: ModelConfig, opts: ForwardOptions
                              ) -> tuple[jax.Array, moe.Routing]:
    """:func:`moe_residual` plus the layer's routing (top-k expert ids [n, k]): the
    generation loop traces expert activations from it."""
    moe_in = rms_norm(x, p["mlp_norm"], cfg.rms_norm_eps)
    out, routing = moe.moe_block_with_routing(
        moe_in, p["router"], p["w_gate"], p["w_up"], p["w_down"], k=cfg.num_experts_per_tok,
        norm_topk_prob=cfg.norm_topk_prob, valid=valid, impl=opts.expert_impl,
        tile_rows=opts.tile_rows)
    return x + out, routing


def attention_residual(p: Mapping[str, jax.Array], x: jax.Array, batch: PackedBatch,
                       bias: jax.Array | None, cfg: ModelConfig, opts: ForwardOptions) -> jax.Array:
    """x [T, d] + attention(RMSNorm(x)): the first half of a decoder layer."""
    return x + attention_block(p, rms_norm(x, p["attn_norm"], cfg.rms_norm_eps), batch, bias,
                               cfg, opts)


def attention_residual_at_rows(p: Mapping[str, jax.Array], x: jax.Array, batch: PackedBatch,
                               rows: jax.Array, cfg: ModelConfig, opts: ForwardOptions
                               ) -> jax.Array:
    """The first half of a decoder layer at ``rows`` [P] only: x [T, d] -> [P, d] (keys and
    values from every token, queries, attention output and projection at the rows)."""
    h_in = rms_norm(x, p["attn_norm"], cfg.rms_norm_eps)
    k, v = project_kv(p, h_in, batch.positions, cfg)
    q = project_q(p, jnp.take(h_in, rows, axis=0), jnp.take(batch.positions, rows), cfg)
    out = attention.attention_at_rows(q, k, v, batch.segment_ids, rows, opts.attn_block)
    return jnp.take(x, rows, axis=0) + out.reshape(rows.shape[0], -1) @ p["wo"].astype(x.dtype)


def decoder_layer(p: Mapping[str, jax.Array], x: jax.Array, batch: PackedBatch,
                  bias: jax.Array | None, cfg: ModelConfig, opts: ForwardOptions) -> jax.Array:
    """One pre-norm decoder layer: x + attn(norm(x)), then + moe(norm(x))."""
    x = attention_residual(p, x, batch, bias, cfg, opts)
    return moe_residual(p, x, batch.segment_ids >= 0, cfg, opts)


def decoder_layer_at_rows(p: Mapping[str, jax.Array], x: jax.Array, batch: PackedBatch,
                          rows: jax.Array, cfg: ModelConfig, opts: ForwardOptions) -> jax.Array:
    """One decoder layer's output at ``rows`` [P] only -> [P, d].

    Used for the last layer: keys and values still come from every token, but the
    queries, the attention output, the output projection and the MoE run on the
    scoring positions alone.
    """
    return moe_residual(p, attention_residual_at_rows(p, x, batch, rows, cfg, opts), None,
                        cfg, opts)


def lm_head_scores(params: Params, hidden: jax.Array, token_ids: jax.Array, cfg: ModelConfig,
                   full_vocab: bool) -> tuple[jax.Array, jax.Array | None]:
    """Logits of ``token_ids`` [P, C] at final hidden states [P, d] -> ([P, C] f32, lse [P] | None).

    With ``full_vocab`` the whole [P, V] row is computed (needed for the
    log-softmax over the vocabulary); otherwise only the C requested columns.
    """
    tied = cfg.tie_word_embeddings
    if full_vocab:
        head = params["embed"].T if tied else params["lm_head"]
        logits = jnp.dot(hidden, head.astype(hidden.dtype), preferred_element_type=jnp.float32)
        picked = jnp.take_along_axis(logits, token_ids, axis=1)
        return picked, jax.nn.logsumexp(logits, axis=-1)
    if tied:
        columns = jnp.take(params["embed"], token_ids, axis=0)           # [P, C, d]
    else:
        columns = jnp.take(params["lm_head"].T, token_ids, axis=0)       # [P, C, d]
    picked = jnp.einsum("pd,pcd->pc", hidden, columns.astype(hidden.dtype),
                        preferred_element_type=jnp.float32)
    return picked, None


def forward(params: Params, batch: PackedBatch, cfg: ModelConfig,
            opts: ForwardOptions) -> tuple[jax.Array, jax.Array | None]:
    """Packed forward to the scoring positions: ([P, C] logits f32, [P] logsumexp or None).

    The last layer runs only at the scoring positions when they are few (P <= T/4):
    nothing after it reads the other rows.
    """
    bias = attention.attention_bias(batch.segment_ids, opts.attn_block)
    last = cfg.num_layers - 1
    x = decoder_stack(params["layers"], embed_tokens(params, batch), batch, cfg, opts,
                      num_layers=last, bias=bias)
    return finish_scoring(params, layer_slice(params["layers"], last), x, batch, bias, cfg, opts)


def embed_tokens(params: Params, batch: PackedBatch) -> jax.Array:
    """Token embeddings [T, d]."""
    return jnp.take(params["embed"], batch.tokens, axis=0)


def last_layer_at_rows_only(batch: PackedBatch) -> bool:
    """Run the last layer at the scoring rows alone? Yes when they are few (P <= T/4)."""
    return 4 * batch.score_positions.shape[0] <= batch.tokens.shape[0]


def finish_scoring(params: Params, last_layer: Mapping[str, jax.Array], x: jax.Array,
                   batch: PackedBatch, bias: jax.Array | None, cfg: ModelConfig,
                   opts: ForwardOptions, layer_fn=None, layer_at_rows_fn=None
                   ) -> tuple[jax.Array, jax.Array | None]:
    """The last decoder layer (``last_layer``: its params, experts included) on the output
    x [T, d] of the layers before it, then the final norm and the LM head at the scoring
    positions. Every backend ends its forward here, so all share one definition; a
    backend whose layers differ (tensor parallel) passes its own ``layer_fn`` /
    ``layer_at_rows_fn`` with the signatures of :func:`decoder_layer` /
    :func:`decoder_layer_at_rows`."""
    layer_fn = layer_fn or decoder_layer
    layer_at_rows_fn = layer_at_rows_fn or decoder_layer_at_rows
    rows = batch.score_positions
    if last_layer_at_rows_only(batch):
        x_rows = layer_at_rows_fn(last_layer, x, batch, rows, cfg, opts)
    else:
        x_rows = jnp.take(layer_fn(last_layer, x, batch, bias, cfg, opts), rows, axis=0)
    final = rms_norm(x_rows, params["final_norm"], cfg.rms_norm_eps)
    return lm_head_scores(params, final, batch.score_token_ids, cfg, opts.full_vocab)


def hidden_states(params: Params, batch: PackedBatch, cfg: ModelConfig,
                  opts: ForwardOptions) -> jax.Array:
    """Embedding and every decoder layer (a loop over the stacked layers) -> [T, d]."""
    return decoder_stack(params["layers"], embed_tokens(params, batch), batch, cfg, opts)


def layer_slice(layer_params: Mapping[str, jax.Array], index) -> dict[str, jax.Array]:
    """One layer's params out of the stacked ones (``index`` static or traced)."""
    return {name: jax.lax.dynamic_index_in_dim(a, index, axis=0, keepdims=False)
            for name, a in layer_params.items()}


def decoder_stack(layer_params: Mapping[str, jax.Array], x: jax.Array, batch: PackedBatch,
                  cfg: ModelConfig, opts: ForwardOptions, num_layers: int | None = None,
                  bias: jax.Array | None = None) -> jax.Array:
    """Decoder layers [0, num_layers) (default: all) on x [T, d]: a loop over the stacked
    layer params that indexes them in place (slicing the stack first would copy it).
    ``bias``: the attention bias of ``batch`` if the caller already built it."""
    if bias is None:   # shared by all layers
        bias = attention.attention_bias(batch.segment_ids, opts.attn_block)
    count = cfg.num_layers if num_layers is None else num_layers

    def body(i, x):
        return decoder_layer(layer_slice(layer_params, i), x, batch, bias, cfg, opts)

    return jax.lax.fori_loop(0, count, body, x)


def full_logits(params: Params, batch: PackedBatch, cfg: ModelConfig,
                opts: ForwardOptions) -> jax.Array:
    """Logits over the vocabulary at every position [T, V] (tests and debugging)."""
    x = rms_norm(hidden_states(params, batch, cfg, opts), params["final_norm"], cfg.rms_norm_eps)
    return vocab_logits(params, x, cfg)


def vocab_logits(params: Params, normed: jax.Array, cfg: ModelConfig) -> jax.Array:
    """LM head over the whole vocabulary: final-normed hidden states [n, d] -> [n, V] f32."""
    head = params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]
    return jnp.dot(normed, head.astype(normed.dtype), preferred_element_type=jnp.float32)


# ------------------------------------------------------------------ NNX model
def init_params(cfg: ModelConfig, seed: int = 0, scale: float = 0.02,
                dtype: Any = np.float32) -> Params:
    """Deterministic random params (norm weights 1, matrices N(0, scale²)) as NumPy arrays."""
    rng = np.random.default_rng(seed)

    def make(path: str, shape: tuple[int, ...]) -> np.ndarray:
        if path.endswith("norm"):
            return np.ones(shape, dtype)
        return (rng.standard_normal(shape, dtype=np.float32) * scale).astype(dtype)

    shapes = param_shapes(cfg)
    params: Params = {}
    for name, shape in shapes.items():
        if name == "layers":
            params["layers"] = {n: make(n, s) for n, s in shape.items()}
        else:
            params[name] = make(name, shape)
    return params


def check_params(params: Params, cfg: ModelConfig) -> None:
    """Raise ValueError naming every missing, unexpected or mis-shaped parameter."""
    problems = shape_problems(params, cfg)
    if problems:
        raise ValueError("params do not match the model config: " + "; ".join(problems))


class DecoderLayers(nnx.Module):
    """All L decoder layers, parameters stacked on a leading layer axis."""

    def __init__(self, cfg: ModelConfig, layer_params: Mapping[str, Any], dtype: Any):
        self.cfg = cfg
        for name, value in layer_params.items():
            setattr(self, name, nnx.Param(jnp.asarray(value, dtype)))

    def arrays(self) -> dict[str, jax.Array]:
        names = param_shapes(self.cfg)["layers"]
        return {name: getattr(self, name)[...] for name in names}

    def __call__(self, x: jax.Array, batch: PackedBatch, opts: ForwardOptions) -> jax.Array:
        return decoder_stack(self.arrays(), x, batch, self.cfg, opts)


class MoEDecoder(nnx.Module):
    """The decoder as an NNX module; ``__call__`` returns scoring-position logits.

    Build it from a params dict (``MoEDecoder(cfg, params)``) or with random
    weights (``MoEDecoder.random(cfg, seed)``). ``params()`` returns the dict the
    pure ``forward`` takes, which is what the runners jit.
    """

    def __init__(self, cfg: ModelConfig, params: Params, dtype: Any = jnp.float32):
        check_params(params, cfg)
        self.cfg = cfg
        self.embed = nnx.Param(jnp.asarray(params["embed"], dtype))
        self.layers = DecoderLayers(cfg, params["layers"], dtype)
        self.final_norm = nnx.Param(jnp.asarray(params["final_norm"], dtype))
        self.lm_head = (None if cfg.tie_word_embeddings
                        else nnx.Param(jnp.asarray(params["lm_head"], dtype)))

    @classmethod
    def random(cls, cfg: ModelConfig, seed: int = 0, dtype: Any = jnp.float32) -> "MoEDecoder":
        return cls(cfg, init_params(cfg, seed), dtype)

    def params(self) -> Params:
        out: Params = {"embed": self.embed[...], "layers": self.layers.arrays(),
                       "final_norm": self.final_norm[...]}
        if self.lm_head is not None:
            out["lm_head"] = self.lm_head[...]
        return out

    def __call__(self, batch: PackedBatch, opts: ForwardOptions) -> tuple[jax.Array, jax.Array | None]:
        return forward(self.params(), batch, self.cfg, opts)
