"""ELDR cluster priors for the expert-prefetch predictor (issue 44): the prior of a
hand-made fit against a hand computation (and read from files), the predictor with the
prior against a NumPy reference (weight 0: today's predictor exactly; weight 1: the
prior's top-k), exact prefetch with the prior equal to resident decode, the options'
errors, and the benchmark's quick run."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from moejax import checkpoint
from moejax.backends.base import BackendError
from moejax.decode.factory import make_runner
from moejax.decode.programs import StepOptions
from moejax.eldr import fitfile, priors
from moejax.eldr.fitfile import EldrFit, FitError
from moejax.prefetch import defaults as defaults_lib
from moejax.prefetch import estimator as estimator_lib
from moejax.prefetch import predictors, replay
from moejax.sequences import SequenceSpec
from moejax.traces import RequestTrace, Trace
from serving.api import resolve_model_dir

from scheduler_runs import scheduler_tokens

PROMPTS_NEW = [(5, 8), (17, 6), (9, 10), (3, 7)]


# ----------------------------------------------------------------------------- the prior
def _hand_fit() -> EldrFit:
    """2 layers, 4 experts, top-1, IDF 1, both layers; centroid 0 on experts {0, 1},
    centroid 1 on experts {2, 3} (at both layers)."""
    c0 = np.array([1, 1, 0, 0, 1, 1, 0, 0], float)
    c1 = np.array([0, 0, 1, 1, 0, 0, 1, 1], float)
    return EldrFit(model="toy", fingerprint="f" * 64, num_layers=2, num_experts=4, top_k=1,
                   idf=np.ones((2, 4)), layers=(0, 1), centroids=np.stack([c0, c1]),
                   calibration_requests=4, rho=0.5)


# Prompt counts [N, L, E]: requests 0, 1 use experts 0/1 (cluster 0), 2, 3 experts 2/3.
PREFILL = np.array([[[3, 1, 0, 0], [2, 2, 0, 0]],
                    [[0, 4, 0, 1], [1, 3, 0, 0]],
                    [[0, 0, 2, 2], [0, 1, 3, 0]],
                    [[1, 0, 0, 3], [0, 0, 2, 2]]])
# Decode counts: cluster 1 has no decode token at layer 1.
DECODE = np.array([[[2, 1, 0, 1], [0, 3, 1, 0]],
                   [[1, 0, 0, 0], [2, 0, 0, 1]],
                   [[0, 0, 3, 1], [0, 0, 0, 0]],
                   [[0, 1, 1, 2], [0, 0, 0, 0]]])


def test_prior_of_a_hand_made_fit():
    fit = _hand_fit()
    np.testing.assert_array_equal(priors.cluster_assignment(fit, PREFILL), [0, 0, 1, 1])
    got = priors.cluster_priors(fit, PREFILL, DECODE)
    # Cluster 0, layer 0: (2,1,0,1) + (1,0,0,0) = (3,1,0,1) / 5; layer 1: (2,3,1,1) / 7.
    # Cluster 1, layer 0: (0,0,3,1) + (0,1,1,2) = (0,1,4,3) / 8; layer 1: no token: uniform.
    want = np.array([[[3 / 5, 1 / 5, 0, 1 / 5], [2 / 7, 3 / 7, 1 / 7, 1 / 7]],
                     [[0, 1 / 8, 4 / 8, 3 / 8], [1 / 4, 1 / 4, 1 / 4, 1 / 4]]])
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-15)
    np.testing.assert_allclose(priors.decoder_prior(fit, 1, PREFILL, DECODE), want[1],
                               atol=1e-15)
    np.testing.assert_allclose(priors.decoder_prior(fit, np.int64(0), PREFILL, DECODE),
                               want[0], atol=1e-15)


def _hand_trace(prefill_top1, decode_top1, model="toy") -> Trace:
    """A top-1 trace whose requests' per-token expert ids are given [N][L][tokens]."""
    requests = []
    for i, (pre, dec) in enumerate(zip(prefill_top1, decode_top1)):
        pre = np.asarray(pre, np.int32)[..., None]
        dec = np.asarray(dec, np.int32)[..., None]
        requests.append(RequestTrace(
            id=str(i), domain="d", prompt_token_ids=np.arange(3, 3 + pre.shape[1], dtype=np.int32),
            generated_token_ids=np.arange(3, 4 + dec.shape[1], dtype=np.int32),
            prefill_experts=pre, prefill_weights=np.ones(pre.shape, np.float32),
            decode_experts=dec, decode_weights=np.ones(dec.shape, np.float32),
            finish_reason="length"))
    return Trace.from_requests(requests, num_layers=2, top_k=1, num_experts=4, model=model)


