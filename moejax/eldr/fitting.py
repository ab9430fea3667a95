"""The offline ELDR fit (``moejax eldr-fit``): expert traces of calibration requests →
an :class:`~moejax.eldr.fitfile.EldrFit` (IDF, layers, one centroid per decoder).

From the requests that ran (``errors == ""``) of one or more traces of the same model:

1. raw counts: each request's prompt tokens' top-k counts c_r [L, E] (the signature's
   input) and its decode tokens' counts with its number of decode tokens (the decode
   profile p_r, :func:`~moejax.eldr.signature.decode_profiles`);
2. IDF over all N requests (:func:`~moejax.eldr.signature.idf_weights`);
3. the layers: the greedy selection at which ρ peaks
   (:func:`~moejax.eldr.signature.select_layers`), unless given. ρ is evaluated over
   the requests with at least one decode token (a request that generated a single token
   has no decode-time usage to predict); it needs three of them;
4. the Count·IDF signatures of all N requests over those layers, clustered with
   Hungarian-balanced (or plain) spherical K-means, K = the number of decoders
   (:mod:`~moejax.eldr.kmeans`: k-means++ seeding from ``seed``, at most
   ``max_iterations`` = 50 assignment steps by default).

Several trace files are read with :func:`load_traces` (they must agree on model, layers,
experts and top-k) and pooled as counts (:func:`trace_counts`), never re-concatenated.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Sequence

import numpy as np
from jaxtyping import Integer

from moejax import traces as trace_format
from moejax.eldr import kmeans as km
from moejax.eldr import signature as sig
from moejax.eldr.fitfile import CLUSTERINGS, EldrFit

MIN_RHO_REQUESTS = 3
"""Requests with decode tokens that ρ (and so the layer selection) needs."""


@dataclasses.dataclass(frozen=True, eq=False)
class CalibrationCounts:
    """What the fit reads of the traces: per request that ran, its prompt counts
    ``prefill`` [N, L, E], decode counts ``decode`` [N, L, E] and ``decode_tokens`` [N],
    its ``domains`` label ("" when none), and the traces' model name and shape."""

    prefill: np.ndarray
    decode: np.ndarray
    decode_tokens: np.ndarray
    domains: tuple[str, ...]
    model: str
    num_layers: int
    num_experts: int
    top_k: int

    @property
    def num_requests(self) -> int:
        return len(self.decode_tokens)


@dataclasses.dataclass(frozen=True, eq=False)
class FitDetails:
    """A fit with how it came about: the K-means run (its calibration ``assignment`` and
    cluster sizes), the greedy layer selection (None when the layers were given), and
    the wall-clock seconds of the fit."""

    fit: EldrFit
    clusters: km.KMeansResult
    selection: sig.LayerSelection | None
    seconds: float


# ----------------------------------------------------------------------------- traces
def load_traces(paths: str | os.PathLike | Sequence[str | os.PathLike]
                ) -> list[trace_format.Trace]:
    """Read one or more trace files (``moejax.traces.load``: a malformed file raises
    TraceFormatError naming it, a missing one FileNotFoundError); they must agree on
    model, layers, experts and top-k (:func:`check_compatible`)."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    if not paths:
        raise ValueError("paths: no trace file given")
    for path in paths:
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no trace file at {os.fspath(path)} (make one with "
                                    f"`moejax trace REQUESTS.jsonl -o TRACE.npz`)")
    loaded = [trace_format.load(path) for path in paths]
    check_compatible(loaded, [os.fspath(path) for path in paths])
    return loaded


def check_compatible(traces: Sequence[trace_format.Trace],
                     names: Sequence[str] | None = None) -> None:
    """A ValueError naming the first trace whose model name, layers, experts or top-k
    differ from the first trace's."""
    names = list(names) if names is not None else [f"trace {i}" for i in range(len(traces))]
    first = traces[0]
    for name, trace in zip(names[1:], traces[1:]):
        for what in ("model", "num_layers", "num_experts", "top_k"):
            if getattr(trace, what) != getattr(first, what):
                raise ValueError(f"{name}: {what} is {getattr(trace, what)!r}, but {names[0]} "
                                 f"has {getattr(first, what)!r}; a fit pools traces of one "
                                 f"model only")


