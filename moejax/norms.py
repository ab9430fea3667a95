"""RMSNorm, the one normalization every supported family uses (its own module so that the
attention variants can use it without importing the layer)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float


def rms_norm(x: Float[Array, "*rows d"], weight: Float[Array, "d"],
             eps: float) -> Float[Array, "*rows d"]:
    """RMSNorm in float32, cast back to x's dtype (as the HF reference does)."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (weight.astype(jnp.float32) * x32).astype(x.dtype)