def test_prior_from_files_and_its_errors(tmp_path, demo):
    """The fit file plus a calibration trace give the prior the counts give; a decoder out
    of range, a trace or a model of another shape, a missing file: clear errors."""
    fit = _hand_fit()
    fitfile.save(tmp_path / "fit.npz", fit)
    # Request 0: prompt experts (0, 1) at both layers -> cluster 0, decodes 0, 0, 1 at
    # layer 0 and 1, 1, 3 at layer 1; request 1: prompt (2, 3) -> cluster 1, decodes 2, 3.
    trace = _hand_trace([[[0, 1], [1, 0]], [[2, 3], [3, 2]]],
                        [[[0, 0, 1], [1, 1, 3]], [[2, 3], [2, 2]]])
    from moejax import traces

    traces.save(tmp_path / "trace.npz", trace)
    got = priors.prior_from_files(tmp_path / "fit.npz", tmp_path / "trace.npz", 0)
    np.testing.assert_allclose(got, [[2 / 3, 1 / 3, 0, 0], [0, 2 / 3, 0, 1 / 3]], atol=1e-15)
    got = priors.prior_from_files(str(tmp_path / "fit.npz"), [str(tmp_path / "trace.npz")], 1)
    np.testing.assert_allclose(got, [[0, 0, 0.5, 0.5], [0, 0, 1, 0]], atol=1e-15)

    for bad in (2, -1, True, 0.0, "0"):
        with pytest.raises(ValueError, match=r"decoder must be an index in \[0, 2\)"):
            priors.prior_from_files(tmp_path / "fit.npz", tmp_path / "trace.npz", bad)
    with pytest.raises(ValueError, match=r"\[0, 2\).*got 5"):
        priors.decoder_prior(fit, 5, PREFILL, DECODE)
    wide = Trace.from_requests(
        [RequestTrace(id="0", domain="d", prompt_token_ids=np.arange(3, 5, dtype=np.int32),
                      generated_token_ids=np.arange(3, 5, dtype=np.int32),
                      prefill_experts=np.zeros((2, 2, 1), np.int32),
                      prefill_weights=np.ones((2, 2, 1), np.float32),
                      decode_experts=np.zeros((2, 1, 1), np.int32),
                      decode_weights=np.ones((2, 1, 1), np.float32), finish_reason="length")],
        num_layers=2, top_k=1, num_experts=6, model="toy")
    traces.save(tmp_path / "wide.npz", wide)
    with pytest.raises(FitError, match="6 experts, the fit's model has 2 layers and 4 experts"):
        priors.prior_from_files(tmp_path / "fit.npz", tmp_path / "wide.npz", 0)
    with pytest.raises(FitError, match="another|3 layers"):
        priors.cluster_priors(fit, np.zeros((2, 3, 4), int), np.zeros((2, 3, 4), int))
    with pytest.raises(FitError, match="2 layers, 4 experts, top-1; this model has 4 layers, "
                                       "8 experts, top-2"):
        priors.prior_from_files(tmp_path / "fit.npz", tmp_path / "trace.npz", 0, demo.cfg)
    with pytest.raises(FileNotFoundError, match="no ELDR fit file"):
        priors.prior_from_files(tmp_path / "none.npz", tmp_path / "trace.npz", 0)
    with pytest.raises(ValueError, match="negative count"):
        priors.cluster_priors(fit, PREFILL, -DECODE)
    with pytest.raises(ValueError, match="integer array"):
        priors.cluster_priors(fit, PREFILL, DECODE.astype(float))


