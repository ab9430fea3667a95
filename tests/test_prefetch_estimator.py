"""The routing estimator for speculative expert prefetch (``moejax.prefetch.estimator``):
the architecture against a float64 NumPy reference, the KL loss, top-k prediction, training
by distillation on a learnable synthetic router, the ``.npz`` file and input checks."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moejax.prefetch import estimator as est
from moejax.prefetch.estimator import EstimatorConfig, EstimatorFileError

CFG = EstimatorConfig(hidden_size=16, num_experts=8, num_layers=4, width=32, ffn_width=64)
N = 512


def _softmax(x: np.ndarray) -> np.ndarray:
    z = np.exp(x - x.max(axis=-1, keepdims=True))
    return z / z.sum(axis=-1, keepdims=True)


@pytest.fixture(scope="module")
def data() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """q [N, d], layer [N], target [N, E]: softmax of a random linear map plus a per-layer bias."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((N, CFG.hidden_size)).astype(np.float32)
    layer = rng.integers(0, CFG.num_layers - 1, N).astype(np.int32)
    w = rng.standard_normal((CFG.hidden_size, CFG.num_experts)) * 0.6
    bias = rng.standard_normal((CFG.num_layers - 1, CFG.num_experts)) * 1.5
    target = _softmax(q @ w + bias[layer]).astype(np.float32)
    return q, layer, target


def _np_logits(params: dict, q: np.ndarray, layer: np.ndarray) -> np.ndarray:
    p = {k: np.asarray(v, np.float64) for k, v in params.items()}
    h = q.astype(np.float64) @ p["proj"] + p["proj_bias"] + p["layer_embed"][layer]
    a = h @ p["ffn_in"] + p["ffn_in_bias"]
    h = h + (a / (1 + np.exp(-a))) @ p["ffn_out"] + p["ffn_out_bias"]
    h = (h - h.mean(-1, keepdims=True)) / np.sqrt(h.var(-1, keepdims=True) + 1e-5)
    return (h * p["ln_scale"] + p["ln_bias"]) @ p["head"] + p["head_bias"]


def _randomised(params: dict, seed: int = 1) -> dict:
    """Perturb every param (biases, ln_scale too) so the reference test covers them all."""
    rng = np.random.default_rng(seed)
    return {k: v + jnp.asarray(0.1 * rng.standard_normal(v.shape), jnp.float32)
            for k, v in params.items()}


def test_config_validation(typechecks_off):
    with pytest.raises(ValueError, match="num_layers"):
        EstimatorConfig(hidden_size=16, num_experts=8, num_layers=1)
    with pytest.raises(ValueError, match="width"):
        EstimatorConfig(hidden_size=16, num_experts=8, num_layers=4, width=0)
    with pytest.raises(ValueError, match="hidden_size"):
        EstimatorConfig(hidden_size=16.0, num_experts=8, num_layers=4)


def test_init_shapes_and_count():
    params = est.init_params(CFG, 0)
    assert {k: v.shape for k, v in params.items()} == est.param_shapes(CFG)
    assert all(v.dtype == jnp.float32 for v in params.values())
    d, e, m, n, layers = 16, 8, 32, 64, 4
    expected = d * m + m + (layers - 1) * m + m * n + n + n * m + m + 2 * m + m * e + e
    assert est.param_count(params) == expected


