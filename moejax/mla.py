"""DeepSeek-V2/V3 Multi-head Latent Attention (MLA): the projections, as pure functions.

MLA caches, per token and layer, one normed latent ``c`` [kv_lora_rank] and one roped key
part ``k_rope`` [qk_rope_head_dim] shared by all heads (:func:`mla_latent`); the per-head
keys ``[k_nope(c) | k_rope]`` and values ``v(c)`` are re-expanded from the latent through
``wkv_b`` (:func:`mla_expand`). Queries are ``[q_nope | rope(q_rope)]`` per head
(:func:`mla_queries`), from ``wq`` or, with a query LoRA, ``wq_b(norm(wq_a(x)))``.
Attention itself is plain softmax attention over those heads (head dims differ: keys
``qk_head_dim``, values ``v_head_dim``), then ``heads [n, H·v_head_dim] @ wo``.

Rotary layout. Both families rotate *interleaved pairs* (x0, x1), (x2, x3), ... of the
rope part: DeepSeek-V2 as complex numbers (``view_as_complex``), DeepSeek-V3 (with
``rope_interleave``, its default) as evens/odds, writing the result de-interleaved
(``[rotated evens | rotated odds]``). The two differ only by one permutation of the
output dims, applied to queries and keys alike, so the scores are the same; here the
output is always the de-interleaved V3 layout. ``rope_interleave=False`` (V3 option) is
the plain rotate-half convention of :func:`moejax.layers.rope`. Matches transformers'
``modeling_deepseek_v2.py`` / ``modeling_deepseek_v3.py`` / ``modeling_rope_utils.py``.

Params of one layer (matrices [in, out], the transpose of torch's ``Linear.weight``) are
named in :func:`mla_param_shapes`; :data:`HF_TENSOR_NAMES` gives their checkpoint names.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from moejax.mla_shape import (HF_TENSOR_NAMES, MLAShape, YarnScaling,  # noqa: F401
                              mla_param_shapes, mla_shape_from_hf)
from moejax.norms import rms_norm

LayerParams = Mapping[str, jax.Array]

def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_inv_freq_and_scale(shape: MLAShape) -> tuple[np.ndarray, float]:
    """(inverse frequencies [qk_rope_head_dim/2] float32, the factor on cos/sin): default
    rope (factor 1) or YaRN, computed as transformers does (float32 frequencies)."""
    return yarn_inv_freq_and_scale(shape.qk_rope_head_dim, shape.rope_theta, shape.yarn)


def yarn_inv_freq_and_scale(dim: int, theta: float, y: YarnScaling | None
                            ) -> tuple[np.ndarray, float]:
    """(inverse frequencies [dim/2] float32, the factor on cos/sin) of a rotary embedding
    over ``dim`` channels: default rope (factor 1) or YaRN ``y``, as transformers'
    ``_compute_yarn_parameters`` (float32 frequencies)."""
    pos_freqs = np.float32(theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    if y is None:
        return (np.float32(1.0) / pos_freqs).astype(np.float32), 1.0
    factor = y.factor
    if y.attention_factor is not None:
        attention_factor = float(y.attention_factor)
    elif y.mscale and y.mscale_all_dim:
        attention_factor = _yarn_mscale(factor, y.mscale) / _yarn_mscale(factor, y.mscale_all_dim)
    else:
        attention_factor = _yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(y.original_max_position_embeddings / (rotations * 2 * math.pi))
                / (2 * math.log(theta)))

    low, high = correction_dim(y.beta_fast), correction_dim(y.beta_slow)
    if y.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation = (1 - ramp).astype(np.float32)
    inv_freq = (np.float32(1.0) / (np.float32(factor) * pos_freqs)) * (1 - extrapolation) \
        + (np.float32(1.0) / pos_freqs) * extrapolation
    return inv_freq.astype(np.float32), float(attention_factor)


def softmax_scale(shape: MLAShape) -> float:
    """DeepSeek's attention logit scale: qk_head_dim^-0.5, times mscale(factor,
    mscale_all_dim)² under YaRN when ``mscale_all_dim`` is set (same in V2 and V3)."""
    scale = shape.qk_head_dim ** -0.5
    y = shape.yarn
    if y is not None and y.mscale_all_dim:
        scale *= _yarn_mscale(y.factor, y.mscale_all_dim) ** 2
    return scale


def apply_rope(x: Float[Array, "n heads r"], positions: Int[Array, "n"],
               shape: MLAShape) -> Float[Array, "n heads r"]:
    """Rotary embedding of the rope part (interleaved pairs in, de-interleaved out; or
    rotate-half), cos/sin times YaRN's attention factor; computed in float32."""
    inv_freq, factor = rope_inv_freq_and_scale(shape)
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
    cos = (jnp.cos(angles) * factor)[:, None, :]
    sin = (jnp.sin(angles) * factor)[:, None, :]
    x32 = x.astype(jnp.float32)
    if shape.rope_interleave:
        x1, x2 = x32[..., 0::2], x32[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = x32[..., :half], x32[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def mla_queries(p: LayerParams, h_in: Float[Array, "n d"], positions: Int[Array, "n"],
                shape: MLAShape) -> Float[Array, "n heads qk"]:
    """Normed input -> queries [n, H, qk_head_dim] = [q_nope | rope(q_rope)].

    Pre-scaled by ``softmax_scale(shape) * sqrt(qk_head_dim)``: an attention that divides
    scores by sqrt(qk_head_dim), as every moejax attention does, then applies DeepSeek's
    scale (which differs under YaRN with mscale_all_dim). The head count comes from the
    weights, so a tensor-parallel shard's local heads work too."""
    if "wq" in p:
        q = h_in @ p["wq"].astype(h_in.dtype)
    else:
        qa = rms_norm(h_in @ p["wq_a"].astype(h_in.dtype), p["q_a_norm"], shape.rms_norm_eps)
        q = qa @ p["wq_b"].astype(h_in.dtype)
    q = q.reshape(h_in.shape[0], -1, shape.qk_head_dim)
    nope = shape.qk_nope_head_dim
    q = jnp.concatenate([q[..., :nope], apply_rope(q[..., nope:], positions, shape)], axis=-1)
    return q * jnp.asarray(softmax_scale(shape) * math.sqrt(shape.qk_head_dim), q.dtype)


def mla_latent(p: LayerParams, h_in: Float[Array, "n d"], positions: Int[Array, "n"],
               shape: MLAShape) -> tuple[Float[Array, "n 1 r"], Float[Array, "n 1 rope"]]:
    """Normed input -> what the KV cache holds per token: the normed latent [n, 1,
    kv_lora_rank] and the roped shared key part [n, 1, qk_rope_head_dim]."""
    kv = h_in @ p["wkv_a"].astype(h_in.dtype)
    r = shape.kv_lora_rank
    latent = rms_norm(kv[:, :r], p["kv_a_norm"], shape.rms_norm_eps)[:, None, :]
    return latent, apply_rope(kv[:, None, r:], positions, shape)


def mla_expand(p: LayerParams, latent: Float[Array, "m 1 r"], k_rope: Float[Array, "m 1 rope"],
               shape: MLAShape) -> tuple[Float[Array, "m heads qk"], Float[Array, "m heads v"]]:
    """Cached latents -> per-head keys [m, H, qk_head_dim] = [k_nope | k_rope] (k_rope
    shared by every head) and values [m, H, v_head_dim]."""
    kv = latent[:, 0, :] @ p["wkv_b"].astype(latent.dtype)
    nope = shape.qk_nope_head_dim
    kv = kv.reshape(latent.shape[0], -1, nope + shape.v_head_dim)
    k_nope, values = kv[..., :nope], kv[..., nope:]
    k_rope = jnp.broadcast_to(k_rope.astype(k_nope.dtype),
                              (*k_nope.shape[:2], shape.qk_rope_head_dim))
    return jnp.concatenate([k_nope, k_rope], axis=-1), values
