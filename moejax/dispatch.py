"""The MoE seam of the decoder layer: where the expert weights are, and how the routed
tokens reach them (in the manner of vLLM's modular fused-MoE kernel).

The layer routes (``moe.route``, or a routing override); a :class:`MoEDispatcher`
then runs ``prepare`` (dispatch) → ``experts`` → ``finalize`` (combine). It is made of
two parts, and a backend supplies only the part that differs:

* an **expert source** — where this layer's expert weights are: the resident stack
  (:class:`StackedExperts`), one layer handed in by a host-side driver
  (:class:`GivenExperts`: the offload window), or shards gathered a layer ahead
  (:class:`GatheredAhead`: ``async_ep``; the carry holds the gathered layer);
* a **token transport** — how the tokens reach the weights: locally
  (:class:`LocalTokens`: sort by expert, grouped GEMM, unsort and weigh; with
  ``psum_axis`` for tensor parallelism, where each device holds a slice of every
  expert), every token on every device with each device running the experts it owns
  (:class:`OwnedExpertTokens`: ``tp_ep``), every rank's tokens gathered to every device
  holding a slice of every expert (:class:`GatheredTokens`: ``dp_tp``), or all-to-all
  over devices with a replica router (``moejax.backends.sync_ep.AllToAllTokens``).

Both parts may keep a *carry* through the layer loop (gathered weights, per-layer
stats); :meth:`MoEDispatcher.init_carry` gives its start. The two seams are the Protocols
:class:`ExpertSource` and :class:`TokenTransport`; the experts kernel a transport runs is
chosen by name from ``moe.EXPERT_KERNELS``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, ClassVar, Protocol, runtime_checkable

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float

from moejax import moe
from moejax.expert_views import stack_layer, wrap_layer
from moejax.param_layout import EXPERT_BIAS_KEYS

# w_gate, w_up [E, d, f]; w_down [E, f, d]: arrays, or one layer of a stack read in place
# (moejax.expert_views.StackLayer); kept in FP8: also w_gate_scale, w_up_scale,
# w_down_scale (moejax.fp8_experts); GPT-OSS: the biases b_gate, b_up [E, f], b_down [E, d].
ExpertWeights = Mapping[str, Any]


# --------------------------------------------------------------------- the seams
@runtime_checkable    # the tests' type checks ask isinstance of a dispatcher's parts
class ExpertSource(Protocol):
    """Where each layer's expert weights are. ``communicates``: whether fetching them runs
    a collective or keeps state in the carry (a layer without routed experts may then not
    be skipped)."""

    communicates: bool

    def init_carry(self) -> Any: ...

    def layer_experts(self, layer: Any, carry: Any) -> tuple[ExpertWeights, Any]:
        """Layer ``layer``'s experts [E, ...] (layer: an int, or a traced index), and the
        carry for the next layer."""
        ...


@runtime_checkable
class TokenTransport(Protocol):
    """How the routed tokens reach the expert weights and come back: ``prepare``
    (dispatch), ``experts`` (the experts kernel on what arrived), ``finalize`` (combine).
    ``communicates``: whether any of them runs a collective or keeps state in the carry."""

    communicates: bool

    def init_carry(self) -> Any: ...

    def prepare(self, x: jax.Array, routing: moe.Routing, valid: jax.Array | None) -> Any: ...

    def experts(self, prepared: Any, weights: ExpertWeights) -> jax.Array: ...

    def finalize(self, y: jax.Array, prepared: Any, routing: moe.Routing,
                 valid: jax.Array | None, carry: Any) -> tuple[jax.Array, Any]: ...


# --------------------------------------------------------------------- sources
@dataclasses.dataclass(frozen=True)
class StackedExperts:
    """Every layer's experts on the device, stacked [L, E, ...]: layer l is read in place,
    each matrix as a view of the stack at l (``moejax.expert_views``: slicing the layer
    out would copy it whole per layer per step); the per-expert biases [L, E, f], small,
    are sliced. ``first_layer``: the global index of the stack's first layer, for a
    pipeline stage holding some layers only."""

    stacked: ExpertWeights
    first_layer: int = 0
    communicates: ClassVar[bool] = False

    def init_carry(self) -> Any:
        return ()

    def layer_experts(self, layer, carry: Any) -> tuple[ExpertWeights, Any]:
        index = layer - self.first_layer
        return {name: (jax.lax.dynamic_index_in_dim(w, index, axis=0, keepdims=False)
                       if name in EXPERT_BIAS_KEYS else stack_layer(w, index))
                for name, w in self.stacked.items()}, carry


@dataclasses.dataclass(frozen=True)
class SlicedExperts(StackedExperts):
    """The stacked experts with each layer sliced out whole (``stack[l]``): XLA copies the
    layer per layer per step. Never used to serve; it is the before of in-place reading,
    for ``benchmarks/decode_step.py`` and the tests that show the copy exists."""

    def layer_experts(self, layer, carry: Any) -> tuple[ExpertWeights, Any]:
        index = layer - self.first_layer
        return {name: jax.lax.dynamic_index_in_dim(w, index, axis=0, keepdims=False)
                for name, w in self.stacked.items()}, carry


@dataclasses.dataclass(frozen=True)
class GivenExperts:
    """One layer's experts [E, ...], handed in by whoever drives the layer (the offload
    window, the last layer of a gathered stack)."""

    weights: ExpertWeights
    communicates: ClassVar[bool] = False

    def init_carry(self) -> Any:
        return ()

    def layer_experts(self, layer, carry: Any) -> tuple[ExpertWeights, Any]:
        return self.weights, carry


@dataclasses.dataclass(frozen=True)
class GatheredAhead:
    """Expert shards [L, E/G, ...] per device, all-gathered over ``axis`` one layer
    ahead (inside a ``shard_map``): the carry holds the gathered experts of the layer
    about to run; fetching them first issues the gather of the next layer, so the
    scheduler can overlap it with this layer's compute. ``first``: layer 0's experts,
    kept whole (nothing to hide their gather under). ``num_layers``: the stack's depth
    (no gather is issued past it)."""

    shards: ExpertWeights
    first: ExpertWeights
    axis: str
    num_experts: int
    num_layers: int
    communicates: ClassVar[bool] = True     # the all-gather, and the carried layer

    def init_carry(self) -> Any:
        return dict(self.first)

    def layer_experts(self, layer, carry: Any) -> tuple[ExpertWeights, Any]:
        if isinstance(layer, int) and layer + 1 >= self.num_layers:
            return carry, carry          # the last layer: nothing left to gather
        return carry, gather_layer(self.shards, layer + 1, self.axis, self.num_experts)


def gather_layer(shards: ExpertWeights, layer, axis: str, num_experts: int
                 ) -> dict[str, jax.Array]:
    """Inside a shard_map: all-gather layer ``layer`` of the local expert shards
    [L, E/G, ...] into the whole layer [E, ...] (padding experts cut off)."""
    out = {}
    for name, local in shards.items():
        piece = jax.lax.dynamic_index_in_dim(local, layer, axis=0, keepdims=False)
        out[name] = jax.lax.all_gather(piece, axis, axis=0, tiled=True)[:num_experts]
    return out


# --------------------------------------------------------------------- transports
@dataclasses.dataclass(frozen=True)
class LocalTokens:
    """Tokens stay where they are: sort the routed rows by expert, run the grouped
    SwiGLU, unsort and weigh. ``psum_axis``: the outputs are partial sums over that mesh
    axis (tensor parallelism: each device holds an f/G slice of every expert; the
    combine is linear, so summing combined [n, d] outputs moves k times less data).
    ``fp8_block``: the block of the FP8 scales of experts kept in FP8
    (``ModelConfig.expert_fp8_block``; the weights then carry ``*_scale`` leaves)."""

    num_experts: int
    impl: moe.ExpertImpl = "auto"
    tile_rows: int | tuple[int, int] | None = None
    psum_axis: str | None = None
    activation: moe.ClampedSwiGLU | None = None   # GPT-OSS (None: silu SwiGLU)
    fp8_block: tuple[int, int] | None = None

    @property
    def communicates(self) -> bool:
        return self.psum_axis is not None

    def init_carry(self) -> Any:
        return ()

    def prepare(self, x: Float[Array, "n d"], routing: moe.Routing,
                valid: Bool[Array, "n"] | None) -> moe.Permutation:
        return moe.permute(x, routing, self.num_experts, valid)

    def experts(self, prepared: moe.Permutation, weights: ExpertWeights) -> jax.Array:
        weights = wrap_layer(weights, self.fp8_block)     # FP8 stacks with their scales
        biases = {k: weights[k] for k in EXPERT_BIAS_KEYS if k in weights} or None
        return moe.expert_compute(prepared, weights["w_gate"], weights["w_up"],
                                  weights["w_down"], impl=self.impl, tile_rows=self.tile_rows,
                                  biases=biases, activation=self.activation)

    def finalize(self, y: jax.Array, prepared: moe.Permutation, routing: moe.Routing,
                 valid: jax.Array | None, carry: Any) -> tuple[jax.Array, Any]:
        out = moe.combine(y, prepared, routing, valid)
        if self.psum_axis is not None:
            out = jax.lax.psum(out, self.psum_axis)
        return out, carry


@dataclasses.dataclass(frozen=True)
class OwnedExpertTokens(LocalTokens):
    """Every device holds every token (tensor-parallel attention replicates them) and
    owns ``num_experts`` experts of its own, the block [g·E_l, (g+1)·E_l) of the global
    ids (g: its index on ``psum_axis``). A routed row whose expert another device owns
    gets the sentinel id, sorts after every owned row and is computed by no group (its
    output row is zero), so each device runs only its own experts' rows; the combined
    outputs are partial sums, all-reduced over ``psum_axis``. The TP+EP baseline's MoE."""

    def prepare(self, x: Float[Array, "n d"], routing: moe.Routing,
                valid: Bool[Array, "n"] | None) -> moe.Permutation:
        first = jax.lax.axis_index(self.psum_axis) * self.num_experts
        local = routing.experts - first
        owned = (local >= 0) & (local < self.num_experts)
        mine = dataclasses.replace(routing, experts=jnp.where(owned, local, self.num_experts))
        return moe.permute(x, mine, self.num_experts, valid)


