"""The prefetch files a predictor needs, read and checked against the model.

``prefetch_files`` (Generator option, CLI ``--prefetch-file``, repeatable) lists
``.npz`` files; each says what it is in its ``format`` key:

* default vectors (``moejax prefetch-calibrate``, ``moejax.prefetch.defaults``):
  needed by ``quasi``, ``estimator`` and ``hybrid``;
* an estimator (``python -m moejax.prefetch.train``, ``moejax.prefetch.estimator``):
  needed by ``estimator`` and ``hybrid``; its meta names the model fingerprint and the
  layers the hybrid hands to it.

Both are refused when made for another model (the router-weight fingerprint of
``moejax.eldr.fitfile.model_fingerprint``).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from moejax.config import ModelConfig
from moejax.eldr.fitfile import model_fingerprint
from moejax.param_layout import Params
from moejax.prefetch import defaults as defaults_lib
from moejax.prefetch import estimator as estimator_lib
from moejax.prefetch.defaults import PrefetchFileError


@dataclasses.dataclass(frozen=True)
class LoadedEstimator:
    config: estimator_lib.EstimatorConfig
    params: dict[str, Any]
    meta: Mapping[str, Any]
    hybrid_layers: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class PrefetchFiles:
    defaults: defaults_lib.DefaultVectors | None = None
    estimator: LoadedEstimator | None = None


def parse_layers(text: str, path: str) -> tuple[int, ...]:
    """A comma-separated layer list from an estimator's meta ("" is none)."""
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise PrefetchFileError(f"{path}: 'meta/hybrid_layers' must be comma-separated "
                                f"layer indices, got {text!r}") from None


def _file_format(path: str) -> str:
    """The file's ``format`` key ("" without one); a missing, non-regular, truncated or
    otherwise unreadable file raises PrefetchFileError naming it."""
    defaults_lib.check_npz_path(path)
    try:    # only the small 'format' member is read here (npz members load lazily)
        with np.load(path, allow_pickle=False) as npz:
            return str(npz["format"]) if "format" in npz.files else ""
    except defaults_lib.NPZ_READ_ERRORS as exc:
        raise defaults_lib.npz_error(path, exc) from None


def load_estimator(path: str, cfg: ModelConfig, params: Params) -> LoadedEstimator:
    """An estimator file, checked against the model's shape and router weights."""
    est_cfg, est_params, meta = estimator_lib.load(path)
    shape = (cfg.hidden_size, cfg.num_experts, cfg.num_layers)
    if (est_cfg.hidden_size, est_cfg.num_experts, est_cfg.num_layers) != shape:
        raise PrefetchFileError(f"{path}: an estimator for (d, E, L) = "
                                f"{(est_cfg.hidden_size, est_cfg.num_experts, est_cfg.num_layers)}"
                                f", the model has {shape}")
    if meta.get("fingerprint") != model_fingerprint(cfg, params["layers"]["router"]):
        raise PrefetchFileError(f"{path}: trained for other weights (model "
                                f"{meta.get('model', '')!r}); retrain it with `python -m "
                                f"moejax.prefetch.train --model MODEL --traces T -o {path}`")
    layers = parse_layers(str(meta.get("hybrid_layers", "")), path)
    if any(not 1 <= j < cfg.num_layers for j in layers):
        raise PrefetchFileError(f"{path}: 'meta/hybrid_layers' {layers} must lie in "
                                f"[1, {cfg.num_layers})")
    return LoadedEstimator(est_cfg, est_params, meta, layers)


def load_files(paths: str | os.PathLike | Sequence[str | os.PathLike] | None,
               cfg: ModelConfig, params: Params) -> PrefetchFiles:
    """Read every file of ``paths`` (one path or several), at most one of each kind."""
    if paths is None:
        paths = ()
    if isinstance(paths, (str, os.PathLike)):
        paths = (paths,)
    found: dict[str, Any] = {}
    for raw in paths:
        path = os.fspath(raw)
        kind = _file_format(path)
        if kind == defaults_lib.FORMAT:
            value: Any = defaults_lib.load(path)
            value.check_model(cfg, params, path)
        elif kind == estimator_lib.FORMAT:
            value = load_estimator(path, cfg, params)
        else:
            raise PrefetchFileError(f"{path}: not a prefetch file ('format' is {kind!r}; "
                                    f"expected {defaults_lib.FORMAT!r} or "
                                    f"{estimator_lib.FORMAT!r})")
        if kind in found:
            raise PrefetchFileError(f"{path}: a second {kind!r} file (give one of each)")
        found[kind] = value
    return PrefetchFiles(defaults=found.get(defaults_lib.FORMAT),
                         estimator=found.get(estimator_lib.FORMAT))


def check_needs(prefetch: str, files: PrefetchFiles) -> None:
    """Refuse a predictor whose files are missing."""
    from moejax.prefetch.predictors import NEEDS_DEFAULTS, NEEDS_ESTIMATOR

    if prefetch in NEEDS_DEFAULTS and files.defaults is None:
        raise PrefetchFileError(f"prefetch={prefetch!r} needs default vectors: make them with "
                                f"`moejax prefetch-calibrate TRACES -o DEFAULTS.npz --model M` "
                                f"and pass prefetch_files=[DEFAULTS.npz, ...]")
    if prefetch in NEEDS_ESTIMATOR and files.estimator is None:
        raise PrefetchFileError(f"prefetch={prefetch!r} needs an estimator: train one with "
                                f"`python -m moejax.prefetch.train --model M --traces T -o "
                                f"EST.npz` and pass prefetch_files=[DEFAULTS.npz, EST.npz]")
