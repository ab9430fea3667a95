"""A fitted ELDR router on disk, versioned against the model it was fitted for.

:class:`EldrFit` holds what online routing needs — the IDF weights [L, E], the selected
layers, one unit centroid per decoder [K, |layers|·E] — and what makes it checkable: the
model's fingerprint (:func:`model_fingerprint`: a digest of its routing shape and router
weights), the model's name, and how it was fitted (calibration size, ρ, clustering,
seed, iterations).

File: one ``.npz`` (``numpy.savez``, no pickles), format ``"moejax-eldr-fit"``, version
:data:`VERSION`. :func:`load` checks the format, version, dtypes and shapes;
:meth:`EldrFit.check_model` refuses a fit made for another model (a different
fingerprint: retrained weights, another checkpoint) or for another number of
decoders, naming both sides and how to refit.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import zipfile
from typing import Any

import ml_dtypes
import numpy as np

from moejax.config import ModelConfig
from moejax.eldr import signature as sig

FORMAT = "moejax-eldr-fit"
VERSION = 1
CLUSTERINGS = ("balanced", "plain")


class FitError(ValueError):
    """A fit file that is malformed, or that does not belong to the model or decoders."""


def model_fingerprint(cfg: ModelConfig, router: Any) -> str:
    """sha256 of the model's routing shape (layers, experts, k, hidden size) and its
    router weights [L, d, E] rounded to bfloat16 (so the same checkpoint loaded in
    float32 or bfloat16 has one fingerprint)."""
    router = np.asarray(router)
    shape = (cfg.num_layers, cfg.hidden_size, cfg.num_experts)
    if router.shape != shape:
        raise ValueError(f"router weights have shape {router.shape}, the config says {shape}")
    digest = hashlib.sha256()
    digest.update(f"L={cfg.num_layers};E={cfg.num_experts};k={cfg.num_experts_per_tok};"
                  f"d={cfg.hidden_size};".encode())
    digest.update(np.ascontiguousarray(router.astype(np.float32).astype(ml_dtypes.bfloat16))
                  .tobytes())
    return digest.hexdigest()


@dataclasses.dataclass(frozen=True, eq=False)
class EldrFit:
    """A fitted ELDR router (module docstring). ``centroids`` [K, |layers|·E] are unit
    vectors; ``idf`` [L, E] float64."""

    model: str
    fingerprint: str
    num_layers: int
    num_experts: int
    top_k: int
    idf: np.ndarray
    layers: tuple[int, ...]
    centroids: np.ndarray
    calibration_requests: int
    rho: float
    clustering: str = "balanced"
    seed: int = 0
    iterations: int = 0

    def __post_init__(self) -> None:
        idf = np.asarray(self.idf, np.float64)
        if idf.shape != (self.num_layers, self.num_experts):
            raise FitError(f"idf: shape {idf.shape}, expected "
                           f"({self.num_layers}, {self.num_experts})")
        try:
            layers = sig.check_layers(self.layers, self.num_layers)
        except ValueError as exc:
            raise FitError(f"layers: {exc}") from None
        centroids = np.asarray(self.centroids, np.float64)
        width = len(layers) * self.num_experts
        if centroids.ndim != 2 or centroids.shape[0] < 1 or centroids.shape[1] != width:
            raise FitError(f"centroids: shape {centroids.shape}, expected (K >= 1, {width}) "
                           f"({len(layers)} layers x {self.num_experts} experts)")
        if not (np.isfinite(idf).all() and np.isfinite(centroids).all()):
            raise FitError("idf or centroids hold a NaN or an infinity")
        if self.clustering not in CLUSTERINGS:
            raise FitError(f"clustering must be one of {CLUSTERINGS}, got {self.clustering!r}")
        object.__setattr__(self, "idf", idf)
        object.__setattr__(self, "layers", layers)
        object.__setattr__(self, "centroids", sig.normalize(centroids))

    @property
    def num_decoders(self) -> int:
        return int(self.centroids.shape[0])

    def signature(self, counts: np.ndarray) -> np.ndarray:
        """The signature s [D] (or [N, D]) of raw prompt counts [L, E] (or [N, L, E])."""
        return sig.signatures(counts, self.idf, self.layers)

    def check_shape(self, cfg: ModelConfig, where: str = "the fit") -> None:
        """Refuse a fit made for a model of other layers, experts or top-k than ``cfg``."""
        shape = (cfg.num_layers, cfg.num_experts, cfg.num_experts_per_tok)
        if shape != (self.num_layers, self.num_experts, self.top_k):
            raise FitError(f"{where} was fitted for a model with {self.num_layers} layers, "
                           f"{self.num_experts} experts, top-{self.top_k}; this model has "
                           f"{shape[0]} layers, {shape[1]} experts, top-{shape[2]}")

    def check_model(self, cfg: ModelConfig, fingerprint: str, decoders: int,
                    where: str = "the fit") -> None:
        """Refuse a fit made for another model or another number of decoders."""
        self.check_shape(cfg, where)
        if fingerprint != self.fingerprint:
            raise FitError(f"{where} is stale: it was fitted for model {self.model!r} with "
                           f"router fingerprint {self.fingerprint[:12]}, this model's is "
                           f"{fingerprint[:12]} (other weights); refit it with "
                           f"`moejax eldr-fit TRACES -o FIT --decoders {decoders}` on a trace "
                           f"of this model")
        if decoders != self.num_decoders:
            raise FitError(f"{where} has {self.num_decoders} centroids (fitted for "
                           f"{self.num_decoders} decoders), but {decoders} decoders were "
                           f"asked for; refit with --decoders {decoders}")


# ----------------------------------------------------------------------------- files
def save(path: str | os.PathLike, fit: EldrFit) -> None:
    """Write ``fit`` to ``path`` (exactly that name) as an uncompressed ``.npz``."""
    arrays = {"format": np.array(FORMAT), "version": np.array(VERSION, np.int64),
              "model": np.array(fit.model), "fingerprint": np.array(fit.fingerprint),
              "clustering": np.array(fit.clustering),
              "num_layers": np.array(fit.num_layers, np.int64),
              "num_experts": np.array(fit.num_experts, np.int64),
              "top_k": np.array(fit.top_k, np.int64),
              "calibration_requests": np.array(fit.calibration_requests, np.int64),
              "seed": np.array(fit.seed, np.int64),
              "iterations": np.array(fit.iterations, np.int64),
              "rho": np.array(fit.rho, np.float64), "idf": fit.idf,
              "layers": np.asarray(fit.layers, np.int64), "centroids": fit.centroids}
    with open(path, "wb") as fh:
        np.savez(fh, **arrays)


_STRINGS = ("format", "model", "fingerprint", "clustering")
_INTS = ("version", "num_layers", "num_experts", "top_k", "calibration_requests", "seed",
         "iterations")


def load(path: str | os.PathLike) -> EldrFit:
    """Read a fit written by :func:`save`; a malformed file raises :class:`FitError`
    naming the file and the key (a missing file: FileNotFoundError)."""
    name = os.fspath(path)
    if not os.path.isfile(name):
        raise FileNotFoundError(f"no ELDR fit file at {name} (make one with `moejax "
                                f"eldr-fit TRACES -o {name} --decoders K`)")
    try:
        with np.load(name, allow_pickle=False) as archive:
            arrays = {key: archive[key] for key in archive.files}
    except (ValueError, EOFError, OSError, zipfile.BadZipFile, AttributeError) as exc:
        raise FitError(f"{name}: not an ELDR fit file ({exc})") from None
    try:
        return _from_arrays(arrays)
    except FitError as exc:
        raise FitError(f"{name}: {exc}") from None


def _from_arrays(arrays: dict[str, np.ndarray]) -> EldrFit:
    needed = _STRINGS + _INTS + ("rho", "idf", "layers", "centroids")
    missing = [key for key in needed if key not in arrays]
    if "format" in missing or (arrays.get("format") is not None
                               and str(arrays["format"]) != FORMAT):
        raise FitError(f"key 'format': not a {FORMAT!r} file")
    if "version" not in missing and int(arrays["version"]) != VERSION:
        raise FitError(f"key 'version': the file is version {int(arrays['version'])}; this "
                       f"reader reads version {VERSION} (refit with `moejax eldr-fit`)")
    if missing:
        raise FitError(f"key {missing[0]!r}: missing")
    for key in _STRINGS:
        if arrays[key].dtype.kind != "U" or arrays[key].shape != ():
            raise FitError(f"key {key!r}: expected a string")
    for key in _INTS:
        if arrays[key].dtype != np.int64 or arrays[key].shape != ():
            raise FitError(f"key {key!r}: expected an int64 scalar")
    for key, ndim in (("idf", 2), ("layers", 1), ("centroids", 2)):
        if arrays[key].ndim != ndim or arrays[key].dtype.kind not in "fi":
            raise FitError(f"key {key!r}: expected a {ndim}-d numeric array, got "
                           f"{arrays[key].dtype} of shape {arrays[key].shape}")
    try:
        return EldrFit(model=str(arrays["model"]), fingerprint=str(arrays["fingerprint"]),
                       num_layers=int(arrays["num_layers"]),
                       num_experts=int(arrays["num_experts"]), top_k=int(arrays["top_k"]),
                       idf=arrays["idf"], layers=tuple(int(l) for l in arrays["layers"]),
                       centroids=arrays["centroids"],
                       calibration_requests=int(arrays["calibration_requests"]),
                       rho=float(arrays["rho"]), clustering=str(arrays["clustering"]),
                       seed=int(arrays["seed"]), iterations=int(arrays["iterations"]))
    except TypeError as exc:
        raise FitError(str(exc)) from None
