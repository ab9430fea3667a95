"""ELDR's offline fit: balanced and plain spherical K-means (``moejax.eldr.kmeans``), the
fit file (``moejax.eldr.fitfile``: round trip, malformed files, stale fits), the fit
from an expert trace (``moejax.eldr.fitting``) and ``moejax eldr-fit`` end to end on
synthetic traces of the demo-e32 shape."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

from moejax import traces
from moejax.eldr import fitfile, fitting, kmeans as km
from moejax.eldr.fitfile import EldrFit, FitError
from moejax.traces import RequestTrace, Trace

# demo-e32's routing shape (moejax/demo/configs/demo-e32.yaml)
E32_LAYERS, E32_EXPERTS, E32_TOP_K = 6, 32, 4


# ----------------------------------------------------------------------------- helpers
def _unit_rows(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _separated(sizes: list[int], dim: int = 24, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Non-negative unit vectors in len(sizes) groups on disjoint coordinate blocks (like
    signatures of domains with disjoint experts), and each point's group."""
    rng = np.random.default_rng(seed)
    block = dim // len(sizes)
    points, labels = [], []
    for group, size in enumerate(sizes):
        x = 0.05 * rng.random((size, dim))
        x[:, group * block:(group + 1) * block] += rng.random((size, block)) + 0.5
        points.append(x)
        labels += [group] * size
    return _unit_rows(np.concatenate(points)), np.array(labels)


