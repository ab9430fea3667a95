"""The MoE decoder (Qwen3-MoE and Mixtral) as one Flax NNX definition that every path runs.

:class:`MoEDecoder` holds the params (the nested layout of ``moejax.param_layout``:
every layer stacked on a leading L axis, matrices [in, out]) as ``nnx.Param`` s and
offers what the execution paths need: the embedding, the fused layer driver
(:meth:`MoEDecoder.run_layers`), the single-layer entry (:meth:`MoEDecoder.layer`),
the scoring forward (:meth:`MoEDecoder.score`) and the heads. The layer itself and
its two seams (attention kind, MoE dispatcher) are in ``moejax.layers``,
``moejax.attention_kinds`` and ``moejax.dispatch``.

Jitted code builds the module from a plain params dict with :func:`decoder` (an
``nnx.merge`` of the config's graph definition with the dict, at trace time), so a
backend can place, shard or split the dict as it likes: inside a ``shard_map`` the
merged module holds the local shards. A module built ``with_experts=False`` holds
everything but the expert weights, which its dispatcher then supplies.

Scoring input is a flat token array with segment ids and positions
(:class:`PackedBatch`): requests of different lengths share one batch without
padding, and attention is causal within a segment, block-locally
(``moejax.attention``).
"""

from __future__ import annotations

import dataclasses
import typing
import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from moejax import layers as layers_lib
from moejax import moe
from moejax.attention_kinds import PackedCausal
from moejax.config import ModelConfig
from moejax.dispatch import MoEDispatcher, StackedExperts, local_dispatcher
from moejax.fp8_experts import is_fp8_storage
from moejax.layers import LayerOutput, rms_norm
from moejax.param_layout import (ALL_EXPERT_KEYS, EXPERT_KEYS, EXPERT_SCALE_KEYS, Params,
                                 expert_names, param_shapes, shape_problems)


@typing.no_type_check   # a pytree: JAX rebuilds it with placeholder leaves
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedBatch:
    """One packed forward.

    tokens, positions, segment_ids: [T] int32 (segment_ids -1 marks padding);
    score_positions: [P] int32 flat indices whose next-token logits are read;
    score_token_ids: [P, C] int32 vocabulary ids whose logits are returned.
    """

    tokens: Int[Array | np.ndarray, "T"]
    positions: Int[Array | np.ndarray, "T"]
    segment_ids: Int[Array | np.ndarray, "T"]
    score_positions: Int[Array | np.ndarray, "P"]
    score_token_ids: Int[Array | np.ndarray, "P C"]


@dataclasses.dataclass(frozen=True)
class ForwardOptions:
    """Static choices of one compiled forward (part of the compile key)."""

    attn_block: int
    full_vocab: bool = True
    expert_impl: moe.ExpertImpl = "auto"
    tile_rows: int | tuple[int, int] | None = None   # None: grouped_gemm.TILE_ROWS
    # The k most likely vocabulary ids at each scoring position, with their logits
    # (prompt log-probabilities' alternatives); needs full_vocab.
    top_k: int = 0

    def __post_init__(self) -> None:
        if self.top_k < 0 or (self.top_k and not self.full_vocab):
            raise ValueError(f"top_k={self.top_k} needs full_vocab and must be >= 0")


@typing.no_type_check   # a pytree: JAX rebuilds it with placeholder leaves
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class VocabReadout:
    """What a scoring forward reads at its P scoring positions: the logits of the asked
    ids [P, C] f32; the log-sum-exp over the vocabulary [P] (``full_vocab``) or None; the
    ``top_k`` most likely ids [P, K] int32 and their logits [P, K] f32 (best first) or
    None. And beside them, the forward's load: the tokens each layer routed to each
    expert [L, E] int32 (:func:`expert_token_counts`; None from a driver that runs the
    layers itself). A rank's outputs stack on a new leading axis."""

    logits: jax.Array
    lse: jax.Array | None = None
    top_logits: jax.Array | None = None
    top_ids: jax.Array | None = None
    expert_tokens: jax.Array | None = None


