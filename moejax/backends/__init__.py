"""Execution backends: one interface (``moejax.backends.base.Backend``), same results.

``make_backend(name, cfg, params, devices=..., dtype=..., **options)`` builds one by
the names of DESIGN.md's table. Each module holds one backend.
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> (module, class); imported on demand so one backend's imports never burden another.
BACKENDS = {
    "resident": ("moejax.backends.resident", "ResidentBackend"),
    "offload": ("moejax.backends.streamed", "OffloadBackend"),
    "async_ep": ("moejax.backends.async_ep", "AsyncEPBackend"),
    "hybrid": ("moejax.backends.streamed", "HybridBackend"),
    "sync_ep": ("moejax.backends.sync_ep", "SyncEPBackend"),
    "tp": ("moejax.backends.tp", "TPBackend"),
}


def __getattr__(name: str):
    # Lazy, so that ``import moejax`` (which imports configure_xla from this package) stays
    # cheap.
    if name in ("Backend", "BackendError", "MemoryReport"):
        from moejax.backends import base

        return getattr(base, name)
    raise AttributeError(f"module 'moejax.backends' has no attribute {name!r}")


def backend_class(name: str):
    """The Backend subclass registered as ``name``."""
    from moejax.backends.base import BackendError

    if name not in BACKENDS:
        raise BackendError(f"unknown backend {name!r}; choose one of {sorted(BACKENDS)}")
    module, cls = BACKENDS[name]
    return getattr(importlib.import_module(module), cls)


def make_backend(name: str, cfg, params, *, devices: int = 1, **options: Any):
    """Build backend ``name`` over ``devices`` devices; ``options`` are its own keywords
    (``dtype`` for all; e.g. ``window`` for offload, ``capacity_factor`` for sync_ep)."""
    return backend_class(name)(cfg, params, devices=devices, **options)


__all__ = ["BACKENDS", "Backend", "BackendError", "MemoryReport", "backend_class", "make_backend"]