def trace_counts(traces: trace_format.Trace | Sequence[trace_format.Trace]
                 ) -> CalibrationCounts:
    """The requests that ran of ``traces`` (in order) as counts (:class:`CalibrationCounts`)."""
    if isinstance(traces, trace_format.Trace):
        traces = [traces]
    if not traces:
        raise ValueError("traces: no trace given")
    check_compatible(traces)
    prefill, decode, tokens, domains = [], [], [], []
    for trace in traces:
        ran = trace.arrays["errors"] == ""
        prefill.append(trace_format.activation_counts(trace, "prefill")[ran])
        decode.append(trace_format.activation_counts(trace, "decode")[ran])
        tokens.append(np.diff(trace.arrays["decode_offsets"])[ran])
        domains.extend(trace.arrays["domains"][ran].tolist())
    first = traces[0]
    return CalibrationCounts(prefill=np.concatenate(prefill), decode=np.concatenate(decode),
                             decode_tokens=np.concatenate(tokens), domains=tuple(domains),
                             model=first.model, num_layers=first.num_layers,
                             num_experts=first.num_experts, top_k=first.top_k)


# ----------------------------------------------------------------------------- the fit
def fit(traces: trace_format.Trace | Sequence[trace_format.Trace], num_decoders: int, *,
        fingerprint: str, clustering: str = "balanced", seed: int = 0,
        layers: Sequence[int] | None = None,
        max_iterations: int = km.DEFAULT_MAX_ITERATIONS) -> EldrFit:
    """The ELDR fit of a trace (or of several of one model) for ``num_decoders``
    decoders: the requests that ran, the trace's model name and top-k, and the router
    ``fingerprint`` of the model (``fitfile.model_fingerprint``)."""
    return fit_trace_detailed(traces, num_decoders, fingerprint=fingerprint,
                              clustering=clustering, seed=seed, layers=layers,
                              max_iterations=max_iterations).fit


def fit_trace_detailed(traces: trace_format.Trace | Sequence[trace_format.Trace],
                       num_decoders: int, *, fingerprint: str, clustering: str = "balanced",
                       seed: int = 0, layers: Sequence[int] | None = None,
                       max_iterations: int = km.DEFAULT_MAX_ITERATIONS,
                       model: str | None = None) -> FitDetails:
    """:func:`fit` with its :class:`FitDetails`; ``model`` overrides the name recorded
    (default: the traces')."""
    counts = trace_counts(traces)
    return fit_counts_detailed(counts.prefill, counts.decode, counts.decode_tokens,
                               num_decoders, fingerprint=fingerprint,
                               model=counts.model if model is None else model,
                               top_k=counts.top_k, clustering=clustering, seed=seed,
                               layers=layers, max_iterations=max_iterations)


def fit_counts(prefill_counts: Integer[np.ndarray, "N L E"],
               decode_counts: Integer[np.ndarray, "N L E"],
               decode_tokens: Integer[np.ndarray, "N"], num_decoders: int, *,
               fingerprint: str, model: str, top_k: int, clustering: str = "balanced",
               seed: int = 0, layers: Sequence[int] | None = None,
               max_iterations: int = km.DEFAULT_MAX_ITERATIONS) -> EldrFit:
    """The ELDR fit of N calibration requests' raw counts (module docstring, steps 2–4)."""
    return fit_counts_detailed(prefill_counts, decode_counts, decode_tokens, num_decoders,
                               fingerprint=fingerprint, model=model, top_k=top_k,
                               clustering=clustering, seed=seed, layers=layers,
                               max_iterations=max_iterations).fit


