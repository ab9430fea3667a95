"""The layer index of an expert-weight stack read in place by the grouped-GEMM kernels
(``layer=`` of :mod:`kernels_pallas.gmm`, :mod:`kernels_pallas.gmm_fp8` and
:mod:`kernels_pallas.gmm_mosaic`): the operand a kernel loads, and the shape error that
tells a stack from one layer."""

from __future__ import annotations

import jax.numpy as jnp
from jaxtyping import Array, Int, Integer

Layer = int | Integer[Array, ""]


def layer_operand(name: str, layer: Layer, num_layers: int) -> Int[Array, "1"]:
    """``layer`` as the ``[1]`` int32 array a kernel loads, read as ``w[layer]`` reads it: a
    negative index counts from the end and a traced one out of range is clamped (so a
    program never reads past the stack); a Python int out of range is refused by name."""
    if isinstance(layer, bool) or not (
            isinstance(layer, int) or (jnp.ndim(layer) == 0
                                       and jnp.issubdtype(jnp.result_type(layer), jnp.integer))):
        raise ValueError(f"{name}: layer must be an int or an integer scalar array, got "
                         f"{layer!r}")
    if isinstance(layer, int) and not -num_layers <= layer < num_layers:
        raise ValueError(f"{name}: layer {layer} is out of range for a stack of "
                         f"{num_layers} layers")
    index = jnp.asarray(layer, jnp.int32)
    index = jnp.where(index < 0, index + num_layers, index)
    return jnp.clip(index, 0, num_layers - 1).reshape(1)


def weight_shape_error(name: str, operand: str, shape: tuple[int, ...], expected: str,
                       layered: bool) -> str:
    """The message for a weight operand of the wrong shape: ``expected`` (its dims, the
    leading L of ``layer=`` included where ``layered``), what came, and — where the rank is
    one off — that ``layer=`` is what tells the two forms apart."""
    rank = len(expected.split(","))
    hint = ""
    if layered and len(shape) == rank - 1:
        hint = " (with layer= the weights are a stack with a leading L axis)"
    elif not layered and len(shape) == rank + 1:
        hint = " (pass layer= to read one layer of an [L, ...] stack)"
    return f"{name}: weights must be [{expected}], got {operand} {list(shape)}{hint}"
