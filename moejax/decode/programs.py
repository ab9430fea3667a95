"""The compiled programs of a paged step, fused and layer by layer.

A step runs a :class:`PagedBatch`: B rows of C tokens (prompt chunks, C = a bucket of
``max_prefill_tokens``; or one decode token per row, C = 1) over the paged pool. It
returns a :class:`StepResult`: each row's next token (from the logits of its ``last``
token), the step's new keys/values (the host writes them to the pool afterwards), and
the routing of every token at every layer (top-k ids and gate weights, and the router
inputs when asked) — read from the same programs, so tracing never changes a token.

* :func:`fused_step` — every layer in one program (``moejax.layers.run_layers``).
* layerwise — the host calls, per layer, :func:`attention_program` (attention, the
  residual, the MoE norm and the router: it returns the routing) and then
  :func:`moe_program` with the expert weights it chose and the routing it wants; the
  embedding and the head are programs of their own. The layer index is an argument,
  so one compile serves every layer.

Both are the one decoder layer of :mod:`moejax.layers` (``attention_block`` +
``route_layer`` + the dispatcher): they give identical tokens.
"""

from __future__ import annotations

import collections
import dataclasses
import typing
from typing import Any

import jax
import jax.numpy as jnp
from jaxtyping import Array, Bool, Float, Int

from moejax import layers as layers_lib
from moejax import model, moe, sampling
from moejax.config import ModelConfig
from moejax.decode.paged import PagedRows
from moejax.kv import KVPool
from moejax.dispatch import GivenExperts, StackedExperts, local_dispatcher
from moejax.moe import ExpertImpl
from moejax.param_layout import ALL_EXPERT_KEYS, Params


@dataclasses.dataclass(frozen=True)
class StepOptions:
    """Static choices of the step programs (part of the compile key)."""

    expert_impl: ExpertImpl = "auto"
    tile_rows: int | tuple[int, int] | None = None
    router_inputs: bool = False
    # KV blocks the paged attention reads per iteration of its context loop: one
    # iteration per 128 tokens of the step's longest context.
    pool_chunk_blocks: int = 8


@typing.no_type_check   # a pytree: JAX rebuilds it with placeholder leaves
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PagedBatch:
    """One step's rows, built on the host (NumPy) and placed by the runner.

    tokens, positions, valid, write_slots: [B·C] (row-major: row b's tokens at
    b·C .. b·C + C - 1; write slot S = not written); segments [B]: the sequence of each
    row (consecutive rows of one sequence's prompt chunk share it; attention within a
    step stays inside a segment); block_tables [B, MB]; context_len, last, counters: [B]
    (``last``: the flat index of the token whose logits choose row b's next token;
    ``counters``: tokens row b has generated, its sampling key's step; only the last
    row of a segment's are used).
    """

    tokens: jax.Array
    positions: jax.Array
    valid: jax.Array
    write_slots: jax.Array
    segments: jax.Array
    block_tables: jax.Array
    context_len: jax.Array
    last: jax.Array
    counters: jax.Array

    @property
    def rows(self) -> int:
        return int(self.block_tables.shape[0])

    @property
    def chunk(self) -> int:
        return int(self.tokens.shape[0]) // self.rows


@typing.no_type_check   # a pytree: JAX rebuilds it with placeholder leaves
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class StepResult:
    """tokens [B]; new_keys/new_values [L, B·C, n_kv, h]; experts [L, B·C, k] int32,
    weights [L, B·C, k] f32; router_inputs [L, B·C, d] (or None)."""

    tokens: jax.Array
    new_keys: jax.Array
    new_values: jax.Array
    experts: jax.Array
    weights: jax.Array
    router_inputs: jax.Array | None = None


_COMPILES: collections.Counter = collections.Counter()


def compiled_program_counts() -> dict[str, int]:
    """How many step programs have been compiled so far, by name (one per shape bucket
    and model, never one per step or per layer)."""
    return dict(_COMPILES)


def _observer(router_inputs: bool):
    def observe(layer, routing: moe.Routing, valid, router_input):
        seen = (routing.experts, routing.weights)
        return seen + (router_input,) if router_inputs else seen
    return observe


def _attention_kind(kv: KVPool, batch: PagedBatch, opts: StepOptions) -> PagedRows:
    return PagedRows.of(kv, batch.positions, batch.valid, batch.segments, batch.block_tables,
                        batch.context_len, opts.pool_chunk_blocks)


def _next_tokens(module: model.MoEDecoder, x: Float[Array, "BC d"], batch: PagedBatch,
                 samp: sampling.SamplingParams) -> jax.Array:
    logits = module.vocab_logits(module.final(jnp.take(x, batch.last, axis=0)))
    return sampling.next_tokens(logits, samp, batch.counters)


# ----------------------------------------------------------------------------- fused
def paged_forward(module: model.MoEDecoder, kv: KVPool, batch: PagedBatch,
                  samp: sampling.SamplingParams, dispatcher: Any, opts: StepOptions
                  ) -> tuple[StepResult, Any]:
    """Every layer of one paged step with the MoE seam ``dispatcher`` (local experts, or an
    all-to-all transport inside a shard_map) -> (the result, the dispatcher's carry)."""
    x, attn, moe_carry, seen = module.run_layers(
        module.embed_tokens(batch.tokens), _attention_kind(kv, batch, opts), dispatcher,
        observe=_observer(opts.router_inputs))
    result = StepResult(tokens=_next_tokens(module, x, batch, samp), new_keys=attn.new_keys,
                        new_values=attn.new_values, experts=seen[0], weights=seen[1],
                        router_inputs=seen[2] if opts.router_inputs else None)
    return result, moe_carry