def fit_counts_detailed(prefill_counts: Integer[np.ndarray, "N L E"],
                        decode_counts: Integer[np.ndarray, "N L E"],
                        decode_tokens: Integer[np.ndarray, "N"], num_decoders: int, *,
                        fingerprint: str, model: str, top_k: int,
                        clustering: str = "balanced", seed: int = 0,
                        layers: Sequence[int] | None = None,
                        max_iterations: int = km.DEFAULT_MAX_ITERATIONS) -> FitDetails:
    """:func:`fit_counts` with its :class:`FitDetails`."""
    start = time.perf_counter()
    prefill, decode, tokens = _check_counts(prefill_counts, decode_counts, decode_tokens)
    num_requests, num_layers, num_experts = prefill.shape
    _check_options(num_decoders, num_requests, top_k, num_experts, clustering, fingerprint)
    idf = sig.idf_weights(prefill)
    profiles = sig.decode_profiles(decode, tokens)
    evaluated = tokens > 0
    if evaluated.sum() < MIN_RHO_REQUESTS:
        raise ValueError(f"decode_tokens: {int(evaluated.sum())} of the {num_requests} "
                         f"requests have decode tokens; ρ needs at least {MIN_RHO_REQUESTS} "
                         f"(trace requests that generate two or more tokens)")
    selection = None
    if layers is None:
        # select_layers refuses calibration sets on which ρ is undefined.
        selection = sig.select_layers(prefill[evaluated], idf, profiles[evaluated])
        chosen, rho = selection.layers, selection.rho
    else:
        chosen = sig.check_layers(layers, num_layers)
        rho = sig.pair_rho(sig.signatures(prefill[evaluated], idf, chosen),
                           profiles[evaluated])
    signatures = sig.signatures(prefill, idf, chosen)
    if not signatures.any():
        raise ValueError(f"every calibration signature is zero over layers {list(chosen)} "
                         f"(every expert that fires there fires in every request, so its "
                         f"IDF weight is 0): nothing to cluster")
    clusters = km.KMEANS[clustering](signatures, num_decoders, seed=seed,
                                     max_iterations=max_iterations)
    result = EldrFit(model=model, fingerprint=fingerprint, num_layers=num_layers,
                     num_experts=num_experts, top_k=int(top_k), idf=idf, layers=chosen,
                     centroids=clusters.centroids, calibration_requests=num_requests,
                     rho=float(rho), clustering=clustering, seed=int(seed),
                     iterations=clusters.iterations)
    return FitDetails(fit=result, clusters=clusters, selection=selection,
                      seconds=time.perf_counter() - start)


# ----------------------------------------------------------------------------- checks
def _check_counts(prefill: object, decode: object, tokens: object
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    arrays = {}
    for name, value, ndim in (("prefill_counts", prefill, 3), ("decode_counts", decode, 3),
                              ("decode_tokens", tokens, 1)):
        array = np.asarray(value)
        if array.ndim != ndim or array.dtype.kind not in "iu":
            raise ValueError(f"{name} must be a {ndim}-d integer array, got {array.dtype} "
                             f"of shape {array.shape}")
        if (array < 0).any():
            raise ValueError(f"{name} holds a negative count {array.min()}")
        arrays[name] = array
    prefill, decode, tokens = arrays.values()
    if prefill.shape[0] < 1 or min(prefill.shape[1:]) < 1:
        raise ValueError(f"prefill_counts must be [N >= 1, L >= 1, E >= 1], got shape "
                         f"{prefill.shape}")
    if decode.shape != prefill.shape:
        raise ValueError(f"decode_counts has shape {decode.shape}, prefill_counts "
                         f"{prefill.shape}: both are [N, L, E]")
    if tokens.shape != (prefill.shape[0],):
        raise ValueError(f"decode_tokens has shape {tokens.shape}, expected "
                         f"({prefill.shape[0]},): one count per request")
    return prefill, decode, tokens


def _check_options(num_decoders: object, num_requests: int, top_k: object, num_experts: int,
                   clustering: object, fingerprint: object) -> None:
    if isinstance(num_decoders, bool) or not isinstance(num_decoders, (int, np.integer)) \
            or num_decoders < 1:
        raise ValueError(f"num_decoders must be a positive integer, got {num_decoders!r}")
    if num_decoders > num_requests:
        raise ValueError(f"num_decoders = {num_decoders} centroids from {num_requests} "
                         f"calibration requests: a fit needs at least one request per "
                         f"decoder")
    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) \
            or not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be an integer in [1, {num_experts}], got {top_k!r}")
    if clustering not in CLUSTERINGS:
        raise ValueError(f"clustering must be one of {CLUSTERINGS}, got {clustering!r}")
    if not isinstance(fingerprint, str) or not fingerprint:
        raise ValueError(f"fingerprint must be the model's router fingerprint "
                         f"(fitfile.model_fingerprint), got {fingerprint!r}")