@dataclasses.dataclass(frozen=True)
class GatheredTokens(LocalTokens):
    """Data-parallel attention before tensor-parallel experts: each device holds its own
    rank's tokens and an f/G slice of every expert. The rank's rows and routing are
    all-gathered over ``psum_axis`` (every device then holds every rank's tokens), each
    device runs its slice of every routed expert on all of them, and the combined
    outputs, partial sums over f, are reduce-scattered back: each rank receives the sum
    for its own rows. The DP+TP baseline's MoE."""

    def prepare(self, x: Float[Array, "n d"], routing: moe.Routing,
                valid: Bool[Array, "n"] | None) -> tuple[moe.Permutation, moe.Routing, Any]:
        axis = self.psum_axis
        gathered = moe.Routing(
            weights=jax.lax.all_gather(routing.weights, axis, tiled=True),
            experts=jax.lax.all_gather(routing.experts, axis, tiled=True))
        every_valid = None if valid is None else jax.lax.all_gather(valid, axis, tiled=True)
        every_x = jax.lax.all_gather(x, axis, tiled=True)
        return moe.permute(every_x, gathered, self.num_experts, every_valid), gathered, \
            every_valid

    def experts(self, prepared: Any, weights: ExpertWeights) -> jax.Array:
        return super().experts(prepared[0], weights)

    def finalize(self, y: jax.Array, prepared: Any, routing: moe.Routing,
                 valid: jax.Array | None, carry: Any) -> tuple[jax.Array, Any]:
        perm, gathered, every_valid = prepared
        out = moe.combine(y, perm, gathered, every_valid)          # [G·n, d], partial in f
        return jax.lax.psum_scatter(out, self.psum_axis, scatter_dimension=0,
                                    tiled=True), carry