def test_logits_match_numpy_reference(data):
    q, layer, _ = data
    params = _randomised(est.init_params(CFG, 0))
    got = np.asarray(jax.jit(est.logits)(params, jnp.asarray(q), jnp.asarray(layer)))
    assert got.shape == (N, CFG.num_experts) and got.dtype == np.float32
    np.testing.assert_allclose(got, _np_logits(params, q, layer), rtol=1e-4, atol=1e-5)
    # bf16 input is upcast and computed in float32
    q_bf16 = jnp.asarray(q, jnp.bfloat16)
    got_bf16 = np.asarray(est.logits(params, q_bf16, jnp.asarray(layer)))
    assert got_bf16.dtype == np.float32
    np.testing.assert_allclose(got_bf16, _np_logits(params, np.asarray(q_bf16, np.float32), layer),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("norm", [True, False])
def test_predict_topk(data, norm):
    q, layer, _ = data
    params = _randomised(est.init_params(CFG, 0))
    k = 3
    fn = jax.jit(est.predict_topk, static_argnames=("k", "norm_topk_prob"))
    weights, experts = fn(params, jnp.asarray(q), jnp.asarray(layer), k=k, norm_topk_prob=norm)
    assert weights.shape == (N, k) and weights.dtype == jnp.float32
    assert experts.shape == (N, k) and experts.dtype == jnp.int32
    ref_logits = _np_logits(params, q, layer)
    ref_experts = np.argsort(-ref_logits, axis=-1, kind="stable")[:, :k]
    np.testing.assert_array_equal(np.asarray(experts), ref_experts)
    ref_w = np.take_along_axis(_softmax(ref_logits), ref_experts, axis=-1)
    if norm:
        np.testing.assert_allclose(np.asarray(weights).sum(-1), 1.0, rtol=1e-5)
        ref_w = ref_w / ref_w.sum(-1, keepdims=True)
    else:
        assert np.all(np.asarray(weights).sum(-1) < 1.0)
    np.testing.assert_allclose(np.asarray(weights), ref_w, rtol=1e-4)


def test_kl_loss(data):
    q, layer, target = data
    params = est.init_params(CFG, 0)
    q_j, l_j = jnp.asarray(q), jnp.asarray(layer)
    own = jax.nn.softmax(est.logits(params, q_j, l_j), axis=-1)
    assert abs(float(est.kl_loss(params, q_j, l_j, own))) < 1e-5
    assert float(est.kl_loss(params, q_j, l_j, jnp.asarray(target))) > 0.01
    # one-hot targets (0 * log 0 = 0) give a finite loss: -log p of the chosen expert
    onehot = jax.nn.one_hot(jnp.arange(N) % CFG.num_experts, CFG.num_experts)
    loss = float(est.kl_loss(params, q_j, l_j, onehot))
    ref = -np.mean(np.log(np.asarray(own)[np.arange(N), np.arange(N) % CFG.num_experts]))
    assert np.isfinite(loss) and loss == pytest.approx(ref, rel=1e-4)


def test_training_decreases_kl(data):
    q, layer, target = data
    args = jnp.asarray(q), jnp.asarray(layer), jnp.asarray(target)
    before = float(est.kl_loss(est.init_params(CFG, 0), *args))
    result = est.train(CFG, q, layer, target, steps=100, batch_size=128, learning_rate=3e-3, seed=0)
    after = float(est.kl_loss(result.params, *args))
    assert after < 0.7 * before, (before, after)
    assert result.steps == 100 and result.tokens == 100 * 128 and len(result.losses) == 100
    assert all(np.isfinite(result.losses)) and result.seconds > 0
    # warm start from ``init`` continues from there
    more = est.train(CFG, q, layer, target, steps=20, batch_size=128, learning_rate=3e-3,
                     init=result.params)
    assert float(est.kl_loss(more.params, *args)) < after * 1.05


def test_training_batch_larger_than_data(data):
    q, layer, target = data
    small = 40
    result = est.train(CFG, q[:small], layer[:small], target[:small], steps=3, batch_size=1024)
    assert result.tokens == 3 * small and len(result.losses) == 3


def test_train_shape_errors(data):
    q, layer, target = data
    with pytest.raises(ValueError, match="q"):
        est.train(CFG, q[:, :8], layer, target, steps=1)
    with pytest.raises(ValueError, match="layer"):
        est.train(CFG, q, layer[:-1], target, steps=1)
    with pytest.raises(ValueError, match="layer"):
        est.train(CFG, q, np.full(N, CFG.num_layers - 1, np.int32), target, steps=1)
    with pytest.raises(ValueError, match="layer"):
        est.train(CFG, q, layer.astype(np.float32), target, steps=1)
    with pytest.raises(ValueError, match="target_probs"):
        est.train(CFG, q, layer, target[:, :4], steps=1)
    with pytest.raises(ValueError, match="target_probs"):
        est.train(CFG, q, layer, target[:-1], steps=1)


def _saved(tmp_path, params=None, **overrides):
    """Save a valid file, then rewrite it with ``overrides`` (None deletes the key)."""
    path = tmp_path / "est.npz"
    params = est.init_params(CFG, 0) if params is None else params
    est.save(path, CFG, params, {"model": "demo-e32", "steps": 100, "final_kl": 0.25})
    if overrides:
        with np.load(path, allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files}
        for key, value in overrides.items():
            if value is None:
                del arrays[key]
            else:
                arrays[key] = value
        with open(path, "wb") as f:
            np.savez(f, **arrays)
    return path


def test_save_load_roundtrip(tmp_path, data):
    q, layer, _ = data
    params = _randomised(est.init_params(CFG, 0))
    path = _saved(tmp_path, params)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["est.npz"]
    cfg, loaded, meta = est.load(path)
    assert cfg == CFG
    assert meta == {"model": "demo-e32", "steps": 100, "final_kl": 0.25}
    assert isinstance(meta["steps"], int) and isinstance(meta["model"], str)
    args = jnp.asarray(q), jnp.asarray(layer)
    np.testing.assert_array_equal(np.asarray(est.logits(loaded, *args)),
                                  np.asarray(est.logits(params, *args)))


@pytest.mark.parametrize("key, value, needle", [
    ("format", np.array("something-else"), "format"),
    ("version", np.array(2), "version"),
    ("param/head", np.zeros((32, 7), np.float32), "param/head"),
    ("param/ffn_in", None, "param/ffn_in"),
    ("num_experts", None, "num_experts"),
])
def test_load_rejects_bad_files(tmp_path, key, value, needle):
    path = _saved(tmp_path, **{key: value})
    with pytest.raises(EstimatorFileError, match=needle) as info:
        est.load(path)
    assert str(path) in str(info.value)


def test_load_missing_and_garbage_files(tmp_path):
    missing = tmp_path / "nope.npz"
    with pytest.raises(EstimatorFileError, match="nope.npz"):
        est.load(missing)
    garbage = tmp_path / "garbage.npz"
    garbage.write_bytes(b"not a zip file at all")
    with pytest.raises(EstimatorFileError, match="garbage.npz"):
        est.load(garbage)
    assert issubclass(EstimatorFileError, ValueError)


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        CFG.width = 3
