"""One layer of a stacked expert weight, read in place (issue 43).

The resident experts are stacked ``[L, E, in, out]``. A program that loops over layers
and slices layer l out of the stack (``stack[l]``, a dynamic slice) makes XLA
materialize that slice: a copy of a whole layer's experts per layer per step (1.15 GiB of
temporaries on a Qwen3-30B-A3B-shaped decode step, about 0.8 ms a layer on an H100,
issue 17), for a step that reads only the experts its rows chose. A
:class:`StackLayer` is the layer *index* and the whole stack instead: the expert
kernels read one expert's matrix (the grouped-GEMM tile loops), a gather of experts
(``blocks``) or one weight tile (the Pallas kernels, through their index maps) at
``(layer, expert)``, and no copy of the layer exists. FP8 stacks carry their layer the
same way (:class:`moejax.fp8_experts.Fp8Experts` ``layer``).

:func:`expert_matrix` is how every kernel reads one expert of any stack form: a plain
``[E, in, out]`` array (one layer handed in: an offload slot buffer, a gathered layer),
a :class:`StackLayer`, or :class:`~moejax.fp8_experts.Fp8Experts`.
:func:`layer_array` is the copy, for the paths that need the layer as one array
(``ragged_dot``; the biased ``dense`` and ``ragged_dot`` paths); none of them is chosen
automatically.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping

import jax
import jax.numpy as jnp
from jaxtyping import Array, Int, Shaped

from moejax.fp8_experts import Block, Fp8Experts, layer_expert_slab


@typing.no_type_check   # a pytree: JAX rebuilds it with placeholder leaves
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StackLayer:
    """Layer ``layer`` (an int32 scalar, traced or not) of ``stack [L, E, in, out]``,
    read where it lies. ``shape`` and ``dtype`` are the layer's (``[E, in, out]``), so a
    kernel that reads experts through :func:`expert_matrix` takes it as it takes a
    one-layer array."""

    stack: Shaped[Array, "L E i o"]
    layer: Int[Array, ""]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.stack.shape[1:]

    @property
    def dtype(self):
        return self.stack.dtype

    def expert(self, expert, dtype) -> jax.Array:
        """Expert ``expert``'s matrix ``[in, out]`` in ``dtype``: one dynamic slice of
        the stack at (layer, expert)."""
        return layer_expert_slab(self.stack, self.layer, expert).astype(dtype)

    def experts(self, ids: Int[Array, "n"], dtype) -> jax.Array:
        """Experts ``ids``'s matrices ``[n, in, out]``: one gather at (layer, ids)."""
        return self.stack[self.layer, ids].astype(dtype)

    def array(self) -> jax.Array:
        """The layer as one ``[E, in, out]`` array: the copy this view exists to avoid
        (:func:`layer_array`)."""
        return jax.lax.dynamic_index_in_dim(self.stack, self.layer, axis=0, keepdims=False)


ExpertStack = typing.Union[jax.Array, StackLayer, Fp8Experts]


def stack_layer(stack: jax.Array | Fp8Experts, layer) -> StackLayer | Fp8Experts:
    """Layer ``layer`` of ``stack`` (``[L, E, ...]``, or FP8 values and scales with the
    leading L) as a view."""
    layer = jnp.asarray(layer, jnp.int32)
    if isinstance(stack, Fp8Experts):
        return dataclasses.replace(stack, layer=layer)
    return StackLayer(stack, layer)


def expert_matrix(w: ExpertStack, expert, dtype) -> jax.Array:
    """Expert ``expert``'s matrix ``[in, out]`` of the stack ``w`` in ``dtype``
    (``expert`` static or traced; FP8: dequantized)."""
    if isinstance(w, (StackLayer, Fp8Experts)):
        return w.expert(expert, dtype)
    return jax.lax.dynamic_index_in_dim(w, expert, axis=0, keepdims=False).astype(dtype)


def expert_matrices(w: jax.Array | StackLayer, ids: Int[Array, "n"], dtype) -> jax.Array:
    """Experts ``ids``'s matrices ``[n, in, out]`` of a plain stack or a view, gathered."""
    if isinstance(w, StackLayer):
        return w.experts(ids, dtype)
    return w[ids].astype(dtype)


def layer_array(w: jax.Array | StackLayer) -> jax.Array:
    """A plain stack as it is; a view's layer copied out (module docstring)."""
    return w.array() if isinstance(w, StackLayer) else w


def is_view(w: typing.Any) -> bool:
    """Whether ``w`` is a layer of a stack read in place (a :class:`StackLayer`)."""
    return isinstance(w, StackLayer)


def wrap_layer(weights: Mapping[str, typing.Any], block: Block | None
               ) -> dict[str, typing.Any]:
    """One layer's expert weights as the expert compute takes them: ``w_gate`` / ``w_up``
    / ``w_down`` paired with their ``*_scale`` leaves into :class:`Fp8Experts` where the
    layer has them (``block``: ``ModelConfig.expert_fp8_block``; views of a stack become
    FP8 views of the same layer), the rest as they are."""
    names = ("w_gate", "w_up", "w_down")
    if not any(f"{name}_scale" in weights for name in names):
        return dict(weights)
    if block is None:
        raise ValueError("expert weights with FP8 block scales (w_gate_scale, ...) but no "
                         "block size: build the dispatcher with the config's "
                         "expert_fp8_block (weights_dtype='fp8')")
    out = {k: v for k, v in weights.items() if not k.endswith("_scale")}
    for name in names:
        values, scale = weights[name], weights[f"{name}_scale"]
        if isinstance(values, StackLayer):
            out[name] = Fp8Experts(values.stack, scale.stack, tuple(block), layer=values.layer)
        else:
            out[name] = Fp8Experts(values, scale, tuple(block))
    return out