def _same_partition(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two labelings group the points alike (up to renaming the labels)."""
    pairs = set(zip(a.tolist(), b.tolist()))
    return len(pairs) == len(set(a.tolist())) == len(set(b.tolist()))


def _domain_requests(rng: np.random.Generator, domains: int, per_domain: int, *,
                     num_layers: int, num_experts: int, top_k: int) -> list[RequestTrace]:
    """Requests of ``domains`` domains whose prompts and decodes draw their top-k experts
    from the domain's own block of experts (disjoint blocks)."""
    pool = num_experts // domains
    requests = []
    for index in range(domains * per_domain):
        domain = index % domains
        experts = np.arange(domain * pool, (domain + 1) * pool)
        n, g = int(rng.integers(5, 13)), int(rng.integers(3, 9))

        def draw(tokens: int) -> np.ndarray:
            return np.array([[rng.choice(experts, top_k, replace=False) for _ in range(tokens)]
                             for _ in range(num_layers)], np.int32).reshape(
                num_layers, tokens, top_k)

        requests.append(RequestTrace(
            id=str(index), domain=f"d{domain}",
            prompt_token_ids=rng.integers(2, 1000, n).astype(np.int32),
            generated_token_ids=rng.integers(2, 1000, g).astype(np.int32),
            prefill_experts=draw(n), prefill_weights=np.full((num_layers, n, top_k), 0.25,
                                                             np.float32),
            decode_experts=draw(g - 1), decode_weights=np.full((num_layers, g - 1, top_k),
                                                               0.25, np.float32),
            finish_reason="length"))
    return requests


def _domain_trace(seed: int = 0, *, domains: int = 3, per_domain: int = 8,
                  num_layers: int = 3, num_experts: int = 12, top_k: int = 2,
                  model: str = "toy", failed: bool = False) -> Trace:
    rng = np.random.default_rng(seed)
    requests = _domain_requests(rng, domains, per_domain, num_layers=num_layers,
                                num_experts=num_experts, top_k=top_k)
    if failed:
        requests.insert(1, RequestTrace.failed("bad", "line 2: invalid JSON",
                                               num_layers=num_layers, top_k=top_k))
    return Trace.from_requests(requests, num_layers=num_layers, top_k=top_k,
                               num_experts=num_experts, model=model)


@pytest.fixture(scope="module")
def demo_e32():
    """demo-e32's config and router fingerprint (computed here from its weights)."""
    from moejax.checkpoint import load_model_dir
    from serving.api import resolve_model_dir

    cfg, params, _ = load_model_dir(resolve_model_dir("demo-e32")[0], "float32")
    return cfg, fitfile.model_fingerprint(cfg, params["layers"]["router"])


# ----------------------------------------------------------------------------- K-means
@pytest.mark.parametrize("n,k", [(12, 4), (10, 3), (31, 8), (5, 4), (9, 9), (9, 1), (50, 7)])
def test_balanced_kmeans_respects_the_capacity(n, k):
    x = _unit_rows(np.random.default_rng(n * 100 + k).random((n, 6)))
    result = km.balanced_kmeans(x, k, seed=3)
    cap = math.ceil(n / k)
    assert km.capacity(n, k) == cap
    assert result.assignment.shape == (n,) and result.centroids.shape == (k, 6)
    assert result.sizes.sum() == n and result.sizes.max() <= cap
    assert result.sizes.min() >= 1                  # no centroid is left without a point
    np.testing.assert_allclose(np.linalg.norm(result.centroids, axis=1), 1.0, rtol=1e-12)
    distance = 1.0 - np.sum(x * result.centroids[result.assignment], axis=1)
    assert result.objective == pytest.approx(distance.sum(), abs=1e-9)
    assert 1 <= result.iterations <= km.DEFAULT_MAX_ITERATIONS
    if k == n:                                      # one point each: every centroid is its point
        np.testing.assert_allclose(result.centroids[result.assignment], x, atol=1e-12)
        assert result.objective == pytest.approx(0.0, abs=1e-9)


@pytest.mark.parametrize("method", ["balanced", "plain"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_kmeans_recovers_well_separated_clusters(method, seed):
    x, labels = _separated([10, 10, 10, 10], seed=seed)
    result = km.KMEANS[method](x, 4, seed=seed)
    assert _same_partition(result.assignment, labels)
    assert result.converged and result.iterations < km.DEFAULT_MAX_ITERATIONS
    for group in range(4):          # each centroid points into its group's block
        centroid = result.centroids[result.assignment[labels == group][0]]
        assert np.argmax(centroid) // 6 == group


def test_plain_kmeans_overfills_a_skewed_set_where_balanced_does_not():
    x, labels = _separated([20, 5, 5], seed=4)
    cap = km.capacity(30, 3)
    plain = km.plain_kmeans(x, 3, seed=0)
    balanced = km.balanced_kmeans(x, 3, seed=0)
    assert _same_partition(plain.assignment, labels)    # the natural clusters ...
    assert plain.sizes.max() == 20 > cap                 # ... one of them over capacity
    assert balanced.sizes.max() <= cap and balanced.sizes.sum() == 30
    assert balanced.objective >= plain.objective         # the price of the capacity
    # the two small groups stay whole under the balanced assignment
    for group in (1, 2):
        assert len(set(balanced.assignment[labels == group].tolist())) == 1


@pytest.mark.parametrize("method", ["balanced", "plain"])
def test_kmeans_is_deterministic_for_a_seed(method):
    x = _unit_rows(np.random.default_rng(11).random((40, 8)))
    a = km.KMEANS[method](x, 5, seed=7)
    b = km.KMEANS[method](x, 5, seed=7)
    np.testing.assert_array_equal(a.assignment, b.assignment)
    np.testing.assert_array_equal(a.centroids, b.centroids)
    assert (a.iterations, a.objective, a.converged) == (b.iterations, b.objective, b.converged)


@pytest.mark.parametrize("method", ["balanced", "plain"])
def test_no_cluster_ends_empty_with_fewer_distinct_points_than_clusters(method):
    # two directions, four clusters: k-means++ must draw duplicate centroids, and the
    # clusters the assignment leaves empty (balanced too: cap = 2, (K - 1) * cap >= N)
    # are re-seeded rather than left without a point
    x = np.array([[1.0, 0.0]] * 3 + [[0.0, 1.0]] * 2)
    result = km.KMEANS[method](x, 4, seed=0, max_iterations=5)
    assert result.sizes.min() >= 1 and result.sizes.sum() == 5
    if method == "balanced":
        assert result.sizes.max() <= 2
    assert result.iterations <= 5


def test_max_iterations_bounds_the_run():
    x = _unit_rows(np.random.default_rng(12).random((60, 5)))
    result = km.balanced_kmeans(x, 6, seed=0, max_iterations=1)
    assert result.iterations == 1 and not result.converged
    assert result.sizes.max() <= 10


@pytest.mark.parametrize("kwargs,match", [
    (dict(k=0), "k must be an integer >= 1, got 0"),
    (dict(k=11), "k = 11 clusters for N = 10 points"),
    (dict(k=2.0), "k must be an integer"),
    (dict(k=True), "k must be an integer"),
    (dict(k=2, seed=-1), "seed must be an integer >= 0"),
    (dict(k=2, max_iterations=0), "max_iterations must be an integer >= 1"),
])
def test_bad_arguments_are_refused(kwargs, match):
    x = _unit_rows(np.random.default_rng(0).random((10, 3)))
    for method in km.KMEANS.values():
        with pytest.raises(ValueError, match=match):
            method(x, **kwargs)


def test_bad_points_are_refused():
    with pytest.raises(ValueError, match=r"x must be points \[N >= 1, D >= 1\], got shape \(4,\)"):
        km.balanced_kmeans(np.ones(4), 1)
    with pytest.raises(ValueError, match="NaN"):
        km.plain_kmeans(np.array([[1.0, np.nan], [0.0, 1.0]]), 1)


# ----------------------------------------------------------------------------- fit file
def _small_fit(**overrides) -> EldrFit:
    rng = np.random.default_rng(1)
    fields = dict(model="demo-e32", fingerprint="f" * 64, num_layers=E32_LAYERS,
                  num_experts=E32_EXPERTS, top_k=E32_TOP_K,
                  idf=rng.random((E32_LAYERS, E32_EXPERTS)), layers=(0, 2, 5),
                  centroids=_unit_rows(rng.random((2, 3 * E32_EXPERTS))),
                  calibration_requests=40, rho=0.625, clustering="plain", seed=3, iterations=7)
    fields.update(overrides)
    return EldrFit(**fields)


def _assert_same_fit(a: EldrFit, b: EldrFit) -> None:
    for name in ("model", "fingerprint", "num_layers", "num_experts", "top_k", "layers",
                 "calibration_requests", "rho", "clustering", "seed", "iterations"):
        assert getattr(a, name) == getattr(b, name), name
    np.testing.assert_array_equal(a.idf, b.idf)
    np.testing.assert_array_equal(a.centroids, b.centroids)


def test_a_fit_round_trips_exactly(tmp_path):
    fit = _small_fit()
    path = tmp_path / "router.fit"
    fitfile.save(path, fit)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["router.fit"]
    _assert_same_fit(fitfile.load(path), fit)


def _rewrite(tmp_path, edit) -> str:
    """A saved fit with its arrays edited by ``edit(dict)``, written back."""
    good = tmp_path / "good.npz"
    fitfile.save(good, _small_fit())
    with np.load(good) as archive:
        arrays = {key: archive[key] for key in archive.files}
    edit(arrays)
    bad = str(tmp_path / "bad.npz")
    with open(bad, "wb") as fh:
        np.savez(fh, **arrays)
    return bad


@pytest.mark.parametrize("edit,match", [
    (lambda a: a.pop("centroids"), "key 'centroids': missing"),
    (lambda a: a.pop("rho"), "key 'rho': missing"),
    (lambda a: a.update(format=np.array("moejax-expert-trace")), "key 'format'"),
    (lambda a: a.pop("format"), "key 'format'"),
    (lambda a: a.update(version=np.array(2, np.int64)), "key 'version': the file is version 2"),
    (lambda a: a.update(centroids=np.ones((2, 5))), r"centroids: shape \(2, 5\)"),
    (lambda a: a.update(idf=np.ones((6, 31))), r"idf: shape \(6, 31\)"),
    (lambda a: a.update(layers=np.ones((2, 2), np.int64)), "key 'layers': expected a 1-d"),
    (lambda a: a.update(top_k=np.array(4.0)), "key 'top_k': expected an int64"),
])
def test_a_malformed_fit_file_is_refused_naming_the_key(tmp_path, edit, match):
    bad = _rewrite(tmp_path, edit)
    with pytest.raises(FitError, match=match) as info:
        fitfile.load(bad)
    assert bad in str(info.value)                       # the file is named too


def test_a_missing_or_foreign_fit_file(tmp_path):
    missing = tmp_path / "nope.npz"
    with pytest.raises(FileNotFoundError, match="no ELDR fit file .*moejax eldr-fit"):
        fitfile.load(missing)
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"not a zip")
    with pytest.raises(FitError, match="not an ELDR fit file"):
        fitfile.load(junk)


def test_check_model_refuses_a_stale_fit_and_another_decoder_count(demo_e32):
    cfg, fingerprint = demo_e32
    fit = _small_fit(fingerprint=fingerprint)
    fit.check_model(cfg, fingerprint, 2)                # the model it was fitted for: fine
    with pytest.raises(FitError, match=r"stale.*refit it with `moejax eldr-fit TRACES -o FIT "
                                       r"--decoders 2`"):
        fit.check_model(cfg, "0" * 64, 2)
    with pytest.raises(FitError, match=r"2 centroids .* 3 decoders were asked for; refit "
                                       r"with --decoders 3"):
        fit.check_model(cfg, fingerprint, 3)
    other = _small_fit(fingerprint=fingerprint, num_experts=16, idf=np.ones((6, 16)),
                       centroids=np.ones((2, 48)))
    with pytest.raises(FitError, match="16 experts.*this model has 6 layers, 32 experts"):
        other.check_model(cfg, fingerprint, 2)


# ----------------------------------------------------------------------------- fit()
@pytest.mark.parametrize("clustering", ["balanced", "plain"])
def test_fit_puts_each_domain_on_one_centroid(clustering):
    trace = _domain_trace(0, failed=True)
    details = fitting.fit_trace_detailed(trace, 3, fingerprint="abc", clustering=clustering,
                                         seed=5)
    fit = details.fit
    assert (fit.model, fit.fingerprint, fit.clustering, fit.seed) == ("toy", "abc",
                                                                       clustering, 5)
    assert (fit.num_layers, fit.num_experts, fit.top_k) == (3, 12, 2)
    assert fit.calibration_requests == 24               # the errored request is left out
    assert fit.num_decoders == 3 and fit.iterations == details.clusters.iterations >= 1
    assert fit.rho > 0.5 and fit.rho == details.selection.rho
    assert fit.layers == details.selection.layers
    counts = fitting.trace_counts(trace)
    domains = np.array(counts.domains)
    nearest = np.argmax(fit.signature(counts.prefill) @ fit.centroids.T, axis=1)
    owners = {domain: set(nearest[domains == domain].tolist()) for domain in set(domains)}
    assert all(len(owner) == 1 for owner in owners.values())          # one centroid each
    assert len(set().union(*owners.values())) == 3                     # a different one
    assert _same_partition(details.clusters.assignment, nearest)
    # fit() is fit_trace_detailed's fit
    _assert_same_fit(fitting.fit(trace, 3, fingerprint="abc", clustering=clustering, seed=5),
                     fit)


def test_fit_counts_matches_the_trace_fit_and_takes_given_layers():
    trace = _domain_trace(1)
    counts = fitting.trace_counts(trace)
    np.testing.assert_array_equal(counts.prefill, traces.activation_counts(trace, "prefill"))
    np.testing.assert_array_equal(counts.decode_tokens, np.diff(trace.arrays["decode_offsets"]))
    a = fitting.fit_counts(counts.prefill, counts.decode, counts.decode_tokens, 3,
                           fingerprint="abc", model="toy", top_k=2, layers=[2, 0])
    assert a.layers == (0, 2)
    from moejax.eldr import signature as sig
    idf = sig.idf_weights(counts.prefill)
    np.testing.assert_array_equal(a.idf, idf)
    want = sig.pair_rho(sig.signatures(counts.prefill, idf, (0, 2)),
                        sig.decode_profiles(counts.decode, counts.decode_tokens))
    assert a.rho == pytest.approx(want)
    _assert_same_fit(fitting.fit(trace, 3, fingerprint="abc", layers=(0, 2)), a)


def test_fit_pools_several_traces_of_one_model(tmp_path):
    paths = []
    for seed in (2, 3):
        paths.append(str(tmp_path / f"t{seed}.npz"))
        traces.save(paths[-1], _domain_trace(seed))
    loaded = fitting.load_traces(paths)
    pooled = fitting.fit(loaded, 3, fingerprint="abc")
    assert pooled.calibration_requests == 48
    other = _domain_trace(4, num_experts=16)
    with pytest.raises(ValueError, match="num_experts is 16, but trace 0 has 12"):
        fitting.fit([loaded[0], other], 3, fingerprint="abc")
    traces.save(tmp_path / "other.npz", _domain_trace(4, model="else"))
    with pytest.raises(ValueError, match="other.npz: model is 'else'"):
        fitting.load_traces([paths[0], str(tmp_path / "other.npz")])


def test_fit_refuses_bad_inputs():
    trace = _domain_trace(5, per_domain=2)                # 6 requests
    with pytest.raises(ValueError, match="num_decoders = 7 centroids from 6 calibration"):
        fitting.fit(trace, 7, fingerprint="abc")
    with pytest.raises(ValueError, match="num_decoders must be a positive integer, got 0"):
        fitting.fit(trace, 0, fingerprint="abc")
    with pytest.raises(ValueError, match="clustering must be one of"):
        fitting.fit(trace, 2, fingerprint="abc", clustering="kmeans")
    with pytest.raises(ValueError, match="fingerprint must be"):
        fitting.fit(trace, 2, fingerprint="")
    with pytest.raises(ValueError, match=r"layers \[7\] outside \[0, 3\)"):
        fitting.fit(trace, 2, fingerprint="abc", layers=[7])
    counts = fitting.trace_counts(trace)
    with pytest.raises(ValueError, match="decode_tokens: 2 of the 6 requests have decode"):
        tokens = counts.decode_tokens.copy()
        tokens[2:] = 0
        fitting.fit_counts(counts.prefill, counts.decode, tokens, 2, fingerprint="abc",
                           model="toy", top_k=2)
    with pytest.raises(ValueError, match="decode_counts has shape"):
        fitting.fit_counts(counts.prefill, counts.decode[:, :2], counts.decode_tokens, 2,
                           fingerprint="abc", model="toy", top_k=2)
    with pytest.raises(ValueError, match="prefill_counts must be a 3-d integer array"):
        fitting.fit_counts(counts.prefill.astype(float), counts.decode, counts.decode_tokens,
                           2, fingerprint="abc", model="toy", top_k=2)
    with pytest.raises(ValueError, match=r"top_k must be an integer in \[1, 12\], got 13"):
        fitting.fit_counts(counts.prefill, counts.decode, counts.decode_tokens, 2,
                           fingerprint="abc", model="toy", top_k=13)


def test_fit_refuses_to_select_layers_when_rho_is_undefined():
    # ρ is NaN when one side's pairwise distances are all equal
    rng = np.random.default_rng(6)
    varied = rng.integers(0, 3, (6, 2, 4)) + np.eye(6, 4, dtype=np.int64)[:, None]
    everywhere = np.ones((6, 2, 4), np.int64)       # every IDF weight 0: zero signatures
    with pytest.raises(ValueError, match="ρ is undefined at every layer, the signatures"):
        fitting.fit_counts(everywhere, varied, np.full(6, 4), 2, fingerprint="abc",
                           model="m", top_k=2)
    with pytest.raises(ValueError, match="ρ is undefined, the decode profiles"):
        fitting.fit_counts(varied, everywhere, np.full(6, 2), 2, fingerprint="abc",
                           model="m", top_k=2)
    with pytest.raises(ValueError, match=r"every calibration signature is zero over layers "
                                         r"\[1\]"):
        fitting.fit_counts(everywhere, varied, np.full(6, 4), 2, fingerprint="abc",
                           model="m", top_k=2, layers=[1])
    given = fitting.fit_counts(varied, everywhere, np.full(6, 2), 2, fingerprint="abc",
                               model="m", top_k=2, layers=[1])
    assert given.layers == (1,) and math.isnan(given.rho)  # given layers: ρ recorded as is


# ----------------------------------------------------------------------------- the CLI
def _run_cli(argv, monkeypatch) -> int:
    from serving.cli import main

    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))   # main() appends flags
    return main(argv)