def expert_token_counts(routing: moe.Routing, valid: jax.Array | None,
                        num_experts: int) -> Int[Array, "E"]:
    """The rows routed to each expert by one layer's ``routing`` ([n, k] choices): choices
    of valid rows (``valid`` [n] bool, None: all) with a nonzero weight (a dense layer
    routes with weight 0)."""
    taken = routing.weights != 0
    if valid is not None:
        taken = taken & valid[:, None]
    return jnp.zeros(num_experts, jnp.int32).at[routing.experts.reshape(-1)].add(
        taken.reshape(-1).astype(jnp.int32))


@typing.no_type_check   # a pytree: JAX rebuilds it with placeholder leaves
@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ScoreOutput:
    """The scoring forward's result: what it read at the scoring positions, and the
    attention kind and dispatcher carry after the last layer (an updated prefix pool,
    per-layer stats)."""

    readout: VocabReadout
    attn: Any
    moe_carry: Any


def last_layer_at_rows_only(batch: PackedBatch) -> bool:
    """Run the last layer at the scoring rows alone? Yes when they are few (P <= T/4):
    nothing after it reads the other rows."""
    return 4 * batch.score_positions.shape[0] <= batch.tokens.shape[0]


# ------------------------------------------------------------------ NNX model
class DecoderLayers(nnx.Module):
    """All L decoder layers, parameters stacked on a leading layer axis (names as in
    ``moejax.param_layout``; the expert weights may be left out)."""

    def __init__(self, layer_params: Mapping[str, Any], dtype: Any):
        self.names = tuple(layer_params)
        for name, value in layer_params.items():
            # FP8 expert matrices (or their bytes) and their float32 scales keep their dtypes.
            kept = name in EXPERT_SCALE_KEYS or is_fp8_storage(value.dtype)
            setattr(self, name, nnx.Param(jnp.asarray(value, None if kept else dtype)))

    def arrays(self) -> dict[str, jax.Array]:
        """Every stacked array (what the layer driver indexes)."""
        return {name: getattr(self, name)[...] for name in self.names}

    def experts(self) -> dict[str, jax.Array]:
        """The stacked expert weights [L, E, ...]."""
        if not all(name in self.names for name in EXPERT_KEYS):
            raise ValueError("this module was built without expert weights "
                             "(with_experts=False): pass a dispatcher whose source holds them")
        return {name: getattr(self, name)[...] for name in expert_names(self.names)}