def count_compile(program: str) -> None:
    """Count one trace of ``program`` (its body runs in Python once per compile)."""
    _COMPILES[program] += 1


def fused_step(params: Params, kv: KVPool, batch: PagedBatch, samp: sampling.SamplingParams,
               *, cfg: ModelConfig, opts: StepOptions) -> StepResult:
    """Every layer of one paged step in one program, experts resident."""
    count_compile("fused_step")
    module = model.decoder(cfg, params)
    dispatcher = module.local_dispatcher(opts.expert_impl, opts.tile_rows)
    return paged_forward(module, kv, batch, samp, dispatcher, opts)[0]


FUSED_STEP = jax.jit(fused_step, static_argnames=("cfg", "opts"))


# ----------------------------------------------------------------------------- layerwise
def begin_program(params: Params, kv: KVPool, batch: PagedBatch, *, cfg: ModelConfig,
                  opts: StepOptions) -> tuple[jax.Array, PagedRows]:
    """The embedded tokens [B·C, d] and the attention kind of a layerwise step, without
    the pool (a program output is a new buffer: returning the pool would copy it)."""
    _COMPILES["layerwise_begin"] += 1
    attn = dataclasses.replace(_attention_kind(kv, batch, opts), pool_keys=None,
                               pool_values=None)
    return model.decoder(cfg, params).embed_tokens(batch.tokens), attn


def attention_program(params: Params, layer: Int[Array, ""], x: Float[Array, "BC d"],
                      kv: KVPool, attn: PagedRows, *, cfg: ModelConfig
                      ) -> tuple[jax.Array, Any, jax.Array, moe.Routing]:
    """Layer ``layer``'s attention half and router over the pool ``kv``: (x after
    attention, the kind's carry with the layer's keys/values kept, the normed MoE input,
    the routing)."""
    _COMPILES["layerwise_attention"] += 1
    p = layers_lib.layer_slice(params["layers"], layer)
    attn = dataclasses.replace(attn, pool_keys=kv.keys, pool_values=kv.values)
    x, attn, moe_in, _ = layers_lib.attention_block(p, layer, x, attn, cfg)
    return x, attn.carry(), moe_in, layers_lib.route_layer(p, moe_in, cfg, layer)


def moe_program(experts: dict[str, jax.Array], layer: Int[Array, ""] | None,
                x: Float[Array, "BC d"], moe_in: Float[Array, "BC d"], routing: moe.Routing,
                valid: Bool[Array, "BC"], *, opts: StepOptions,
                activation: moe.ClampedSwiGLU | None = None) -> jax.Array:
    """x + the MoE output under ``routing``, with ``experts`` stacked [L', E', ...] (the
    resident stack) at ``layer``, or, with ``layer`` None, one layer's [E', ...] (an
    offload slot buffer, with its own expert numbering) (``activation``: the family's
    expert activation, ``moe.expert_activation_of``)."""
    _COMPILES["layerwise_moe"] += 1
    if layer is None:
        source, num_experts = GivenExperts(experts), experts["w_gate"].shape[0]
    else:
        source, num_experts = StackedExperts(experts), experts["w_gate"].shape[1]
    dispatcher = local_dispatcher(source, num_experts, opts.expert_impl, opts.tile_rows,
                                  activation=activation)
    y, _ = dispatcher.apply(layer, moe_in, routing, valid, dispatcher.init_carry())
    return x + y


def head_program(params: Params, x: Float[Array, "BC d"], batch: PagedBatch,
                 samp: sampling.SamplingParams, *, cfg: ModelConfig) -> jax.Array:
    """Each row's next token from the final hidden states."""
    _COMPILES["layerwise_head"] += 1
    return _next_tokens(model.decoder(cfg, params, with_experts=False), x, batch, samp)


BEGIN = jax.jit(begin_program, static_argnames=("cfg", "opts"))
ATTENTION = jax.jit(attention_program, static_argnames=("cfg",))
MOE = jax.jit(moe_program, static_argnames=("opts", "activation"))
HEAD = jax.jit(head_program, static_argnames=("cfg",))


def dense_params(params: Params) -> Params:
    """The params without the expert weights (what the layerwise head and attention read)."""
    return {**params, "layers": {k: v for k, v in params["layers"].items()
                                 if k not in ALL_EXPERT_KEYS}}


@dataclasses.dataclass
class LayerwiseStep:
    """The state of one layerwise step between layers, for a host-side driver: the
    residual ``x`` and attention kind, and what each layer routed."""

    x: jax.Array
    attn: PagedRows
    experts: list[jax.Array] = dataclasses.field(default_factory=list)
    weights: list[jax.Array] = dataclasses.field(default_factory=list)
    router_inputs: list[jax.Array] = dataclasses.field(default_factory=list)

    def result(self, tokens: jax.Array, router_inputs: bool) -> StepResult:
        return StepResult(tokens=tokens, new_keys=self.attn.new_keys,
                          new_values=self.attn.new_values, experts=jnp.stack(self.experts),
                          weights=jnp.stack(self.weights),
                          router_inputs=jnp.stack(self.router_inputs) if router_inputs else None)