# ----------------------------------------------------------------------------- predictor
def _run(runner, specs, batch=4, step="layerwise"):
    return scheduler_tokens(runner, specs, batch, step)


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """The demo model (4 layers, 8 experts, top-2), replayed states of random requests,
    its default vectors and an untrained estimator on disk, a skewed prior, and resident
    decode's tokens."""
    cfg, params, _ = checkpoint.load_model_dir(resolve_model_dir("demo")[0], "float32")
    rng = np.random.default_rng(0)
    requests = [SimpleNamespace(ok=True,
                                prompt_token_ids=rng.integers(3, cfg.vocab_size, 16).astype(np.int32),
                                generated_token_ids=rng.integers(3, cfg.vocab_size, 8).astype(np.int32))
                for _ in range(4)]
    states = replay.replay(cfg, params, requests)
    vectors = defaults_lib.calibrate(cfg, params, states.router_input, states.experts,
                                     model="demo", requests=4)
    folder = tmp_path_factory.mktemp("prior")
    files = [str(folder / "defaults.npz"), str(folder / "est.npz")]
    defaults_lib.save(files[0], vectors)
    est_cfg = estimator_lib.EstimatorConfig(hidden_size=cfg.hidden_size,
                                            num_experts=cfg.num_experts,
                                            num_layers=cfg.num_layers, width=32, ffn_width=64)
    est_params = estimator_lib.init_params(est_cfg, 3)
    estimator_lib.save(files[1], est_cfg, est_params,
                       {"model": "demo", "hybrid_layers": "1,2",
                        "fingerprint": fitfile.model_fingerprint(cfg, params["layers"]["router"])})
    # Distinct values (no ties), far from the router's choices: a raw count table.
    prior = rng.permutation(np.arange(1, cfg.num_layers * cfg.num_experts + 1)).reshape(
        cfg.num_layers, cfg.num_experts).astype(np.int64) ** 2
    specs = [SequenceSpec(prompt=tuple(int(t) for t in rng.integers(3, 1024, n)),
                          max_new_tokens=m) for n, m in PROMPTS_NEW]
    resident = make_runner("resident", cfg, params, dtype="float32", opts=StepOptions())
    return SimpleNamespace(cfg=cfg, params=params, states=states, vectors=vectors,
                           est_params=est_params, files=files, prior=prior, specs=specs,
                           resident=_run(resident, specs, step="fused"))


def _tables(demo, prior=None, weight=0.0):
    return predictors.make_tables(demo.cfg, demo.vectors.defaults, demo.est_params, (1, 2),
                                  prior=prior, prior_weight=weight)


def _predict(demo, tables, kind, layer=1, use_prior=None):
    s = demo.states
    use = predictors.uses_prior(tables) if use_prior is None else use_prior
    weights, ids = predictors.PREDICT(demo.params["layers"], tables, np.int32(layer),
                                      s.residual[layer], s.experts[layer], s.weights[layer],
                                      kind=kind, cfg=demo.cfg, use_prior=use)
    return np.asarray(weights), np.asarray(ids)


def _router_scores(demo, layer):
    """Float64 NumPy: softmax(router_{l+1}(Norm_{l+1}(r_l))) [T, E], the router predictor's
    scores."""
    cfg, layers = demo.cfg, demo.params["layers"]
    x = demo.states.residual[layer].astype(np.float64)
    norm = np.asarray(layers["mlp_norm"][layer + 1], np.float64)
    h = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + cfg.rms_norm_eps) * norm
    logits = h @ np.asarray(layers["router"][layer + 1], np.float64)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    return p / p.sum(-1, keepdims=True)


