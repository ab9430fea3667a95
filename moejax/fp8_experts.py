"""Routed experts kept in FP8 on the device (``weights_dtype="fp8"``, issue 41).

An FP8 block-scaled checkpoint (DeepSeek-V3/R1, Qwen3 ``-FP8``) is normally dequantized on
load into the serving dtype (``moejax.fp8``). With ``weights_dtype="fp8"`` the routed
experts stay as the checkpoint stores them: each matrix stack ``[E, in, out]`` (moejax's
``[in, out]`` layout, the transpose of the checkpoint's ``[out, in]``) as float8_e4m3fn,
and beside it one float32 scale per block of ``(b_in, b_out)`` elements, ``[E,
ceil(in/b_in), ceil(out/b_out)]`` (the checkpoint's ``[ceil(out/b0), ceil(in/b1)]`` grid,
transposed; ``(b_in, b_out) = (b1, b0)`` of ``weight_block_size``). A quarter of the
bytes of float32 experts (half of bfloat16), plus 4 bytes per block.

Dequantization happens where a weight is read, one expert at a time: the grouped-GEMM
tile loops (``moejax.grouped_gemm``) dequantize the expert slab ``[in, out]`` of the tile
they run, and the Pallas kernel (``kernels_pallas.gmm_fp8``) the ``[block_k, block_n]``
weight tile it loads. No dequantized copy of a layer's experts is ever made. The value is
the checkpoint loader's: the FP8 value (exact in float32) times its block's float32
scale, rounded once to the compute dtype, so the FP8-kept path multiplies by the very
weights the dequantize-on-load path holds.

Partial edge blocks (``in`` or ``out`` not a multiple of the block) need no padding:
element ``(i, j)`` reads scale ``(i // b_in, j // b_out)``, which
:func:`dequantize_blocks` gets by repeating the scale grid ``b`` times along each axis
and cutting the repeat at ``in`` / ``out``.

On the device the values are held as their bytes (uint8, :func:`device_bits`; the loader's
host arrays are float8_e4m3fn) and reinterpreted as FP8 after the one expert (or tile)
is sliced out. XLA:GPU slices and moves FP8 arrays natively, but XLA:CPU does not: it
converts a whole FP8 operand to float16 before a slice of it, which would put a float16
copy of every expert stack in the program. Bytes are sliced the same everywhere.
"""

from __future__ import annotations

import dataclasses
import typing

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Shaped

FP8_DTYPE = jnp.dtype(jnp.float8_e4m3fn)
SCALE_DTYPE = jnp.dtype(jnp.float32)
# What FP8 expert values may be held as: FP8, or its bytes (the device form).
STORAGE_DTYPES = (FP8_DTYPE, jnp.dtype(jnp.uint8))
Block = tuple[int, int]


def device_bits(values: np.ndarray) -> np.ndarray:
    """A host FP8 array as the uint8 bytes the device holds (a view: no copy)."""
    return np.asarray(values).view(np.uint8)


def is_fp8_storage(dtype) -> bool:
    """Whether ``dtype`` holds FP8 expert values (FP8 itself or its bytes)."""
    return jnp.dtype(dtype) in STORAGE_DTYPES


def as_fp8(values: jax.Array) -> jax.Array:
    """FP8 values from FP8 or from their bytes (a reinterpretation, no arithmetic)."""
    if jnp.dtype(values.dtype) == FP8_DTYPE:
        return values
    return jax.lax.bitcast_convert_type(values, FP8_DTYPE)


def dequantize_blocks(values: Shaped[Array, "*lead i o"], scale: Float[Array, "*lead bi bo"],
                      block: Block, dtype) -> Float[Array, "*lead i o"]:
    """``values [..., in, out]`` (FP8, or its bytes) times ``scale [..., ceil(in/b_in),
    ceil(out/b_out)]`` expanded over ``block``, computed in float32 and rounded once to
    ``dtype``."""
    values = as_fp8(values)
    rows, cols = values.shape[-2:]
    expanded = jnp.repeat(scale.astype(jnp.float32), block[0], axis=-2)[..., :rows, :]
    expanded = jnp.repeat(expanded, block[1], axis=-1)[..., :cols]
    return (values.astype(jnp.float32) * expanded).astype(dtype)


def layer_expert_slab(stack: jax.Array, layer, expert) -> jax.Array:
    """``stack[layer, expert]`` of a ``[L, E, ...]`` stack (indices static or traced) as
    one dynamic slice of that slab: the layer is never sliced out whole."""
    start = (jnp.asarray(layer, jnp.int32), jnp.asarray(expert, jnp.int32),
             *(jnp.int32(0) for _ in stack.shape[2:]))
    return jax.lax.dynamic_slice(stack, start, (1, 1, *stack.shape[2:]))[0, 0]


@typing.no_type_check   # a pytree: JAX rebuilds it with placeholder leaves
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Fp8Experts:
    """A stack of expert matrices kept in FP8: ``values [E, in, out]`` float8_e4m3fn (or
    its bytes, uint8), ``scale [E, ceil(in/b_in), ceil(out/b_out)]`` float32, ``block``
    the (b_in, b_out) elements each scale covers (static). With ``layer`` (an int32
    scalar) the stack is every layer's, ``values [L, E, in, out]`` and ``scale [L, E,
    ...]``, and this is layer ``layer`` of it, read in place (``moejax.expert_views``);
    ``shape`` is then the layer's."""

    values: jax.Array
    scale: jax.Array
    block: Block = dataclasses.field(metadata=dict(static=True))
    layer: jax.Array | None = None

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape if self.layer is None else self.values.shape[1:]

    @property
    def dtype(self):
        return FP8_DTYPE

    def expert(self, expert, dtype) -> jax.Array:
        """Expert ``expert``'s matrix ``[in, out]`` dequantized to ``dtype`` (``expert``
        static or traced): the only dequantized copy the compute makes."""
        values, scale = self._at(expert, self.values), self._at(expert, self.scale)
        return dequantize_blocks(values, scale, self.block, dtype)

    def _at(self, expert, stack: jax.Array) -> jax.Array:
        """One expert's slab of ``stack`` (values or scales), at this view's layer."""
        if self.layer is None:
            return jax.lax.dynamic_index_in_dim(stack, expert, axis=0, keepdims=False)
        return layer_expert_slab(stack, self.layer, expert)

    def dequantized(self, dtype) -> jax.Array:
        """Every expert (of the layer) dequantized, ``[E, in, out]``: a reference for
        tests, never on a serving path (it is the whole-layer copy keeping FP8 avoids)."""
        values, scale = self.values, self.scale
        if self.layer is not None:
            values = jax.lax.dynamic_index_in_dim(values, self.layer, axis=0, keepdims=False)
            scale = jax.lax.dynamic_index_in_dim(scale, self.layer, axis=0, keepdims=False)
        return dequantize_blocks(values, scale, self.block, dtype)


def any_fp8(*stacks: typing.Any) -> bool:
    """Whether any of ``stacks`` is kept in FP8."""
    return any(isinstance(w, Fp8Experts) for w in stacks)
