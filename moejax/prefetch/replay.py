"""Layer states of traced requests, replayed through the model.

An expert trace records each token's routing and router input (``Norm_l(r_l)``), but not
the post-attention residual ``r_l`` itself, which every next-layer predictor reads
(the norm divides its scale away). :func:`replay` runs the traced tokens (prompt, then
the generated tokens that were fed back) through the model's own decoder layer
(``moejax.layers``: attention block, router, dispatcher), requests packed in order into
attention blocks (each its own segment, positions from 0, never across a block's end; the
block holds the longest, :func:`replay_block`), and returns per layer and token:
``r_l``, the router input, the top-k ids and weights and the router's full distribution.
A causal forward over a sequence computes at each position what decode computed for that
token, so the decode positions of the replay are the decode steps of the trace
(:func:`check_against_trace` holds the replay to the trace's own top-k ids).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int

from moejax import attention
from moejax import layers as layers_lib
from moejax import model as model_lib
from moejax.attention_kinds import PackedCausal
from moejax.config import ModelConfig
from moejax.param_layout import Params
from moejax.traces import RequestTrace

# Replayed rows per program: ``ROWS_TOKENS // block`` blocks run together (one compile
# per block size; a shorter last program is padded with empty blocks).
ROWS_TOKENS = 4096
BLOCK_MULTIPLE = 16


def replay_block(tokens: int) -> int:
    """The attention block of a replay whose longest request runs ``tokens`` tokens: the
    smallest multiple of ``BLOCK_MULTIPLE`` that holds them and that the attention tiling
    of its size (``moejax.attention.tiling_for``) cuts into whole tiles. Up to 128
    tokens any multiple of 16 is one tile; beyond, blocks are cut into 128-row sub-blocks
    (64 at 256), and past 2048 into 512-row flash chunks (a 135-token request gets 256,
    not 144)."""
    if tokens < 1:
        raise ValueError(f"a replayed request runs at least one token, got {tokens}")
    block = -(-tokens // BLOCK_MULTIPLE) * BLOCK_MULTIPLE
    while block % attention.tiling_for(block).sub:
        block += BLOCK_MULTIPLE
    return block


@dataclasses.dataclass(frozen=True)
class LayerStates:
    """Per-layer states of T replayed tokens (float32, layer-major like the traces).

    residual [L, T, d]: r_l, layer l's post-attention residual; router_input [L, T, d]:
    Norm_l(r_l); experts [L, T, k] int32 and weights [L, T, k]: the router's top-k;
    probs [L, T, E]: its softmax over every expert; decode [T] bool: the token is a
    decode step of its request (not a prompt token); request [T] int32: which request.
    """

    residual: np.ndarray
    router_input: np.ndarray
    experts: np.ndarray
    weights: np.ndarray
    probs: np.ndarray
    decode: np.ndarray
    request: np.ndarray

    @property
    def num_tokens(self) -> int:
        return int(self.decode.shape[0])

    def take(self, mask: np.ndarray) -> "LayerStates":
        """The tokens where ``mask`` [T] is true."""
        return LayerStates(residual=self.residual[:, mask], router_input=self.router_input[:, mask],
                           experts=self.experts[:, mask], weights=self.weights[:, mask],
                           probs=self.probs[:, mask], decode=self.decode[mask],
                           request=self.request[mask])


def sequence_tokens(req: RequestTrace) -> np.ndarray:
    """The tokens that ran through the model for one traced request: its prompt, then
    every generated token but the last (the last was never fed back)."""
    return np.concatenate([req.prompt_token_ids, req.generated_token_ids[:-1]]).astype(np.int32)


def pack_blocks(lengths: Sequence[int], block: int) -> list[list[int]]:
    """Runs of ``lengths`` tokens packed in order into blocks of ``block`` tokens: each
    block lists its runs' indices; a run starts a new block when the current one cannot
    hold it (so concatenating the blocks keeps the runs' order)."""
    if any(n > block for n in lengths):
        raise ValueError(f"a run of {max(lengths)} tokens does not fit a block of {block}")
    blocks: list[list[int]] = []
    room = 0
    for i, n in enumerate(lengths):
        if n > room:
            blocks.append([])
            room = block
        blocks[-1].append(i)
        room -= n
    return blocks


def _replay_rows(params: Params, tokens: Int[Array, "T"], positions: Int[Array, "T"],
                 segments: Int[Array, "T"], *, cfg: ModelConfig, block: int
                 ) -> tuple[jax.Array, ...]:
    module = model_lib.decoder(cfg, params)
    x = module.embed_tokens(tokens)
    attn = PackedCausal.of(positions, segments, block)
    dispatcher = module.local_dispatcher()
    stacked = module.layers.arrays()
    seen = []
    for layer in range(cfg.num_layers):
        p = layers_lib.layer_slice(stacked, layer)
        residual, attn, moe_in, valid = layers_lib.attention_block(p, layer, x, attn, cfg)
        routing = layers_lib.route_layer(p, moe_in, cfg, layer)
        y, _ = dispatcher.apply(layer, moe_in, routing, valid, dispatcher.init_carry())
        x = residual + y
        seen.append((residual.astype(jnp.float32), moe_in.astype(jnp.float32),
                     routing.experts, routing.weights, routing.probs))
    return tuple(jnp.stack(parts) for parts in zip(*seen))


_REPLAY_ROWS = jax.jit(_replay_rows, static_argnames=("cfg", "block"))


def replay(cfg: ModelConfig, params: Params, requests: Sequence[RequestTrace]) -> LayerStates:
    """Every token of ``requests`` (requests that failed are skipped) through the model
    -> their :class:`LayerStates`, in request order."""
    runs = [(i, sequence_tokens(req), len(req.prompt_token_ids))
            for i, req in enumerate(requests) if req.ok]
    if not runs:
        raise ValueError("no request to replay: every traced request failed or none was given")
    longest = max(len(tokens) for _, tokens, _ in runs)
    block = replay_block(longest)
    blocks = pack_blocks([len(seq) for _, seq, _ in runs], block)
    per_batch = max(1, ROWS_TOKENS // block)
    parts: list[tuple[np.ndarray, ...]] = []
    for start in range(0, len(blocks), per_batch):
        tokens = np.zeros((per_batch, block), np.int32)
        positions = np.zeros((per_batch, block), np.int32)
        segments = np.full((per_batch, block), -1, np.int32)
        for row, members in enumerate(blocks[start:start + per_batch]):
            offset = 0
            for i in members:
                seq = runs[i][1]
                end = offset + len(seq)
                tokens[row, offset:end] = seq
                positions[row, offset:end] = np.arange(len(seq))
                segments[row, offset:end] = i
                offset = end
        out = jax.device_get(_REPLAY_ROWS(params, tokens.reshape(-1), positions.reshape(-1),
                                          segments.reshape(-1), cfg=cfg, block=block))
        keep = segments.reshape(-1) >= 0
        parts.append(tuple(np.asarray(a)[:, keep] for a in out))
    residual, router_input, experts, weights, probs = (np.concatenate(p, axis=1)
                                                       for p in zip(*parts))
    decode = np.concatenate([np.arange(len(seq)) >= prompt for _, seq, prompt in runs])
    request = np.concatenate([np.full(len(seq), i, np.int32) for i, seq, _ in runs])
    return LayerStates(residual=residual, router_input=router_input, experts=experts,
                       weights=weights, probs=probs, decode=decode, request=request)


def check_against_trace(states: LayerStates, requests: Sequence[RequestTrace],
                        min_agreement: float = 0.98) -> float:
    """The fraction of (token, layer) top-k sets where the replay equals the trace;
    raises ValueError below ``min_agreement`` (the trace was made with another model,
    or its tokens do not belong to it). Float rounding may flip a near-tie, never many."""
    traced = np.concatenate([np.concatenate([req.prefill_experts, req.decode_experts], axis=1)
                             for req in requests if req.ok], axis=1)
    if traced.shape != states.experts.shape:
        raise ValueError(f"the trace has routing of shape {traced.shape}, the replay "
                         f"{states.experts.shape}: not the same requests")
    same = np.all(np.sort(traced, -1) == np.sort(states.experts, -1), axis=-1)
    agreement = float(same.mean())
    if agreement < min_agreement:
        raise ValueError(f"the replay routes only {agreement:.1%} of the traced tokens as the "
                         f"trace does (at least {min_agreement:.0%} expected): the trace "
                         f"was made with another model than the one given")
    return agreement