# --------------------------------------------------------------------- the dispatcher
@dataclasses.dataclass(frozen=True)
class MoEDispatcher:
    """An expert source and a token transport (module docstring). ``apply`` is what the
    decoder layer calls after routing."""

    source: ExpertSource
    transport: TokenTransport

    def init_carry(self) -> Any:
        return self.source.init_carry(), self.transport.init_carry()

    @property
    def skippable(self) -> bool:
        """May a layer without routed experts skip ``apply`` (under a ``lax.cond``)? Only
        when nothing in it communicates or carries state (local tokens, no partial sums,
        weights resident or handed in): a collective must run on every device alike."""
        return not (self.source.communicates or self.transport.communicates)

    def apply(self, layer, x: Float[Array, "n d"], routing: moe.Routing,
              valid: Bool[Array, "n"] | None, carry: Any) -> tuple[jax.Array, Any]:
        """The MoE output [n, d] of the normed x [n, d] under ``routing``, and the carry."""
        source_carry, transport_carry = carry
        weights, source_carry = self.source.layer_experts(layer, source_carry)
        prepared = self.transport.prepare(x, routing, valid)
        y = self.transport.experts(prepared, weights)
        out, transport_carry = self.transport.finalize(y, prepared, routing, valid,
                                                       transport_carry)
        return out, (source_carry, transport_carry)


def local_dispatcher(source: ExpertSource, num_experts: int, impl: moe.ExpertImpl = "auto",
                     tile_rows: int | tuple[int, int] | None = None,
                     psum_axis: str | None = None,
                     activation: moe.ClampedSwiGLU | None = None,
                     fp8_block: tuple[int, int] | None = None) -> MoEDispatcher:
    """A dispatcher whose tokens stay on their device (``activation``: the family's expert
    activation, ``moe.expert_activation_of(cfg)``; expert biases come with the weights;
    ``fp8_block``: ``cfg.expert_fp8_block`` where the experts are kept in FP8)."""
    return MoEDispatcher(source=source, transport=LocalTokens(num_experts, impl, tile_rows,
                                                              psum_axis, activation,
                                                              fp8_block))
