"""Expert signatures and their quality (ELDR §"Expert Signature").

A request's raw counts c_r [L, E]: how many of its prompt tokens have expert e in their
top-k at layer l (token counts, not gate probabilities). With calibration counts C
[N, L, E]:

* IDF: w(l, e) = log((N + 1) / (df(l, e) + 1)), df(l, e) = the calibration requests in
  which e fires at l (:func:`idf_weights`);
* x_r = the concatenation over the selected layers S of c_r(l) · w(l), s_r = x_r / ‖x_r‖₂
  (:func:`signatures`; a request with no weight anywhere keeps the zero vector).

ρ (:func:`pair_rho`): Spearman's rank correlation, over every unordered pair i < j of
the evaluated requests (all pairs, not a sample: N(N-1)/2 pairs, 130k for 512
requests), between the cosine distance of their signatures and the cosine distance of
their decode-time expert-activation vectors p (:func:`decode_profiles`: per layer, the
share of the request's decode tokens that chose each expert, all layers concatenated).
:func:`select_layers` adds layers greedily, each time the one that raises ρ most, and
keeps the set at which ρ peaked.

Baselines for the same ρ: :func:`binary_signatures` (1 where e fired at l at all) and
softmax signatures (the router's softmax probabilities over every expert, summed over
the prompt tokens; :func:`router_probability_sums`), both over every layer, without IDF.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
from jaxtyping import Float, Integer

SIGNATURE_KINDS = ("count_idf", "softmax", "binary")


def idf_weights(counts: Integer[np.ndarray, "N L E"]) -> Float[np.ndarray, "L E"]:
    """w(l, e) = log((N + 1) / (df(l, e) + 1)) over the calibration counts [N, L, E]."""
    counts = np.asarray(counts)
    if counts.ndim != 3 or counts.shape[0] < 1:
        raise ValueError(f"calibration counts must be [N >= 1, L, E], got shape {counts.shape}")
    df = (counts > 0).sum(axis=0)
    return np.log((counts.shape[0] + 1.0) / (df + 1.0))


def normalize(x: Float[np.ndarray, "... D"]) -> Float[np.ndarray, "... D"]:
    """Rows scaled to unit L2 norm (all-zero rows stay zero)."""
    x = np.asarray(x, np.float64)
    norm = np.linalg.norm(x, axis=-1, keepdims=True)
    return np.divide(x, norm, out=np.zeros_like(x), where=norm > 0)


def check_layers(layers: Sequence[int], num_layers: int) -> tuple[int, ...]:
    """``layers`` as a sorted tuple of distinct layer indices in [0, num_layers)."""
    chosen = tuple(sorted({int(l) for l in layers}))
    if not chosen:
        raise ValueError("a signature needs at least one layer")
    if chosen[0] < 0 or chosen[-1] >= num_layers:
        raise ValueError(f"layers {list(chosen)} outside [0, {num_layers})")
    return chosen


def weighted_counts(counts: Integer[np.ndarray, "... L E"], idf: Float[np.ndarray, "L E"],
                    layers: Sequence[int]) -> Float[np.ndarray, "... D"]:
    """x = concat over ``layers`` of counts(l) · idf(l) (not normalized), D = |layers|·E."""
    counts = np.asarray(counts)
    layers = check_layers(layers, counts.shape[-2])
    if np.shape(idf) != counts.shape[-2:]:
        raise ValueError(f"idf has shape {np.shape(idf)}, the counts [..., L, E] "
                         f"{counts.shape[-2:]}")
    x = counts[..., layers, :] * np.asarray(idf)[layers, :]
    return x.reshape(*counts.shape[:-2], -1)


def signatures(counts: Integer[np.ndarray, "... L E"], idf: Float[np.ndarray, "L E"],
               layers: Sequence[int]) -> Float[np.ndarray, "... D"]:
    """The Count·IDF signatures s = x / ‖x‖₂ of one request [L, E] or many [N, L, E]."""
    return normalize(weighted_counts(counts, idf, layers))


def binary_signatures(counts: Integer[np.ndarray, "N L E"]) -> Float[np.ndarray, "N D"]:
    """Baseline: 1 where the expert fired at the layer at all, every layer, normalized."""
    counts = np.asarray(counts)
    return normalize((counts > 0).reshape(counts.shape[0], -1).astype(np.float64))


def softmax_signatures(prob_sums: Float[np.ndarray, "N L E"]) -> Float[np.ndarray, "N D"]:
    """Baseline: the router's probabilities summed over the prompt tokens, every layer,
    normalized."""
    prob_sums = np.asarray(prob_sums, np.float64)
    return normalize(prob_sums.reshape(prob_sums.shape[0], -1))


def router_probability_sums(router_inputs: Float[np.ndarray, "L n d"],
                            router: Float[np.ndarray, "L d E"]) -> Float[np.ndarray, "L E"]:
    """softmax(x · W_router) over every expert, summed over one request's n tokens, per
    layer (float64: the same router as ``moejax.moe.route``, before top-k)."""
    logits = np.einsum("lnd,lde->lne", np.asarray(router_inputs, np.float64),
                       np.asarray(router, np.float64))
    logits -= logits.max(axis=-1, keepdims=True)
    probs = np.exp(logits)
    probs /= probs.sum(axis=-1, keepdims=True)
    return probs.sum(axis=1)


def decode_profiles(decode_counts: Integer[np.ndarray, "N L E"],
                    decode_tokens: Integer[np.ndarray, "N"]) -> Float[np.ndarray, "N LE"]:
    """p_r: per layer, the share of request r's decode tokens that chose each expert,
    every layer concatenated (a request with no decode token gets zeros)."""
    counts = np.asarray(decode_counts, np.float64)
    tokens = np.asarray(decode_tokens, np.float64).reshape(-1, 1, 1)
    shares = np.divide(counts, tokens, out=np.zeros_like(counts), where=tokens > 0)
    return shares.reshape(counts.shape[0], -1)


def condensed_cosine_distances(x: Float[np.ndarray, "N D"]) -> Float[np.ndarray, "P"]:
    """1 - cos(x_i, x_j) for every pair i < j, in row-major order (P = N(N-1)/2). A zero
    vector is at distance 1 from everything."""
    unit = normalize(x)
    rows, cols = np.triu_indices(unit.shape[0], k=1)
    return 1.0 - (unit @ unit.T)[rows, cols]


def pair_rho(signature: Float[np.ndarray, "N D"], profile: Float[np.ndarray, "N P"]) -> float:
    """Spearman ρ between the pairwise cosine distances of ``signature`` and of
    ``profile`` over all pairs i < j (module docstring). NaN when either is constant."""
    if len(signature) != len(profile) or len(signature) < 3:
        raise ValueError(f"ρ needs the same N >= 3 requests on both sides, got "
                         f"{len(signature)} and {len(profile)}")
    return rho_against(signature, profile_ranks(profile))


def profile_ranks(profile: Float[np.ndarray, "N P"]) -> np.ndarray | None:
    """The ranks of the profiles' pairwise cosine distances (what every ρ against these
    profiles reuses), or None when they are all equal (ρ undefined)."""
    distances = condensed_cosine_distances(profile)
    import scipy.stats   # here, not at import: scipy.stats costs ~0.8 s of every start

    return None if np.ptp(distances) == 0 else scipy.stats.rankdata(distances)


def rho_against(signature: Float[np.ndarray, "N D"], ranks: np.ndarray | None) -> float:
    """Spearman ρ of the signatures' pairwise distances against precomputed profile
    ranks (:func:`profile_ranks`): the Pearson correlation of the two rankings."""
    distances = condensed_cosine_distances(signature)
    if ranks is None or np.ptp(distances) == 0:
        return float("nan")
    import scipy.stats

    return float(np.corrcoef(scipy.stats.rankdata(distances), ranks)[0, 1])


@dataclasses.dataclass(frozen=True)
class LayerSelection:
    """The greedy layer order, ρ after each addition, and the kept prefix (the peak)."""

    order: tuple[int, ...]
    rho_by_size: tuple[float, ...]
    layers: tuple[int, ...]
    rho: float


def select_layers(counts: Integer[np.ndarray, "N L E"], idf: Float[np.ndarray, "L E"],
                  profiles: Float[np.ndarray, "N P"]) -> LayerSelection:
    """Add layers one at a time, each the one whose addition gives the highest ρ
    (ties: the lower layer), until all are in; keep the set at which ρ peaked (ties: the
    smaller set)."""
    counts = np.asarray(counts)
    num_layers = counts.shape[1]
    if len(counts) != len(profiles) or len(counts) < 3:
        raise ValueError(f"layer selection needs the same N >= 3 requests in the counts and "
                         f"the profiles, got {len(counts)} and {len(profiles)}")
    ranks = profile_ranks(profiles)
    if ranks is None:
        raise ValueError("cannot select layers: ρ is undefined, the decode profiles of "
                         "the calibration requests are all equally far apart (e.g. all "
                         "alike); calibrate on requests whose decodes differ")
    order: list[int] = []
    rhos: list[float] = []
    for _ in range(num_layers):
        best_layer, best_rho = -1, -np.inf
        for layer in range(num_layers):
            if layer in order:
                continue
            rho = rho_against(signatures(counts, idf, order + [layer]), ranks)
            if not np.isnan(rho) and rho > best_rho:
                best_layer, best_rho = layer, rho
        if best_layer < 0:
            if not order:
                raise ValueError("cannot select layers: ρ is undefined at every layer, the "
                                 "signatures of the calibration requests are all equally "
                                 "far apart (e.g. every expert fires in every request, so "
                                 "every IDF weight is 0); give the layers explicitly or "
                                 "calibrate on varied requests")
            break       # the remaining layers add nothing measurable
        order.append(best_layer)
        rhos.append(float(best_rho))
    peak = int(np.argmax(rhos))
    return LayerSelection(order=tuple(order), rho_by_size=tuple(rhos),
                          layers=tuple(sorted(order[:peak + 1])), rho=rhos[peak])
