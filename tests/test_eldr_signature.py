"""ELDR's expert signatures (``moejax.eldr.signature``) against independent float64 loop
references: IDF, the layer mask and the L2 norm of Count·IDF signatures, the binary and
softmax baselines, the router's probability sums, ρ over explicitly enumerated pairs,
and the greedy layer selection on counts where one layer carries the decode structure."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.stats

from moejax.eldr import signature as sig

N, L, E = 9, 4, 6


def _counts(seed: int = 0) -> np.ndarray:
    """Sparse random counts [N, L, E] (many zeros, so df varies), request 3 all zero."""
    rng = np.random.default_rng(seed)
    counts = rng.integers(0, 5, (N, L, E)) * (rng.random((N, L, E)) < 0.5)
    counts[3] = 0
    return counts


def _idf_reference(counts: np.ndarray) -> np.ndarray:
    n, layers, experts = counts.shape
    out = np.zeros((layers, experts))
    for l in range(layers):
        for e in range(experts):
            df = sum(1 for r in range(n) if counts[r, l, e] > 0)
            out[l, e] = math.log((n + 1) / (df + 1))
    return out


def _signature_reference(counts: np.ndarray, idf: np.ndarray, layers: list[int]) -> list[float]:
    """One request's signature, element by element."""
    x = [float(counts[l, e]) * float(idf[l, e]) for l in layers for e in range(counts.shape[1])]
    norm = math.sqrt(sum(v * v for v in x))
    return [v / norm for v in x] if norm > 0 else [0.0] * len(x)


def _cos_dist(a: np.ndarray, b: np.ndarray) -> float:
    na, nb = math.sqrt(sum(v * v for v in a)), math.sqrt(sum(v * v for v in b))
    if na == 0 or nb == 0:
        return 1.0
    return 1.0 - sum(float(x) * float(y) for x, y in zip(a, b)) / (na * nb)


# ----------------------------------------------------------------------------- IDF
def test_idf_matches_the_formula():
    counts = _counts()
    np.testing.assert_allclose(sig.idf_weights(counts), _idf_reference(counts), rtol=1e-12)
    # an expert that fires in every request has weight log((N+1)/(N+1)) = 0
    everywhere = np.ones((5, 2, 3), np.int64)
    np.testing.assert_array_equal(sig.idf_weights(everywhere), np.zeros((2, 3)))


@pytest.mark.parametrize("shape", [(0, 2, 3), (4, 3)])
def test_idf_refuses_bad_shapes(shape):
    with pytest.raises(ValueError, match=r"\[N >= 1, L, E\]"):
        sig.idf_weights(np.zeros(shape, np.int64))


# ----------------------------------------------------------------------------- signatures
@pytest.mark.parametrize("layers", [[0, 1, 2, 3], [2], [1, 3], [3, 0]])
def test_count_idf_signatures_match_the_reference(layers):
    counts = _counts(1)
    idf = sig.idf_weights(counts)
    got = sig.signatures(counts, idf, layers)
    chosen = sorted(layers)                          # the mask is a set: layer order is sorted
    assert got.shape == (N, len(chosen) * E)
    for r in range(N):
        np.testing.assert_allclose(got[r], _signature_reference(counts[r], idf, chosen),
                                   rtol=1e-12, atol=1e-15)
        # one request alone gives the same vector as in the batch
        np.testing.assert_allclose(sig.signatures(counts[r], idf, layers), got[r], rtol=1e-12)


def test_only_the_selected_layers_contribute():
    counts = _counts(2)
    idf = sig.idf_weights(counts)
    base = sig.signatures(counts, idf, [1, 3])
    changed = counts.copy()
    changed[:, [0, 2]] = np.random.default_rng(5).integers(0, 9, (N, 2, E))
    np.testing.assert_array_equal(sig.signatures(changed, idf, [1, 3]), base)
    changed[:, 3] += 1                               # a selected layer does change it
    assert not np.allclose(sig.signatures(changed, idf, [1, 3]), base)
    # the blocks come in layer order: layer 1's E entries, then layer 3's
    x = sig.weighted_counts(counts, idf, [3, 1])
    np.testing.assert_allclose(x[:, :E], counts[:, 1] * idf[1])
    np.testing.assert_allclose(x[:, E:], counts[:, 3] * idf[3])


def test_signatures_are_unit_and_a_zero_request_stays_zero():
    counts = _counts(3)
    s = sig.signatures(counts, sig.idf_weights(counts), range(L))
    norms = np.linalg.norm(s, axis=1)
    assert np.all(s[3] == 0)
    nonzero = np.delete(norms, 3)
    np.testing.assert_allclose(nonzero, 1.0, rtol=1e-12)


@pytest.mark.parametrize("layers,match", [([], "at least one layer"), ([0, L], "outside"),
                                          ([-1], "outside")])
def test_bad_layers_are_refused(layers, match):
    counts = _counts()
    with pytest.raises(ValueError, match=match):
        sig.signatures(counts, sig.idf_weights(counts), layers)


def test_idf_of_the_wrong_shape_is_refused():
    with pytest.raises(ValueError, match="idf has shape"):
        sig.signatures(_counts(), np.ones((L, E + 1)), [0])


# ----------------------------------------------------------------------------- baselines
def test_binary_signatures_match_the_reference():
    counts = _counts(4)
    got = sig.binary_signatures(counts)
    for r in range(N):
        flags = [1.0 if counts[r, l, e] > 0 else 0.0 for l in range(L) for e in range(E)]
        norm = math.sqrt(sum(flags))
        want = [f / norm for f in flags] if norm else flags
        np.testing.assert_allclose(got[r], want, rtol=1e-12)


