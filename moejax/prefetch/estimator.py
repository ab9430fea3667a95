"""Routing estimator for speculative expert prefetch ("Speculating Experts", Appendix A).

With expert weights offloaded, decode stalls while layer l+1's experts are fetched. The
estimator predicts layer l+1's router distribution from layer l's quasi-hidden state q
(available one layer early), so the likely experts can be prefetched while layer l runs.

One small network is shared by every source layer l in [0, L-1); a learned layer
embedding tells it which transition it is predicting:

    h = q @ proj + proj_bias + layer_embed[l]                         # d -> m
    h = h + (silu(h @ ffn_in + ffn_in_bias) @ ffn_out + ffn_out_bias)  # residual MLP, m -> n -> m
    h = LayerNorm(h)                                                   # eps 1e-5
    logits = h @ head + head_bias                                      # m -> E

It is trained by distillation: minimise KL(p_router || softmax(logits)), where p_router is
the true router's softmax at layer l+1 on the same token. All maths is float32.
Params are a plain dict of float32 arrays; ``save``/``load`` use one pickle-free ``.npz``.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import zipfile

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Float, Int

FORMAT = "moejax-prefetch-estimator"
VERSION = 1
LN_EPS = 1e-5
_log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class EstimatorConfig:
    """hidden_size d, num_experts E, num_layers L (of the model), width m, ffn_width n."""

    hidden_size: int
    num_experts: int
    num_layers: int
    width: int = 256
    ffn_width: int = 512

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value <= 0:
                raise ValueError(f"EstimatorConfig.{field.name} must be a positive int, "
                                 f"got {value!r}")
        if self.num_layers < 2:
            raise ValueError(f"EstimatorConfig.num_layers must be >= 2, got {self.num_layers}")


def param_shapes(cfg: EstimatorConfig) -> dict[str, tuple[int, ...]]:
    d, e, m, n = cfg.hidden_size, cfg.num_experts, cfg.width, cfg.ffn_width
    return {"proj": (d, m), "proj_bias": (m,), "layer_embed": (cfg.num_layers - 1, m),
            "ffn_in": (m, n), "ffn_in_bias": (n,), "ffn_out": (n, m), "ffn_out_bias": (m,),
            "ln_scale": (m,), "ln_bias": (m,), "head": (m, e), "head_bias": (e,)}


def init_params(cfg: EstimatorConfig, seed: int) -> dict[str, jax.Array]:
    """Matrices ~ N(0, 1/fan_in) (layer_embed ~ N(0, 1/m)); biases 0; ln_scale 1."""
    shapes = param_shapes(cfg)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(shapes))
    params = {}
    for key, (name, shape) in zip(keys, shapes.items()):
        if name == "ln_scale":
            params[name] = jnp.ones(shape, jnp.float32)
        elif len(shape) == 1:
            params[name] = jnp.zeros(shape, jnp.float32)
        else:
            fan_in = shape[1] if name == "layer_embed" else shape[0]
            params[name] = jax.random.normal(key, shape, jnp.float32) / np.sqrt(fan_in)
    return params


def param_count(params: dict[str, jax.Array]) -> int:
    return int(sum(int(np.prod(leaf.shape)) for leaf in jax.tree_util.tree_leaves(params)))


def logits(params: dict[str, jax.Array], q: Float[Array, "N d"],
           layer: Int[Array, "N"]) -> Float[Array, "N E"]:
    """Predicted router logits of layer l+1 from q [N, d] at source layer ``layer`` [N]."""
    h = q.astype(jnp.float32) @ params["proj"] + params["proj_bias"] + params["layer_embed"][layer]
    h = h + jax.nn.silu(h @ params["ffn_in"] + params["ffn_in_bias"]) @ params["ffn_out"] \
        + params["ffn_out_bias"]
    mean = jnp.mean(h, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(h - mean), axis=-1, keepdims=True)
    h = (h - mean) * jax.lax.rsqrt(var + LN_EPS) * params["ln_scale"] + params["ln_bias"]
    return h @ params["head"] + params["head_bias"]


def kl_loss(params: dict[str, jax.Array], q: Float[Array, "N d"], layer: Int[Array, "N"],
            target_probs: Float[Array, "N E"]) -> Float[Array, ""]:
    """Mean over rows of KL(target || softmax(logits)), with 0·log 0 = 0."""
    log_q = jax.nn.log_softmax(logits(params, q, layer), axis=-1)
    t = target_probs.astype(jnp.float32)
    kl = jax.scipy.special.xlogy(t, t) - jnp.where(t > 0, t * log_q, 0.0)
    return jnp.mean(jnp.sum(kl, axis=-1))


def predict_topk(params: dict[str, jax.Array], q: Float[Array, "N d"], layer: Int[Array, "N"],
                 k: int, norm_topk_prob: bool) -> tuple[Float[Array, "N k"], Int[Array, "N k"]]:
    """Top-k of the predicted probabilities, as ``moejax.moe.route`` does for the true router
    (softmax over all E, top_k, renormalise the k when ``norm_topk_prob``). Jittable with
    ``k`` and ``norm_topk_prob`` static."""
    return topk_of_probs(jax.nn.softmax(logits(params, q, layer), axis=-1), k, norm_topk_prob)


def topk_of_probs(probs: Float[Array, "N E"], k: int, norm_topk_prob: bool
                  ) -> tuple[Float[Array, "N k"], Int[Array, "N k"]]:
    """The k most probable experts and their probabilities (renormalised over the k when
    ``norm_topk_prob``)."""
    weights, experts = jax.lax.top_k(probs, k)
    if norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


@dataclasses.dataclass(frozen=True)
class TrainResult:
    params: dict[str, jax.Array]
    losses: list[float]     # the minibatch loss of every step
    steps: int
    tokens: int             # training rows seen: steps * min(batch_size, N)
    seconds: float


def _check_data(cfg: EstimatorConfig, q: np.ndarray, layer: np.ndarray,
                target_probs: np.ndarray) -> None:
    if q.ndim != 2 or q.shape[0] == 0 or q.shape[1] != cfg.hidden_size:
        raise ValueError(f"q must be [N>0, hidden_size={cfg.hidden_size}], got {q.shape}")
    n = q.shape[0]
    if layer.shape != (n,) or not np.issubdtype(layer.dtype, np.integer):
        raise ValueError(f"layer must be an int array of shape [{n}], "
                         f"got {layer.dtype} {layer.shape}")
    if layer.min() < 0 or layer.max() >= cfg.num_layers - 1:
        raise ValueError(f"layer values must lie in [0, {cfg.num_layers - 1}), got "
                         f"[{layer.min()}, {layer.max()}]")
    if target_probs.shape != (n, cfg.num_experts):
        raise ValueError(f"target_probs must be [{n}, num_experts={cfg.num_experts}], "
                         f"got {target_probs.shape}")


def train(cfg: EstimatorConfig, q: np.ndarray, layer: np.ndarray, target_probs: np.ndarray, *,
          steps: int, batch_size: int = 1024, learning_rate: float = 1e-3, seed: int = 0,
          init: dict[str, jax.Array] | None = None, log_every: int = 0) -> TrainResult:
    """AdamW on ``kl_loss`` over host-side minibatches (q [N, d], layer [N], target_probs [N, E],
    NumPy): each epoch is a fresh shuffle walked in batches of min(batch_size, N), the
    ragged tail dropped. Starts from ``init`` when given, else ``init_params(cfg, seed)``;
    logs the loss every ``log_every`` steps (0: never)."""
    q, layer, target_probs = np.asarray(q), np.asarray(layer), np.asarray(target_probs)
    _check_data(cfg, q, layer, target_probs)
    if steps < 0 or batch_size <= 0:
        raise ValueError(f"steps must be >= 0 and batch_size > 0, got {steps}, {batch_size}")
    params = init_params(cfg, seed) if init is None else init
    expected = param_shapes(cfg)
    got = {name: tuple(np.shape(v)) for name, v in params.items()}
    if got != expected:
        raise ValueError(f"init params do not match the config: {got} != {expected}")
    params = {name: jnp.asarray(v, jnp.float32) for name, v in params.items()}
    optimizer = optax.adamw(learning_rate, weight_decay=0.0)

    @jax.jit
    def step(params, opt_state, q_b, layer_b, t_b):
        loss, grads = jax.value_and_grad(kl_loss)(params, q_b, layer_b, t_b)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    n = q.shape[0]
    b = min(batch_size, n)
    rng = np.random.default_rng(seed)
    order, pos = rng.permutation(n), 0
    opt_state = optimizer.init(params)
    losses = []
    start = time.perf_counter()
    for i in range(steps):
        if pos + b > n:
            order, pos = rng.permutation(n), 0
        idx = np.sort(order[pos:pos + b])
        pos += b
        params, opt_state, loss = step(params, opt_state, q[idx], layer[idx].astype(np.int32),
                                       target_probs[idx].astype(np.float32))
        losses.append(loss)
        if log_every and (i + 1) % log_every == 0:
            _log.info("estimator step %d/%d: kl %.5f", i + 1, steps, float(loss))
    losses = [float(x) for x in jax.device_get(losses)]
    jax.block_until_ready(params)
    return TrainResult(params=params, losses=losses, steps=steps, tokens=steps * b,
                       seconds=time.perf_counter() - start)


class EstimatorFileError(ValueError):
    """A malformed or unreadable estimator file; the message names the path and the key."""


def save(path: str | os.PathLike, cfg: EstimatorConfig, params: dict[str, jax.Array],
         meta: dict[str, str | int | float]) -> None:
    """Write config, params (float32) and meta (str/int/float) to one ``.npz`` at ``path``."""
    arrays = {"format": np.array(FORMAT), "version": np.array(VERSION, np.int64)}
    for field in dataclasses.fields(cfg):
        arrays[field.name] = np.array(getattr(cfg, field.name), np.int64)
    for name, shape in param_shapes(cfg).items():
        value = np.asarray(params[name], np.float32)
        if value.shape != shape:
            raise ValueError(f"param {name!r} has shape {value.shape}, expected {shape}")
        arrays[f"param/{name}"] = value
    for key, value in meta.items():
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise ValueError(f"meta[{key!r}] must be str, int or float, got {type(value).__name__}")
        arrays[f"meta/{key}"] = np.array(value, np.int64 if isinstance(value, int) else None)
    tmp = f"{os.fspath(path)}.tmp"
    with open(tmp, "wb") as f:
        np.savez(f, **arrays)
    os.replace(tmp, path)


def load(path: str | os.PathLike) -> tuple[EstimatorConfig, dict[str, jax.Array],
                                           dict[str, str | int | float]]:
    """Read a file written by ``save``; raises EstimatorFileError on anything malformed."""
    try:
        data = np.load(path, allow_pickle=False)
        if not isinstance(data, np.lib.npyio.NpzFile):
            raise ValueError("not an .npz archive")
        with data:
            arrays = {key: data[key] for key in data.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:   # missing, not npz, pickle
        raise EstimatorFileError(f"{path}: cannot read estimator file: {e}") from e

    def get(key: str) -> np.ndarray:
        if key not in arrays:
            raise EstimatorFileError(f"{path}: missing key {key!r}")
        return arrays[key]

    if get("format").shape != () or str(get("format")) != FORMAT:
        raise EstimatorFileError(f"{path}: key 'format' is {get('format')!r}, expected {FORMAT!r}")
    if get("version").shape != () or get("version").item() != VERSION:
        raise EstimatorFileError(f"{path}: key 'version' is {get('version')!r}, expected {VERSION}")
    fields = {}
    for field in dataclasses.fields(EstimatorConfig):
        value = get(field.name)
        if value.shape != () or not np.issubdtype(value.dtype, np.integer):
            raise EstimatorFileError(f"{path}: key {field.name!r} must be an int scalar")
        fields[field.name] = int(value)
    try:
        cfg = EstimatorConfig(**fields)
    except ValueError as e:
        raise EstimatorFileError(f"{path}: {e}") from e
    params = {}
    for name, shape in param_shapes(cfg).items():
        value = get(f"param/{name}")
        if value.shape != shape or not np.issubdtype(value.dtype, np.floating):
            got = f"{value.dtype}{list(value.shape)}"
            raise EstimatorFileError(f"{path}: key 'param/{name}' is {got}, "
                                     f"expected float{list(shape)}")
        params[name] = jnp.asarray(value, jnp.float32)
    meta = {}
    for key, value in arrays.items():
        if key.startswith("meta/"):
            meta[key[len("meta/"):]] = value.item() if value.dtype.kind in "iuf" else str(value)
    return cfg, params, meta