@pytest.mark.parametrize("kind", predictors.LEARNED)
def test_weight_zero_is_todays_predictor(demo, kind):
    """A prior at weight 0 is not traced in: the same ids and weights, bit for bit, as
    without a prior, at every layer (PREDICT and predict_states)."""
    plain, with_prior = _tables(demo), _tables(demo, demo.prior, 0.0)
    assert not predictors.uses_prior(with_prior)
    for layer in range(demo.cfg.num_layers - 1):
        for a, b in zip(_predict(demo, plain, kind, layer), _predict(demo, with_prior, kind, layer)):
            np.testing.assert_array_equal(a, b)
    s = demo.states
    np.testing.assert_array_equal(
        predictors.predict_states(kind, demo.cfg, demo.params["layers"], plain, s.residual,
                                  s.experts, s.weights),
        predictors.predict_states(kind, demo.cfg, demo.params["layers"], with_prior,
                                  s.residual, s.experts, s.weights))


@pytest.mark.parametrize("kind", predictors.LEARNED)
def test_weight_one_is_the_priors_top_k(demo, kind):
    cfg, k = demo.cfg, demo.cfg.num_experts_per_tok
    tables = _tables(demo, demo.prior, 1.0)
    for layer in range(cfg.num_layers - 1):
        _, ids = _predict(demo, tables, kind, layer)
        top = np.argsort(-demo.prior[layer + 1], kind="stable")[:k]
        np.testing.assert_array_equal(ids, np.broadcast_to(top, ids.shape))
    # The prior is far from what the predictor chooses: the prediction changed.
    _, alone = _predict(demo, _tables(demo), kind, 1)
    top = np.argsort(-demo.prior[2], kind="stable")[:k]
    assert (np.sort(alone, -1) != np.sort(top)).any()


@pytest.mark.parametrize("weight", [0.2, 0.5, 0.8])
def test_mixed_ranking_matches_numpy(demo, weight):
    """The router predictor with the prior: top-k of (1 − w)·p/Σp + w·prior against float64
    NumPy, and the weights: the router's probabilities there, renormalised."""
    cfg, k = demo.cfg, demo.cfg.num_experts_per_tok
    tables = _tables(demo, demo.prior, weight)
    prior = demo.prior / demo.prior.sum(axis=1, keepdims=True)
    changed = 0
    for layer in range(cfg.num_layers - 1):
        weights, ids = _predict(demo, tables, "router", layer)
        p = _router_scores(demo, layer)
        mixed = (1 - weight) * p + weight * prior[layer + 1]
        want = np.argsort(-mixed, -1, kind="stable")[:, :k]
        # Compare as sets where the k-th and (k+1)-th mixed scores are not near-ties.
        ranked = np.sort(mixed, -1)[:, ::-1]
        clear = ranked[:, k - 1] - ranked[:, k] > 1e-5
        assert clear.mean() > 0.9
        np.testing.assert_array_equal(np.sort(ids[clear], -1), np.sort(want[clear], -1))
        gates = np.take_along_axis(p, ids, -1)
        np.testing.assert_allclose(weights, gates / gates.sum(-1, keepdims=True),
                                   rtol=2e-4, atol=2e-5)
        changed += (np.sort(ids, -1) != np.sort(np.argsort(-p, -1)[:, :k], -1)).any(-1).sum()
    assert changed > 0


# ----------------------------------------------------------------------------- runtime
def _runner(demo, prefetch, mode="exact", **options):
    return make_runner("offload", demo.cfg, demo.params, dtype="float32", opts=StepOptions(),
                       prefetch=prefetch, prefetch_mode=mode, prefetch_files=demo.files,
                       **options)


@pytest.mark.parametrize("prefetch", ["quasi", "hybrid"])
def test_exact_prefetch_with_the_prior_equals_resident(demo, prefetch):
    """Exact mode computes with the true top-k whatever the prior predicts: the tokens
    equal resident decode's; the prior changed what was prefetched (its recall)."""
    plain = _runner(demo, prefetch)
    assert _run(plain, demo.specs) == demo.resident
    for weight in (0.5, 1.0):
        runner = _runner(demo, prefetch, prefetch_prior=demo.prior,
                         prefetch_prior_weight=weight)
        assert runner.use_prior
        assert _run(runner, demo.specs) == demo.resident
        assert runner.stats.decode_rows == plain.stats.decode_rows
        assert not np.allclose(runner.stats.recall()[1:], plain.stats.recall()[1:])
        assert runner.stats.on_demand == runner.stats.on_demand_layers.sum()


