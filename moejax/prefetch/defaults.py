"""Default vectors: each expert's mean output, computed offline from calibration tokens.

d_{l,e} is the mean, over the calibration tokens whose top-k at layer l includes e, of
expert e's output (SwiGLU, before the gate weight) on the token's router input. The
quasi-hidden state adds the gate-weighted sum of the chosen experts' default vectors to
the post-attention residual (``moejax.prefetch.predictors``): a cheap stand-in for the
MoE output the layer is about to compute. The same calibration counts how often each
expert is chosen per layer: the static ``popularity`` floor.

File (``moejax prefetch-calibrate``): one ``.npz`` (no pickle), format
``"moejax-prefetch-defaults"`` version 1: ``defaults`` float32 [L, E, d], ``counts``
int64 [L, E] (tokens that chose each expert), ``model`` (the name given),
``fingerprint`` (``moejax.eldr.fitfile.model_fingerprint``: the routing shape and the
router weights), ``calibration_requests``, ``calibration_tokens``. Size: 4·L·E·d +
8·L·E bytes (demo-e32: 99 KB; Qwen3-30B-A3B: 48 MB). A file made for other weights is
refused (:func:`DefaultVectors.check_model`).
"""

from __future__ import annotations

import dataclasses
import os
import zipfile
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from moejax import moe
from moejax.config import ModelConfig
from moejax.eldr.fitfile import model_fingerprint
from moejax.param_layout import Params

FORMAT = "moejax-prefetch-defaults"
VERSION = 1
TOKENS_PER_CHUNK = 8192   # calibration tokens per expert-compute program


class PrefetchFileError(ValueError):
    """A prefetch file (default vectors or estimator) that cannot be used, and why."""


# What reading a damaged .npz raises: a truncated archive (its zip directory is at the
# end) is a BadZipFile, which is not an OSError or ValueError; a truncated member an
# EOFError. Every reader of prefetch files turns these into PrefetchFileError.
NPZ_READ_ERRORS = (OSError, ValueError, EOFError, zipfile.BadZipFile)


def check_npz_path(path: str) -> None:
    """Refuse a missing path, or one that is not a regular file (opening a FIFO blocks)."""
    if not os.path.isfile(path):
        what = ("not a regular file, so not a prefetch file" if os.path.exists(path)
                else "no such prefetch file")
        raise PrefetchFileError(f"{path}: {what} (make one with `moejax prefetch-calibrate` "
                                f"or `python -m moejax.prefetch.train`)")


def npz_error(path: str, exc: BaseException) -> PrefetchFileError:
    """The error for an .npz that numpy could not read (one of NPZ_READ_ERRORS)."""
    return PrefetchFileError(f"{path}: not a readable .npz, truncated or damaged? "
                             f"({type(exc).__name__}: {exc})")


def read_npz(path: str) -> dict[str, np.ndarray]:
    """Every array of the .npz at ``path`` (no pickles); a missing, non-regular or damaged
    file raises :class:`PrefetchFileError` naming it."""
    check_npz_path(path)
    try:
        with np.load(path, allow_pickle=False) as npz:
            return {k: npz[k] for k in npz.files}
    except NPZ_READ_ERRORS as exc:
        raise npz_error(path, exc) from None


@dataclasses.dataclass(frozen=True)
class DefaultVectors:
    """defaults [L, E, d] float32; counts [L, E] int64 (see the module docstring)."""

    defaults: np.ndarray
    counts: np.ndarray
    model: str
    fingerprint: str
    calibration_requests: int
    calibration_tokens: int

    @property
    def nbytes(self) -> int:
        return int(self.defaults.nbytes + self.counts.nbytes)

    def check_model(self, cfg: ModelConfig, params: Params, path: str = "the defaults") -> None:
        """Refuse default vectors made for another shape or other router weights."""
        shape = (cfg.num_layers, cfg.num_experts, cfg.hidden_size)
        if self.defaults.shape != shape:
            raise PrefetchFileError(f"{path}: default vectors of shape {self.defaults.shape}, "
                                    f"the model has [L, E, d] = {shape}")
        if model_fingerprint(cfg, params["layers"]["router"]) != self.fingerprint:
            raise PrefetchFileError(f"{path}: made for other weights (model "
                                    f"{self.model!r}); recompute them with `moejax "
                                    f"prefetch-calibrate TRACES -o {path} --model MODEL`")


def _expert_output_sums(x: Float[Array, "T d"], experts: Int[Array, "T k"],
                        w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array
                        ) -> jax.Array:
    """Sum over tokens of each chosen expert's output on its token -> [E, d] float32
    (the routed rows only: the model's own permute and grouped expert compute)."""
    num_experts = w_gate.shape[0]
    routing = moe.Routing(weights=jnp.ones(experts.shape, jnp.float32), experts=experts)
    perm = moe.permute(x, routing, num_experts)
    y_sorted = moe.expert_compute(perm, w_gate, w_up, w_down).astype(jnp.float32)
    sorted_ids = jnp.take(experts.reshape(-1), perm.order)
    return jax.ops.segment_sum(y_sorted, sorted_ids, num_segments=num_experts)


