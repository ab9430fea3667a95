"""Scorer options: defaults from ``serving/configs/scoring.yaml``, validated into a dataclass.

The defaults and the deployment files (``serving/configs/deployments/*.yaml``) are package
data (pyproject's ``[tool.setuptools.package-data]``), read through
:mod:`importlib.resources`, so an installed wheel has them as the checkout does.
"""

from __future__ import annotations

import dataclasses
import os
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any, Mapping

import jax
import jax.numpy as jnp

from moejax.checkpoint import WEIGHTS_DTYPES
from moejax.moe import EXPERT_IMPLS, FP8_IMPLS

CONFIGS_DIR: Traversable = resources.files("serving") / "configs"
DEFAULTS_PATH: Traversable = CONFIGS_DIR / "scoring.yaml"
# The shipped deployments, one per backend: ``deployment="offload"`` names
# ``serving/configs/deployments/offload.yaml`` (a path to a file of one's own works too).
DEPLOYMENTS_DIR: Traversable = CONFIGS_DIR / "deployments"
DTYPES = ("float32", "bfloat16")
AUTO_BATCH_TOKENS = {"cpu": 4096, "gpu": 16384}
ROUTINGS = ("prefix", "round_robin", "least_tokens", "random", "prefill_only")


@dataclasses.dataclass(frozen=True)
class ScorerOptions:
    dtype: str = "auto"
    max_batch_tokens: int | str = "auto"
    min_block: int = 32
    expert_impl: str = "auto"
    tile_rows: int | None = None
    progress_min_requests: int = 64
    # None: leave JAX's process-wide compilation cache alone (the moejax commands pass
    # "auto"); "auto", a directory or "off": see serving/compilation_cache.py.
    compilation_cache: str | bool | None = None
    backend: str = "resident"
    devices: int = 1
    backend_options: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    calibrate: bool = True
    calibration_eps: float = 0.1
    theta: float | None = None
    prefix_cache_blocks: int | str = 0
    prefix_cache_mib: int = 256
    kv_cache_free: bool = False
    share_prompts: bool | str = "auto"
    max_text_bytes: int | str = "auto"
    max_token_ids: int | str = "auto"
    max_candidates: int = 4096
    engines: int = 1
    routing: str = "prefix"
    routing_seed: int = 0
    max_num_seqs: int | None = None
    # The server's "choice"/"multi" prompt templates (serving.requests.NormalizeOptions
    # fields); a request's own ``templates`` override them.
    templates: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    # "auto": an FP8 checkpoint is dequantized on load into ``dtype``; "fp8": its routed
    # experts stay in FP8 with their block scales on the device (issue 41; resident only).
    weights_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES + ("auto",):
            raise ValueError(f"dtype must be one of {DTYPES + ('auto',)}, got {self.dtype!r}")
        if self.expert_impl not in EXPERT_IMPLS:
            raise ValueError(f"expert_impl must be one of {EXPERT_IMPLS}, got {self.expert_impl!r}")
        if self.max_batch_tokens != "auto" and (not isinstance(self.max_batch_tokens, int)
                                                or self.max_batch_tokens <= 0):
            raise ValueError(f"max_batch_tokens must be a positive integer or 'auto', "
                             f"got {self.max_batch_tokens!r}")
        if self.tile_rows is not None and (not isinstance(self.tile_rows, int) or self.tile_rows <= 0):
            raise ValueError(f"tile_rows must be a positive integer or None, got {self.tile_rows!r}")
        from moejax.backends import BACKENDS

        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {sorted(BACKENDS)}, got {self.backend!r}")
        check_weights_dtype(self.weights_dtype, self.backend, self.expert_impl)
        if not isinstance(self.devices, int) or isinstance(self.devices, bool) or self.devices < 1:
            raise ValueError(f"devices must be a positive integer, got {self.devices!r}")
        if not isinstance(self.backend_options, Mapping):
            raise ValueError(f"backend_options must be a mapping of keyword arguments, got "
                             f"{self.backend_options!r}")
        if not isinstance(self.calibrate, bool):
            raise ValueError(f"calibrate must be true or false, got {self.calibrate!r}")
        if not isinstance(self.calibration_eps, (int, float)) or self.calibration_eps < 0:
            raise ValueError(f"calibration_eps must be >= 0, got {self.calibration_eps!r}")
        if self.theta is not None and (not isinstance(self.theta, (int, float)) or self.theta < 0):
            raise ValueError(f"theta must be None or >= 0 FLOPs, got {self.theta!r}")
        blocks = self.prefix_cache_blocks
        if blocks != "auto" and (not isinstance(blocks, int) or isinstance(blocks, bool)
                                 or blocks < 0):
            raise ValueError(f"prefix_cache_blocks must be 0 (off), a positive number of "
                             f"blocks or 'auto', got {blocks!r}")
        if not isinstance(self.prefix_cache_mib, int) or self.prefix_cache_mib <= 0:
            raise ValueError(f"prefix_cache_mib must be a positive integer, got "
                             f"{self.prefix_cache_mib!r}")
        if not isinstance(self.engines, int) or isinstance(self.engines, bool) or self.engines < 1:
            raise ValueError(f"engines must be a positive integer, got {self.engines!r}")
        if self.routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {ROUTINGS}, got {self.routing!r}")
        if self.max_num_seqs is not None and (not isinstance(self.max_num_seqs, int)
                                              or isinstance(self.max_num_seqs, bool)
                                              or self.max_num_seqs < 1):
            raise ValueError(f"max_num_seqs must be null (every op of a call in one packed "
                             f"run) or a positive integer, got {self.max_num_seqs!r}")
        from serving.requests import NormalizeOptions

        NormalizeOptions.from_mapping(self.templates)     # raises naming templates.KEY
        if self.engines > 1 and self.backend == "resident" and self.devices != 1:
            raise ValueError(f"engines={self.engines} with backend 'resident' runs one engine "
                             f"per device; got devices={self.devices} (devices is per "
                             f"engine: each engine's backend runs on that many)")
        if not (self.compilation_cache is None or self.compilation_cache is False
                or isinstance(self.compilation_cache, str)):
            raise ValueError(f"compilation_cache must be a directory, 'auto', 'off' or None, "
                             f"got {self.compilation_cache!r}")
        if not isinstance(self.kv_cache_free, bool):
            raise ValueError(f"kv_cache_free must be true or false, got {self.kv_cache_free!r}")
        if self.share_prompts not in (True, False, "auto"):
            raise ValueError(f"share_prompts must be true, false or 'auto', got "
                             f"{self.share_prompts!r}")
        for name in ("max_text_bytes", "max_token_ids", "max_candidates"):
            value = getattr(self, name)
            auto_ok = name != "max_candidates"
            if not (auto_ok and value == "auto") and (
                    not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                also = " or 'auto'" if auto_ok else ""
                raise ValueError(f"{name} must be a positive integer{also}, got {value!r}")

    @property
    def platform(self) -> str:
        return "gpu" if jax.default_backend() in ("gpu", "cuda", "rocm") else "cpu"

    def resolved_dtype(self) -> jnp.dtype:
        name = self.dtype
        if name == "auto":
            name = "bfloat16" if self.platform == "gpu" else "float32"
        return jnp.dtype(name)

    def resolved_compilation_cache(self) -> str | None:
        """Directory of JAX's persistent compilation cache to turn on, or None (leave it)."""
        from serving.compilation_cache import resolve_compilation_cache

        return resolve_compilation_cache(self.compilation_cache)

    def resolved_batch_tokens(self) -> int:
        if self.max_batch_tokens == "auto":
            return AUTO_BATCH_TOKENS[self.platform]
        return int(self.max_batch_tokens)


def check_weights_dtype(weights_dtype: Any, backend: str, expert_impl: str) -> None:
    """ValueError naming what cannot hold or compute experts kept in FP8: the backend (only
    ``resident`` places the scales; the others' missing work is named) or the expert
    implementation (those of ``moejax.moe.FP8_IMPLS`` dequantize per expert or tile)."""
    from moejax.backends.base import fp8_experts_refusal

    if weights_dtype not in WEIGHTS_DTYPES:
        raise ValueError(f"weights_dtype must be one of {WEIGHTS_DTYPES}, got {weights_dtype!r}")
    if weights_dtype != "fp8":
        return
    if backend != "resident":
        raise ValueError(fp8_experts_refusal(backend))
    if expert_impl not in FP8_IMPLS:
        raise ValueError(f"weights_dtype='fp8': expert_impl {expert_impl!r} takes whole expert "
                         f"stacks, which FP8 weights would need dequantized up front; use one "
                         f"of {FP8_IMPLS}")


def _as_file(path: str | os.PathLike | Traversable) -> Traversable:
    """A path on disk as a :class:`pathlib.Path`; package data as it is."""
    return Path(path) if isinstance(path, (str, os.PathLike)) else path


def read_yaml(path: str | os.PathLike | Traversable) -> dict[str, Any]:
    import yaml

    with _as_file(path).open("r", encoding="utf-8") as fh:
        values = yaml.safe_load(fh) or {}
    if not isinstance(values, dict):
        raise ValueError(f"{path}: expected a mapping of option names to values")
    return values


def shipped_deployments() -> list[str]:
    """Names of the deployment files that ship with serving (``offload``, ``tp``, ...)."""
    return sorted(entry.name[:-len(".yaml")] for entry in DEPLOYMENTS_DIR.iterdir()
                  if entry.name.endswith(".yaml") and entry.is_file())


def deployment_file(deployment: str | os.PathLike | Traversable) -> Traversable:
    """The deployment YAML ``deployment`` names: a file (path), else a shipped deployment by
    name (``"offload"`` or ``"offload.yaml"``: ``serving/configs/deployments/offload.yaml``);
    FileNotFoundError naming the shipped ones otherwise."""
    path = _as_file(deployment)
    if path.is_file():
        return path
    name = os.fspath(deployment) if isinstance(deployment, (str, os.PathLike)) else None
    if name and "/" not in name and os.sep not in name:
        shipped = DEPLOYMENTS_DIR / (name if name.endswith(".yaml") else f"{name}.yaml")
        if shipped.is_file():
            return shipped
    raise FileNotFoundError(f"deployment config {str(deployment)!r} does not exist (a YAML "
                            f"file, or a shipped deployment: {', '.join(shipped_deployments())})")


def load_options(overrides: Mapping[str, Any] | None = None,
                 path: str | os.PathLike | Traversable = DEFAULTS_PATH,
                 deployment: str | os.PathLike | Traversable | None = None) -> ScorerOptions:
    """Defaults from the YAML file (``serving/configs/scoring.yaml``, package data), then a
    deployment YAML (a file, or a shipped one by name: :func:`deployment_file`; the same
    keys, typically backend, devices and backend_options), then ``overrides`` (None values
    are ignored)."""
    values: dict[str, Any] = {}
    defaults = _as_file(path)
    if not defaults.is_file():    # the shipped one missing: an install without its package data
        raise FileNotFoundError(f"Scorer defaults {str(path)!r} do not exist")
    values.update(read_yaml(defaults))
    if deployment is not None:
        values.update(read_yaml(deployment_file(deployment)))
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    if "backend_options" in overrides and isinstance(values.get("backend_options"), Mapping):
        # merged, so that e.g. --window keeps the deployment's other backend keywords
        overrides["backend_options"] = {**values["backend_options"], **overrides["backend_options"]}
    values.update(overrides)
    known = {f.name for f in dataclasses.fields(ScorerOptions)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise TypeError(f"unknown Scorer option(s) {unknown}; known: {sorted(known)}")
    return ScorerOptions(**values)