def test_speculative_with_the_prior_never_fetches_a_miss(demo):
    """Speculative decode with the prior computes layers >= 1 with what was prefetched:
    no on-demand copy there."""
    runner = _runner(demo, "router", "speculative", prefetch_prior=demo.prior,
                     prefetch_prior_weight=1.0)
    tokens = _run(runner, demo.specs)
    assert [len(t) for t in tokens] == [m for _, m in PROMPTS_NEW]
    assert runner.stats.on_demand_layers[1:].sum() == 0


def test_option_errors(demo):
    cfg = demo.cfg
    shape = (cfg.num_layers, cfg.num_experts)
    ok = np.ones(shape)
    for weight in (-0.1, 1.5, float("nan"), True, "0.5", None):
        with pytest.raises(ValueError, match=r"prefetch_prior_weight must be a number in \[0, 1\]"):
            predictors.check_prior(ok, weight, cfg)
    with pytest.raises(ValueError, match="needs a prefetch_prior"):
        predictors.check_prior(None, 0.3, cfg)
    assert predictors.check_prior(None, 0, cfg) == (None, 0.0)
    with pytest.raises(ValueError, match=r"\[4, 8\] array, got float64 of shape \(8, 4\)"):
        predictors.check_prior(np.ones(shape[::-1]), 0.5, cfg)
    with pytest.raises(ValueError, match="numeric"):
        predictors.check_prior(np.full(shape, "a"), 0.5, cfg)
    negative = ok.copy()
    negative[2, 5] = -1.0
    with pytest.raises(ValueError, match=r"negative value -1.0 \(layer 2, expert 5\)"):
        predictors.check_prior(negative, 0.5, cfg)
    bad = ok.copy()
    bad[1, 1] = np.nan
    with pytest.raises(ValueError, match="NaN or an infinity"):
        predictors.check_prior(bad, 0.5, cfg)
    zero = ok.copy()
    zero[3] = 0
    with pytest.raises(ValueError, match="layer 3 sums to 0"):
        predictors.check_prior(zero, 0.5, cfg)
    prior, weight = predictors.check_prior(2 * ok, 0.25, cfg)
    np.testing.assert_allclose(prior, 1 / cfg.num_experts)
    assert weight == 0.25
    # The runner names the option (BackendError), also for a choice with nothing to re-rank.
    with pytest.raises(BackendError, match="backend 'offload': prefetch_prior must be"):
        _runner(demo, "quasi", prefetch_prior=np.ones((2, 2)), prefetch_prior_weight=0.5)
    with pytest.raises(BackendError, match=r"prefetch_prior_weight must be a number"):
        _runner(demo, "quasi", prefetch_prior=ok, prefetch_prior_weight=2)
    for choice in ("none", "oracle", "layer"):
        with pytest.raises(BackendError, match=f"prefetch={choice!r} has none"):
            _runner(demo, choice, prefetch_prior=ok, prefetch_prior_weight=0.5)
    assert not _runner(demo, "oracle", prefetch_prior=ok, prefetch_prior_weight=0).use_prior