_EXPERT_OUTPUT_SUMS = jax.jit(_expert_output_sums)


def default_vectors(params: Params, router_input: Float[np.ndarray, "L T d"],
                    experts: Int[np.ndarray, "L T k"]) -> tuple[np.ndarray, np.ndarray]:
    """(defaults [L, E, d] float32, counts [L, E] int64) from calibration tokens' router
    inputs and top-k ids. An expert no token chose keeps a zero default vector."""
    layers = params["layers"]
    num_layers, num_experts = layers["w_gate"].shape[:2]
    if router_input.shape[0] != num_layers or experts.shape[:2] != router_input.shape[:2]:
        raise ValueError(f"router inputs {router_input.shape} and experts {experts.shape} "
                         f"must be [L={num_layers}, T, ...] for the same tokens")
    sums = np.zeros((num_layers, num_experts, router_input.shape[2]), np.float64)
    counts = np.zeros((num_layers, num_experts), np.int64)
    for layer in range(num_layers):
        weights = [jnp.asarray(layers[name][layer]) for name in ("w_gate", "w_up", "w_down")]
        dtype = weights[0].dtype
        for start in range(0, router_input.shape[1], TOKENS_PER_CHUNK):
            x = router_input[layer, start:start + TOKENS_PER_CHUNK]
            ids = experts[layer, start:start + TOKENS_PER_CHUNK]
            sums[layer] += np.asarray(_EXPERT_OUTPUT_SUMS(jnp.asarray(x, dtype),
                                                          jnp.asarray(ids), *weights))
        counts[layer] = np.bincount(experts[layer].reshape(-1), minlength=num_experts)
    means = sums / np.maximum(counts, 1)[:, :, None]
    return means.astype(np.float32), counts


def calibrate(cfg: ModelConfig, params: Params, router_input: np.ndarray, experts: np.ndarray,
              *, model: str = "", requests: int = 0) -> DefaultVectors:
    """:class:`DefaultVectors` of ``params`` from calibration tokens (see
    :func:`default_vectors`)."""
    defaults, counts = default_vectors(params, router_input, experts)
    return DefaultVectors(defaults=defaults, counts=counts, model=model,
                          fingerprint=model_fingerprint(cfg, params["layers"]["router"]),
                          calibration_requests=int(requests),
                          calibration_tokens=int(router_input.shape[1]))


def save(path: str | os.PathLike, vectors: DefaultVectors) -> None:
    with open(path, "wb") as f:
        np.savez(f, format=np.array(FORMAT), version=np.array(VERSION, np.int64),
                 defaults=vectors.defaults.astype(np.float32),
                 counts=vectors.counts.astype(np.int64), model=np.array(vectors.model),
                 fingerprint=np.array(vectors.fingerprint),
                 calibration_requests=np.array(vectors.calibration_requests, np.int64),
                 calibration_tokens=np.array(vectors.calibration_tokens, np.int64))


def _field(arrays: Any, path: str, key: str) -> np.ndarray:
    if key not in arrays:
        raise PrefetchFileError(f"{path}: no {key!r} (not a default-vector file, or damaged)")
    return arrays[key]


def load(path: str | os.PathLike) -> DefaultVectors:
    """Read a default-vector file; a missing, foreign or malformed file raises
    :class:`PrefetchFileError` naming the path and the key."""
    path = os.fspath(path)
    arrays = read_npz(path)
    if str(_field(arrays, path, "format")) != FORMAT:
        raise PrefetchFileError(f"{path}: 'format' is {str(arrays['format'])!r}, not {FORMAT!r}")
    if int(_field(arrays, path, "version")) != VERSION:
        raise PrefetchFileError(f"{path}: 'version' {int(arrays['version'])} is not "
                                f"{VERSION}, the one this moejax reads")
    defaults = _field(arrays, path, "defaults")
    counts = _field(arrays, path, "counts")
    if defaults.ndim != 3 or defaults.dtype != np.float32 or not np.all(np.isfinite(defaults)):
        raise PrefetchFileError(f"{path}: 'defaults' must be finite float32 [L, E, d], got "
                                f"{defaults.dtype} {defaults.shape}")
    if counts.shape != defaults.shape[:2] or counts.dtype != np.int64 or np.any(counts < 0):
        raise PrefetchFileError(f"{path}: 'counts' must be non-negative int64 "
                                f"{defaults.shape[:2]}, got {counts.dtype} {counts.shape}")
    return DefaultVectors(defaults=defaults, counts=counts,
                          model=str(_field(arrays, path, "model")),
                          fingerprint=str(_field(arrays, path, "fingerprint")),
                          calibration_requests=int(_field(arrays, path, "calibration_requests")),
                          calibration_tokens=int(_field(arrays, path, "calibration_tokens")))
