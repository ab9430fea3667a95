"""Expert-frequency priors of ELDR's clusters, for a decoder's expert-prefetch predictor
(issue 44: a signal across techniques).

ELDR sends a decoder the requests nearest its centroid (centroid d of a fit belongs to
decoder d, :class:`~moejax.eldr.policies.EldrPolicy`). The decoder's prefetch predictor
(``moejax.prefetch.predictors``) then sees mostly that cluster's requests, whose
decode-time expert use at each layer is known from calibration. The prior of decoder d:

1. each calibration request goes to its nearest centroid (the largest cosine similarity
   of its Count·IDF signature, :meth:`EldrFit.signature`; ties: the lower index), the
   cluster the fit assigns it to;
2. prior_d[l, e] = Σ over the requests of cluster d of their decode tokens that chose
   expert e at layer l, divided by the row's sum (each layer sums to 1: a frequency over
   experts). A layer where the cluster has no decode token gets the uniform row 1/E (no
   information: a uniform prior does not change a ranking).

A fit file holds the IDF weights, the selected layers and the centroids over those layers
only (``moejax.eldr.fitfile``): not per-layer frequencies. So the prior needs the
calibration counts, the traces the fit was made from (or other traces of the same
model): :func:`prior_from_files` (one decoder's) and :func:`cluster_priors_from_files`
(every decoder's) read both.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
from jaxtyping import Float, Integer

from moejax.config import ModelConfig
from moejax.eldr import fitfile, fitting
from moejax.eldr.fitfile import EldrFit, FitError


def check_counts_shape(fit: EldrFit, counts: np.ndarray, name: str) -> np.ndarray:
    """``counts`` as a non-negative integer [N, L, E] array of the fit's model shape, or a
    FitError (another model shape) / ValueError (not counts) naming ``name``."""
    array = np.asarray(counts)
    if array.ndim != 3 or array.dtype.kind not in "iu":
        raise ValueError(f"{name} must be an [N, L, E] integer array, got {array.dtype} of "
                         f"shape {array.shape}")
    if array.shape[1:] != (fit.num_layers, fit.num_experts):
        raise FitError(f"{name} are of a model with {array.shape[1]} layers and "
                       f"{array.shape[2]} experts, the fit's model has {fit.num_layers} "
                       f"layers and {fit.num_experts} experts")
    if (array < 0).any():
        raise ValueError(f"{name} hold a negative count {array.min()}")
    return array


def check_decoder(fit: EldrFit, decoder: object) -> int:
    """``decoder`` as an index in [0, K), or a ValueError naming it and K."""
    if isinstance(decoder, (bool, np.bool_)) or not isinstance(decoder, (int, np.integer)) \
            or not 0 <= decoder < fit.num_decoders:
        raise ValueError(f"decoder must be an index in [0, {fit.num_decoders}) (the fit has "
                         f"{fit.num_decoders} decoders), got {decoder!r}")
    return int(decoder)


def cluster_assignment(fit: EldrFit, prefill_counts: Integer[np.ndarray, "N L E"]
                       ) -> np.ndarray:
    """The cluster [N] each request's prompt counts belong to: its nearest centroid
    (largest cosine similarity; ties: the lower index)."""
    prefill = check_counts_shape(fit, prefill_counts, "prefill_counts")
    return np.argmax(fit.signature(prefill) @ fit.centroids.T, axis=1)


def cluster_priors(fit: EldrFit, prefill_counts: Integer[np.ndarray, "N L E"],
                   decode_counts: Integer[np.ndarray, "N L E"]) -> Float[np.ndarray, "K L E"]:
    """Every cluster's prior [K, L, E] (module docstring) from calibration requests'
    prompt counts (which cluster) and decode counts (what its decodes use)."""
    decode = check_counts_shape(fit, decode_counts, "decode_counts")
    if np.shape(prefill_counts) != decode.shape:
        raise ValueError(f"prefill_counts have shape {np.shape(prefill_counts)}, "
                         f"decode_counts {decode.shape}: one [L, E] of each per request")
    clusters = cluster_assignment(fit, prefill_counts)
    totals = np.zeros((fit.num_decoders, fit.num_layers, fit.num_experts))
    np.add.at(totals, clusters, decode.astype(np.float64))
    sums = totals.sum(axis=2, keepdims=True)
    uniform = np.full_like(totals, 1.0 / fit.num_experts)
    return np.divide(totals, sums, out=uniform, where=sums > 0)


def decoder_prior(fit: EldrFit, decoder: int, prefill_counts: Integer[np.ndarray, "N L E"],
                  decode_counts: Integer[np.ndarray, "N L E"]) -> Float[np.ndarray, "L E"]:
    """Decoder ``decoder``'s prior [L, E]: the prior of the cluster of its centroid."""
    decoder = check_decoder(fit, decoder)
    return cluster_priors(fit, prefill_counts, decode_counts)[decoder]


def cluster_priors_from_files(fit_path: str | os.PathLike,
                              trace_paths: str | os.PathLike | Sequence[str | os.PathLike],
                              cfg: ModelConfig | None = None) -> Float[np.ndarray, "K L E"]:
    """Every decoder's prior [K, L, E] (decoder d's is row d) from an ELDR fit file and
    calibration traces of its model (``moejax eldr-fit``'s inputs), read once for all K;
    with ``cfg``, the fit must be of its shape (layers, experts, top-k). Errors as
    :func:`prior_from_files`'s, but for the decoder."""
    fit = fitfile.load(fit_path)
    if cfg is not None:
        fit.check_shape(cfg, where=os.fspath(fit_path))
    return _priors_of_traces(fit, fit_path, trace_paths)


def prior_from_files(fit_path: str | os.PathLike,
                     trace_paths: str | os.PathLike | Sequence[str | os.PathLike],
                     decoder: int, cfg: ModelConfig | None = None) -> Float[np.ndarray, "L E"]:
    """Decoder ``decoder``'s prior from an ELDR fit file and calibration traces of its
    model (``moejax eldr-fit``'s inputs); with ``cfg``, the fit must be of its shape
    (layers, experts, top-k). Errors: a missing file (FileNotFoundError), a malformed fit
    or one of another model shape than the traces or ``cfg`` (FitError), a decoder out of
    range (ValueError). (For every decoder's, :func:`cluster_priors_from_files` reads the
    files once.)"""
    fit = fitfile.load(fit_path)
    if cfg is not None:
        fit.check_shape(cfg, where=os.fspath(fit_path))
    decoder = check_decoder(fit, decoder)
    return _priors_of_traces(fit, fit_path, trace_paths)[decoder]


def _priors_of_traces(fit: EldrFit, fit_path: str | os.PathLike,
                      trace_paths: str | os.PathLike | Sequence[str | os.PathLike]
                      ) -> Float[np.ndarray, "K L E"]:
    """Every cluster's prior of ``fit`` (read from ``fit_path``, named in errors) from the
    calibration traces at ``trace_paths``."""
    counts = fitting.trace_counts(fitting.load_traces(trace_paths))
    if counts.top_k != fit.top_k:
        raise FitError(f"{os.fspath(fit_path)} was fitted for top-{fit.top_k} routing, the "
                       f"traces route top-{counts.top_k}")
    try:
        return cluster_priors(fit, counts.prefill, counts.decode)
    except FitError as exc:
        raise FitError(f"{os.fspath(fit_path)}: the traces' counts do not fit: {exc}") from None