def test_router_probability_sums_and_softmax_signatures_match_the_reference():
    rng = np.random.default_rng(6)
    tokens, d = 5, 7
    inputs = rng.standard_normal((L, tokens, d)).astype(np.float32)
    router = rng.standard_normal((L, d, E)).astype(np.float32)
    got = sig.router_probability_sums(inputs, router)
    want = np.zeros((L, E))
    for l in range(L):
        for t in range(tokens):
            logits = [sum(float(inputs[l, t, i]) * float(router[l, i, e]) for i in range(d))
                      for e in range(E)]
            top = max(logits)
            exps = [math.exp(v - top) for v in logits]
            for e in range(E):
                want[l, e] += exps[e] / sum(exps)
    np.testing.assert_allclose(got, want, rtol=1e-10)
    np.testing.assert_allclose(got.sum(axis=1), tokens, rtol=1e-12)   # each token sums to 1
    stacked = np.stack([got, 2 * got])
    soft = sig.softmax_signatures(stacked)
    flat = want.reshape(-1)
    np.testing.assert_allclose(soft[0], flat / np.linalg.norm(flat), rtol=1e-10)
    np.testing.assert_allclose(soft[1], soft[0], rtol=1e-12)           # scale-free


def test_decode_profiles_are_shares_of_decode_tokens():
    counts = np.array([[[2, 0, 1], [0, 3, 0]], [[0, 0, 0], [0, 0, 0]]])
    got = sig.decode_profiles(counts, np.array([3, 0]))
    np.testing.assert_allclose(got[0], [2 / 3, 0, 1 / 3, 0, 1, 0])
    np.testing.assert_array_equal(got[1], np.zeros(6))


# ----------------------------------------------------------------------------- ρ
def test_condensed_distances_enumerate_pairs_in_row_major_order():
    rng = np.random.default_rng(7)
    x = rng.random((6, 4))
    x[2] = 0
    got = sig.condensed_cosine_distances(x)
    want = [_cos_dist(x[i], x[j]) for i in range(6) for j in range(i + 1, 6)]
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_pair_rho_is_spearman_over_every_pair(seed):
    rng = np.random.default_rng(seed)
    n = 12
    latent = rng.random((n, 3))
    s = np.hstack([latent, 0.5 * rng.random((n, 5))])
    p = np.hstack([latent, 0.5 * rng.random((n, 4))])
    pairs = [(i, j) for i in range(n) for j in range(i + 1, n)]
    a = [_cos_dist(s[i], s[j]) for i, j in pairs]
    b = [_cos_dist(p[i], p[j]) for i, j in pairs]
    want = scipy.stats.spearmanr(a, b).statistic
    assert sig.pair_rho(s, p) == pytest.approx(want, abs=1e-12)
    assert sig.pair_rho(s, s) == pytest.approx(1.0)


def test_pair_rho_is_nan_when_one_side_is_constant_and_needs_three_requests():
    rng = np.random.default_rng(8)
    s = rng.random((5, 4))
    assert math.isnan(sig.pair_rho(s, np.ones((5, 3))))
    with pytest.raises(ValueError, match="N >= 3"):
        sig.pair_rho(s[:2], s[:2])
    with pytest.raises(ValueError, match="same N"):
        sig.pair_rho(s, s[:4])


# ----------------------------------------------------------------------------- layer selection
def _structured_counts(informative: int, seed: int = 0
                       ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Requests of 4 latent groups. Decode usage and the prompt counts at layer
    ``informative`` follow the group (each group prefers its own experts); every other
    layer's prompt counts are uniform noise."""
    rng = np.random.default_rng(seed)
    n, layers, experts, groups = 40, 4, 16, 4
    group = np.arange(n) % groups
    prefill = rng.integers(0, 4, (n, layers, experts))
    decode = rng.integers(0, 2, (n, layers, experts))
    for r in range(n):
        own = slice(4 * group[r], 4 * group[r] + 4)
        prefill[r, informative] = rng.integers(0, 2, experts)
        prefill[r, informative, own] += rng.integers(4, 9, 4)
        decode[r, :, own] += rng.integers(3, 7, (layers, 4))
    tokens = decode.sum(axis=2).max(axis=1)
    return prefill, decode, tokens


@pytest.mark.parametrize("informative", [0, 2])
def test_select_layers_picks_the_layer_that_carries_the_decode_structure(informative):
    prefill, decode, tokens = _structured_counts(informative)
    idf = sig.idf_weights(prefill)
    profiles = sig.decode_profiles(decode, tokens)
    selection = sig.select_layers(prefill, idf, profiles)
    assert selection.order[0] == informative
    assert sorted(selection.order) == list(range(4))
    assert informative in selection.layers
    peak = int(np.argmax(selection.rho_by_size))
    assert selection.layers == tuple(sorted(selection.order[:peak + 1]))
    assert selection.rho == max(selection.rho_by_size)
    alone = sig.pair_rho(sig.signatures(prefill, idf, [informative]), profiles)
    assert selection.rho_by_size[0] == pytest.approx(alone)
    noise = [sig.pair_rho(sig.signatures(prefill, idf, [l]), profiles)
             for l in range(4) if l != informative]
    assert alone > 0.4 and max(noise) < 0.2