# ----------------------------------------------------------------------------- benchmark
def test_benchmark_pieces():
    from benchmarks import prefetch_prior as bench

    fit = _hand_fit()
    sets = bench.prior_sets(fit, PREFILL, DECODE)
    np.testing.assert_array_equal(sets["shuffled"][0], sets["eldr"][1])
    np.testing.assert_array_equal(sets["shuffled"][1], sets["eldr"][0])
    total = DECODE.sum(axis=0) / DECODE.sum(axis=(0, 2))[:, None]
    np.testing.assert_allclose(sets["global"][1], total)
    # Layer 1 only: ½ Σ |(2,3,1,1)/7 − (1,1,1,1)/4|.
    want = 0.5 * np.abs(np.array([2, 3, 1, 1]) / 7 - 0.25).sum()
    assert bench.total_variation(sets["eldr"]) == pytest.approx(want)
    assert bench.total_variation(sets["eldr"][:1]) == 0.0
    # τ = 0: every request to its nearest centroid, whatever the loads.
    np.testing.assert_array_equal(bench.route_requests(fit, PREFILL, 0.0, 1, seed=3),
                                  [0, 0, 1, 1])
    # τ = 1: least loaded among all (JSQ over the window): decoders alternate.
    routed = bench.route_requests(fit, np.repeat(PREFILL[:1], 6, axis=0), 1.0, 8, seed=0)
    assert sorted(np.bincount(routed)) == [3, 3]
    assert [bench.bucket(n) for n in (0, 1, 64, 65, 300)] == [64, 64, 64, 128, 512]
    assert bench.parse_weights("0.5,0,1") == (0.0, 0.5, 1.0)
    # Gains 1, 0 | 0.5 (requests a, a | b): mean 0.5; D = (1, 0.5), n = (2, 1):
    # SE = sqrt(2 · ((1 − 1)² + (0.5 − 0.5)²)) / 3 = 0; then a spread case by hand.
    assert bench.paired_gain(np.array([1.0, 0.0, 0.5]), np.zeros(3), np.array([4, 4, 9])) \
        == (pytest.approx(0.5), pytest.approx(0.0))
    gain, se = bench.paired_gain(np.array([1.0, 1.0, 0.0]), np.zeros(3), np.array([0, 0, 1]))
    # mean 2/3; D − ḡn = (2 − 4/3, 0 − 2/3) = (2/3, −2/3); SE = sqrt(2 · 8/9) / 3.
    assert gain == pytest.approx(2 / 3) and se == pytest.approx(np.sqrt(16 / 9) / 3)
    for bad in ("0.5,1", "0,1.5", "x"):
        with pytest.raises(SystemExit):
            bench.parse_weights(bad)


@pytest.mark.slow    # ~35 s: traces the demo-e32 model, trains an estimator
def test_benchmark_quick_writes_its_keys(tmp_path):
    from benchmarks import prefetch_prior as bench

    path = tmp_path / "prior.json"
    bench.main(["--quick", "--per-domain", "2", "--steps", "5", "--weights", "0,0.3,1",
                "--json", str(path)])
    figures = json.loads(path.read_text())
    recalls = [f"prefetch_recall_{p}_{s}_prior" for p in bench.PREDICTORS
               for s in ("no", "eldr", "shuffled", "global")]
    recalls += [f"prefetch_recall_prior_only{t}" for t in ("", "_shuffled", "_global")]
    weights = [f"prefetch_prior_weight_{p}{t}" for p in bench.PREDICTORS
               for t in ("", "_shuffled", "_global")] + ["prefetch_prior_weight"]
    for key in recalls:
        assert 0.0 <= figures[key] <= 1.0, key
    for key in weights:
        assert figures[key] in (0.0, 0.3, 1.0), key
    for p in bench.PREDICTORS:
        for t in ("", "_shuffled", "_global"):
            assert figures[f"eldr_prior_recall_gain_{p}{t}"] == pytest.approx(
                figures[f"prefetch_recall_{p}_{t[1:] or 'eldr'}_prior"]
                - figures[f"prefetch_recall_{p}_no_prior"])
            assert figures[f"eldr_prior_recall_gain_{p}{t}_se"] >= 0.0
        assert figures[f"eldr_over_global_recall_gain_{p}"] == pytest.approx(
            figures[f"prefetch_recall_{p}_eldr_prior"] - figures[f"prefetch_recall_{p}_global_prior"])
    assert 0.0 <= figures["prior_total_variation"] <= 1.0
    assert figures["heldout_decode_tokens"] == sum(
        figures[f"heldout_decode_tokens_decoder{d}"] for d in range(figures["decoders"])) > 0
    assert figures["decoders"] == 2