class MoEDecoder(nnx.Module):
    """The decoder. Build it from a params dict (``MoEDecoder(cfg, params)``), with random
    weights (``MoEDecoder.random(cfg, seed)``), or inside jitted code from a placed dict
    (:func:`decoder`). ``params()`` returns the dict back.

    ``with_experts=False``: the module holds everything but the expert weights (a
    backend that keeps them elsewhere passes its own dispatcher)."""

    def __init__(self, cfg: ModelConfig, params: Params, dtype: Any = jnp.float32, *,
                 with_experts: bool = True):
        check_params(params, cfg, with_experts=with_experts)
        self.cfg = cfg
        self.with_experts = with_experts
        self.embed = nnx.Param(jnp.asarray(params["embed"], dtype))
        self.layers = DecoderLayers(params["layers"], dtype)
        self.final_norm = nnx.Param(jnp.asarray(params["final_norm"], dtype))
        self.lm_head = (None if cfg.tie_word_embeddings or cfg.num_labels
                        else nnx.Param(jnp.asarray(params["lm_head"], dtype)))
        # A sequence classifier's head (``*ForSequenceClassification``) instead.
        self.score_head = (nnx.Param(jnp.asarray(params["score"], dtype)) if cfg.num_labels
                           else None)

    @classmethod
    def random(cls, cfg: ModelConfig, seed: int = 0, dtype: Any = jnp.float32) -> "MoEDecoder":
        return cls(cfg, init_params(cfg, seed), dtype)

    def params(self) -> Params:
        out: Params = {"embed": self.embed[...], "layers": self.layers.arrays(),
                       "final_norm": self.final_norm[...]}
        if self.lm_head is not None:
            out["lm_head"] = self.lm_head[...]
        if self.score_head is not None:
            out["score"] = self.score_head[...]
        return out

    # ------------------------------------------------------------ the pieces
    def embed_tokens(self, tokens: Int[Array | np.ndarray, "*n"]) -> Float[Array, "*n d"]:
        """Token embeddings."""
        with jax.named_scope("embed"):
            return jnp.take(self.embed[...], tokens, axis=0)

    def local_dispatcher(self, expert_impl: moe.ExpertImpl = "auto",
                         tile_rows: int | tuple[int, int] | None = None) -> MoEDispatcher:
        """The dispatcher over this module's own (resident) experts, tokens local."""
        return local_dispatcher(StackedExperts(self.layers.experts()), self.cfg.num_experts,
                                expert_impl, tile_rows,
                                activation=moe.expert_activation_of(self.cfg),
                                fp8_block=self.cfg.expert_fp8_block)

    def run_layers(self, x: Float[Array, "n d"], attn, dispatcher: MoEDispatcher,
                   moe_carry: Any = None, **kwargs: Any) -> tuple[jax.Array, Any, Any, Any]:
        """The fused driver over layers [start, stop) (``moejax.layers.run_layers``; the
        carry defaults to the dispatcher's start)."""
        if moe_carry is None:
            moe_carry = dispatcher.init_carry()
        return layers_lib.run_layers(self.layers.arrays(), x, attn, dispatcher, moe_carry,
                                     self.cfg, **kwargs)

    def layer(self, index, x: Float[Array, "n d"], attn, dispatcher: MoEDispatcher,
              moe_carry: Any = None, **kwargs: Any) -> LayerOutput:
        """The single-layer entry: layer ``index`` on x (``moejax.layers.decoder_layer``
        keywords: ``rows``, ``routing``, ``psum_axis``)."""
        if moe_carry is None:
            moe_carry = dispatcher.init_carry()
        return layers_lib.layer(self.layers.arrays(), index, x, attn, dispatcher, moe_carry,
                                self.cfg, **kwargs)

    def final(self, x: Float[Array, "n d"]) -> Float[Array, "n d"]:
        """The final norm."""
        with jax.named_scope("norm"):
            return rms_norm(x, self.final_norm[...], self.cfg.rms_norm_eps)

    def head(self) -> Float[Array, "d H"]:
        """The output head [d, H]: the LM head over the vocabulary (the embeddings when
        tied), or a classifier's score head over its labels."""
        if self.score_head is not None:
            return self.score_head[...]
        return self.embed[...].T if self.cfg.tie_word_embeddings else self.lm_head[...]

    def vocab_logits(self, normed: Float[Array, "n d"]) -> Float[Array, "n V"]:
        """LM head over the whole vocabulary: final-normed hidden states -> [n, V] f32."""
        return jnp.dot(normed, self.head().astype(normed.dtype),
                       preferred_element_type=jnp.float32)

    def candidate_logits(self, hidden: Float[Array, "P d"], token_ids: Int[Array, "P C"],
                         full_vocab: bool, top_k: int = 0) -> VocabReadout:
        """Logits of ``token_ids`` [P, C] at final hidden states [P, d] (and with
        ``full_vocab`` the log-sum-exp [P], with ``top_k`` the k best ids and logits). With
        ``full_vocab`` the whole [P, V] row is computed (the log-softmax over the vocabulary
        needs it); otherwise only the C columns."""
        with jax.named_scope("lm_head"):     # labels the ops for profile attribution
            return self._candidate_logits(hidden, token_ids, full_vocab, top_k)

    def _candidate_logits(self, hidden: Float[Array, "P d"], token_ids: Int[Array, "P C"],
                          full_vocab: bool, top_k: int) -> VocabReadout:
        """:meth:`candidate_logits`' body (outside its named scope)."""
        if full_vocab:
            logits = self.vocab_logits(hidden)
            top_logits = top_ids = None
            if top_k:
                top_logits, top_ids = jax.lax.top_k(logits, top_k)
            return VocabReadout(jnp.take_along_axis(logits, token_ids, axis=1),
                                jax.nn.logsumexp(logits, -1), top_logits,
                                top_ids.astype(jnp.int32) if top_k else None)
        if self.score_head is None and self.cfg.tie_word_embeddings:
            columns = jnp.take(self.embed[...], token_ids, axis=0)         # [P, C, d]
        else:
            columns = jnp.take(self.head().T, token_ids, axis=0)           # [P, C, d]
        picked = jnp.einsum("pd,pcd->pc", hidden, columns.astype(hidden.dtype),
                            preferred_element_type=jnp.float32)
        return VocabReadout(picked)

    # ------------------------------------------------------------ scoring
    def score(self, batch: PackedBatch, opts: ForwardOptions, *, attn=None,
              dispatcher: MoEDispatcher | None = None, psum_axis: str | None = None
              ) -> ScoreOutput:
        """The packed forward to the scoring positions, which every scoring backend runs.

        ``attn``: the attention kind (default: packed causal over ``batch``; the prefix
        cache passes a pooled one); ``dispatcher``: the MoE seam (default: this module's
        experts, tokens local). The last layer runs at the scoring rows only when they
        are few (:func:`last_layer_at_rows_only`).
        """
        batch = jax.tree.map(jnp.asarray, batch)     # eager callers pass NumPy batches
        if attn is None:
            attn = PackedCausal.of(batch.positions, batch.segment_ids, opts.attn_block)
        if dispatcher is None:
            dispatcher = self.local_dispatcher(opts.expert_impl, opts.tile_rows)
        num_experts = self.cfg.num_experts
        x, attn, carry, counted = self.run_layers(
            self.embed_tokens(batch.tokens), attn, dispatcher, stop=self.cfg.num_layers - 1,
            psum_axis=psum_axis,
            observe=lambda _, routing, valid, __: expert_token_counts(routing, valid,
                                                                      num_experts))
        return self.finish(batch, opts, x, attn, dispatcher, carry, psum_axis=psum_axis,
                           expert_tokens=counted)

    def finish(self, batch: PackedBatch, opts: ForwardOptions, x: Float[Array, "T d"], attn,
               dispatcher: MoEDispatcher, moe_carry: Any = None, *,
               psum_axis: str | None = None, stack_offset: int = 0,
               expert_tokens: Int[Array, "Lm1 E"] | None = None) -> ScoreOutput:
        """The end of :meth:`score` on x [T, d] after every layer but the last: the last
        layer (at the scoring rows alone when they are few), the final norm and the
        candidate logits. A host-side driver that ran the other layers itself (the
        offload backend) calls it too, so both end the forward the same way.
        ``expert_tokens``: the other layers' routed tokens per expert; the readout's then
        adds the last layer's (the rows it ran)."""
        rows = batch.score_positions if last_layer_at_rows_only(batch) else None
        out = self.layer(self.cfg.num_layers - 1, x, attn, dispatcher, moe_carry, rows=rows,
                         psum_axis=psum_axis, stack_offset=stack_offset)
        x_rows = out.x if rows is not None else jnp.take(out.x, batch.score_positions, axis=0)
        readout = self.candidate_logits(self.final(x_rows), batch.score_token_ids,
                                        opts.full_vocab, opts.top_k)
        if expert_tokens is not None:
            last = expert_token_counts(out.routing, out.attn.valid_rows(rows),
                                       self.cfg.num_experts)
            readout = dataclasses.replace(readout, expert_tokens=jnp.concatenate(
                [expert_tokens, last[None]]))
        return ScoreOutput(readout=readout, attn=out.attn, moe_carry=out.moe_carry)

    def hidden_states(self, batch: PackedBatch, opts: ForwardOptions) -> Float[Array, "T d"]:
        """Every decoder layer over the batch -> [T, d] (before the final norm)."""
        batch = jax.tree.map(jnp.asarray, batch)     # eager callers pass NumPy batches
        attn = PackedCausal.of(batch.positions, batch.segment_ids, opts.attn_block)
        dispatcher = self.local_dispatcher(opts.expert_impl, opts.tile_rows)
        return self.run_layers(self.embed_tokens(batch.tokens), attn, dispatcher)[0]