def _e32_trace(path, seed: int = 0, **overrides) -> str:
    shape = dict(num_layers=E32_LAYERS, num_experts=E32_EXPERTS, top_k=E32_TOP_K,
                 model="demo-e32", domains=4, per_domain=4)
    shape.update(overrides)
    traces.save(path, _domain_trace(seed, **shape))
    return str(path)


def test_cli_fits_demo_e32_traces(tmp_path, monkeypatch, capsys, demo_e32):
    cfg, fingerprint = demo_e32
    first = _e32_trace(tmp_path / "a.npz", 0)
    out = str(tmp_path / "router.fit")
    assert _run_cli(["eldr-fit", first, "-o", out, "--decoders", "2"], monkeypatch) == 0
    err = capsys.readouterr().err
    assert "eldr-fit: 16 requests" in err and "cluster sizes [8, 8]" in err
    fit = fitfile.load(out)
    assert fit.fingerprint == fingerprint and fit.model == "demo-e32"
    assert fit.num_decoders == 2 and fit.calibration_requests == 16
    fit.check_model(cfg, fingerprint, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.npz", "router.fit"]  # no temp
    # two traces pooled, given layers, plain clustering, a seed
    second = _e32_trace(tmp_path / "b.npz", 1)
    assert _run_cli(["eldr-fit", first, second, "-o", out, "--decoders", "4", "--layers",
                     "0,3", "--clustering", "plain", "--seed", "9", "--model", "demo-e32"],
                    monkeypatch) == 0
    fit = fitfile.load(out)
    assert (fit.calibration_requests, fit.layers, fit.clustering, fit.seed,
            fit.num_decoders) == (32, (0, 3), "plain", 9, 4)
    assert "(given)" in capsys.readouterr().err


def test_cli_refuses_a_trace_of_another_shape(tmp_path, monkeypatch, capsys):
    path = _e32_trace(tmp_path / "e16.npz", num_experts=16)
    out = tmp_path / "router.fit"
    assert _run_cli(["eldr-fit", path, "-o", str(out), "--decoders", "2"], monkeypatch) == 2
    err = capsys.readouterr().err
    assert err.startswith("moejax: error: ") and err.count("\n") == 1
    assert "6 layers, 16 experts, top-4, but model 'demo-e32' has 6 layers, 32 experts" in err
    assert not out.exists()


@pytest.mark.parametrize("case,match", [
    ("missing", "no trace file at .*none.npz"),
    ("no-model", "do not name their model; give --model"),
    ("too-many-decoders", "num_decoders = 17 centroids from 16 calibration requests"),
    ("bad-layer", r"layers \[1, 6\] outside \[0, 6\)"),
    ("output-is-input", "is the input trace"),
    ("output-dir-missing", "does not exist"),
])
def test_cli_errors_exit_2_with_one_line(tmp_path, monkeypatch, capsys, case, match):
    good = _e32_trace(tmp_path / "t.npz")
    out = str(tmp_path / "router.fit")
    argv = {"missing": [str(tmp_path / "none.npz"), "-o", out, "--decoders", "2"],
            "no-model": [_e32_trace(tmp_path / "anon.npz", model=""), "-o", out,
                         "--decoders", "2"],
            "too-many-decoders": [good, "-o", out, "--decoders", "17"],
            "bad-layer": [good, "-o", out, "--decoders", "2", "--layers", "1,6"],
            "output-is-input": [good, "-o", good, "--decoders", "2"],
            "output-dir-missing": [good, "-o", str(tmp_path / "no" / "f.npz"),
                                   "--decoders", "2"]}[case]
    assert _run_cli(["eldr-fit", *argv], monkeypatch) == 2
    err = capsys.readouterr().err
    assert err.startswith("moejax: error: ") and err.count("\n") == 1
    assert __import__("re").search(match, err), err
    assert not os.path.exists(out)


@pytest.mark.parametrize("flag,value", [("--layers", "0,0"), ("--layers", "a"),
                                        ("--decoders", "0"), ("--seed", "-1"),
                                        ("--clustering", "kmeans")])
def test_cli_refuses_bad_option_values(tmp_path, monkeypatch, capsys, flag, value):
    argv = ["eldr-fit", "t.npz", "-o", str(tmp_path / "f"), "--decoders", "2", flag, value]
    with pytest.raises(SystemExit) as info:
        _run_cli(argv, monkeypatch)
    assert info.value.code == 2 and flag in capsys.readouterr().err
