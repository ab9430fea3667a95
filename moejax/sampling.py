"""Next-token choice of the generation loop: greedy, or temperature + top-p sampling.

Every row has its own temperature, top-p and PRNG key, and the key of a row's i-th
generated token is ``fold_in(key(seed), i)``: a request's tokens depend only on its own
logits, seed and step, never on which other requests share its batch or on when the
engine started it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int, Int32, Key, UInt32

PRNG_IMPL = "threefry2x32"
MAX_SEED = 2 ** 64   # seeds are split into the two 32-bit words of a threefry key


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-row sampling settings.

    temperature: [B] f32 (0 = greedy); top_p: [B] f32 in (0, 1];
    key_data: [B, 2] uint32 raw threefry keys (see :func:`seed_key_data`).
    """

    temperature: Float[Array | np.ndarray, "B"]
    top_p: Float[Array | np.ndarray, "B"]
    key_data: UInt32[Array | np.ndarray, "B 2"]


def seed_key_data(seeds: Sequence[int]) -> UInt32[np.ndarray, "B 2"]:
    """[B, 2] uint32 key words (high, low) of integer seeds in [0, 2**64): the raw key
    ``jax.random.PRNGKey(seed)`` makes for a 64-bit seed, built on the host so that seeds
    above 2**32 stay distinct without enabling x64."""
    out = np.zeros((len(seeds), 2), np.uint32)
    for i, seed in enumerate(seeds):
        if not 0 <= int(seed) < MAX_SEED:
            raise ValueError(f"seed {seed} outside [0, 2**64)")
        out[i] = (int(seed) >> 32, int(seed) & 0xFFFFFFFF)
    return out


def make_sampling_params(temperature: Sequence[float], top_p: Sequence[float],
                         seeds: Sequence[int]) -> SamplingParams:
    """Host arrays of B rows' settings."""
    return SamplingParams(temperature=np.asarray(temperature, np.float32),
                          top_p=np.asarray(top_p, np.float32),
                          key_data=seed_key_data(seeds))


def token_key(key_data: UInt32[Array, "2"], counter: Int[Array, ""]) -> Key[Array, ""]:
    """The typed key of one row's token number ``counter``: key_data [2] uint32."""
    return jax.random.fold_in(jax.random.wrap_key_data(key_data, impl=PRNG_IMPL), counter)


def row_keys(key_data: UInt32[Array, "B 2"], counters: Int[Array, "B"]) -> Key[Array, "B"]:
    """Typed keys [B] for each row's token number ``counters`` [B]."""
    return jax.vmap(token_key)(key_data, counters)


def sample_top_p(logits: Float[Array, "B V"], temperature: Float[Array, "B"],
                 top_p: Float[Array, "B"], keys: Key[Array, "B"]) -> Int32[Array, "B"]:
    """Temperature then nucleus sampling: logits [B, V] f32 -> token ids [B] int32.

    Tokens are sorted by probability; a token is kept when the probability mass of the
    tokens before it is below top_p (so the most likely token is always kept, and a tiny
    top_p is greedy). The draw happens among the kept tokens, in sorted order.
    """
    safe_t = jnp.where(temperature > 0, temperature, 1.0)
    # Shifted first (softmax is shift-invariant): logits / a tiny temperature would
    # overflow to inf and give NaN probabilities; shifted, they are <= 0.
    shifted = logits - jnp.max(logits, axis=-1, keepdims=True)
    probs = jax.nn.softmax(shifted / safe_t[:, None], axis=-1)
    sorted_probs, sorted_ids = jax.lax.top_k(probs, probs.shape[-1])
    mass_before = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs
    keep = mass_before < top_p[:, None]
    masked = jnp.where(keep, jnp.log(sorted_probs), -jnp.inf)
    choice = jax.vmap(jax.random.categorical)(keys, masked)
    return jnp.take_along_axis(sorted_ids, choice[:, None], axis=1)[:, 0].astype(jnp.int32)


def next_tokens(logits: Float[Array, "B V"], params: SamplingParams,
                counters: Int[Array, "B"]) -> Int32[Array, "B"]:
    """The next token of every row: logits [B, V] f32, ``counters`` [B] int32 (how many
    tokens the row has generated so far) -> [B] int32. Rows with temperature 0 take the
    argmax; the sort that sampling needs is skipped when every row is greedy."""
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    any_sampled = jnp.any(params.temperature > 0)
    sampled = jax.lax.cond(
        any_sampled,
        lambda: sample_top_p(logits, params.temperature, params.top_p,
                             row_keys(params.key_data, counters)),
        lambda: greedy)
    return jnp.where(params.temperature > 0, sampled, greedy)