# ------------------------------------------------------------------ from a params dict
@functools.lru_cache(maxsize=None)
def graph_def(cfg: ModelConfig, with_experts: bool = True) -> Any:
    """The NNX graph definition of ``MoEDecoder(cfg)`` (built abstractly: no memory)."""
    shapes = param_shapes(cfg)
    if not with_experts:
        shapes["layers"] = {k: v for k, v in shapes["layers"].items()
                            if k not in ALL_EXPERT_KEYS}
    abstract = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, jnp.float32), shapes,
                            is_leaf=lambda s: isinstance(s, tuple))
    module = nnx.eval_shape(lambda: MoEDecoder(cfg, jax.tree.map(jnp.zeros_like, abstract),
                                               with_experts=with_experts))
    return nnx.graphdef(module)


def decoder(cfg: ModelConfig, params: Params, *, with_experts: bool | None = None) -> MoEDecoder:
    """The module over a params dict as placed (device arrays, tracers, local shards), by
    ``nnx.merge``: no copy. ``with_experts`` defaults to whether the dict has them."""
    if with_experts is None:
        with_experts = all(k in params["layers"] for k in EXPERT_KEYS)
    # Tracers and device arrays pass as they are; an eager caller's NumPy goes to the device.
    return nnx.merge(graph_def(cfg, with_experts), jax.tree.map(jnp.asarray, params))


# ------------------------------------------------------------------ functional entries
def forward(params: Params, batch: PackedBatch, cfg: ModelConfig,
            opts: ForwardOptions) -> tuple[jax.Array, jax.Array | None]:
    """``MoEDecoder.score`` on a params dict: ([P, C] logits f32, [P] logsumexp or None)."""
    readout = decoder(cfg, params).score(batch, opts).readout
    return readout.logits, readout.lse


def score_readout(params: Params, batch: PackedBatch, cfg: ModelConfig,
                  opts: ForwardOptions) -> VocabReadout:
    """``MoEDecoder.score`` on a params dict: what it reads at the scoring positions."""
    return decoder(cfg, params).score(batch, opts).readout


def full_logits(params: Params, batch: PackedBatch, cfg: ModelConfig,
                opts: ForwardOptions) -> jax.Array:
    """Logits over the vocabulary at every position [T, V] (tests and debugging)."""
    module = decoder(cfg, params)
    return module.vocab_logits(module.final(module.hidden_states(batch, opts)))


# ------------------------------------------------------------------ params
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


def check_params(params: Params, cfg: ModelConfig, *, with_experts: bool = True) -> None:
    """Raise ValueError naming every missing, unexpected or mis-shaped parameter
    (``with_experts=False``: the expert weights must be absent)."""
    problems = []
    if not with_experts:
        layers = params.get("layers", {})
        problems = [f"layers.{k}: expert weights in a module built without experts"
                    for k in ALL_EXPERT_KEYS if k in layers]
    leave_out = () if with_experts else tuple(f"layers.{k}" for k in ALL_EXPERT_KEYS)
    problems += shape_problems(params, cfg, leave_out)
    if problems:
        raise ValueError("params do not match the model config: " + "; ".join(problems))
