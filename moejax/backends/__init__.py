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
    "tp_ep": ("moejax.backends.tp_ep", "TPEPBackend"),
    "dp_tp": ("moejax.backends.dp_tp", "DPTPBackend"),
    "pp": ("moejax.backends.pp", "PPBackend"),
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


# Backends whose one mesh spans every process's devices under jax.distributed (the others
# place everything on one device, which only one process owns).
MULTI_PROCESS_BACKENDS = ("async_ep", "sync_ep", "tp", "hybrid")


def check_multi_process(name: str, devices: int) -> None:
    """BackendError unless backend ``name`` over ``devices`` devices can run in this
    multi-process run (no-op in a single process)."""
    import jax

    from moejax.backends.base import BackendError

    if jax.process_count() == 1:
        return
    if name not in MULTI_PROCESS_BACKENDS:
        raise BackendError(f"backend {name!r} runs on one device and cannot span the "
                           f"{jax.process_count()} processes of this run; use one of "
                           f"{list(MULTI_PROCESS_BACKENDS)}")
    if devices != jax.device_count():
        raise BackendError(f"backend {name!r} over {jax.process_count()} processes must use "
                           f"every process's devices: devices={jax.device_count()} "
                           f"({jax.local_device_count()} per process), got {devices}")


def make_backend(name: str, cfg, params, *, devices: int = 1, **options: Any):
    """Build backend ``name`` over ``devices`` devices; ``options`` are its own keywords
    (``dtype`` for all; e.g. ``window`` for offload, ``capacity_factor`` for sync_ep)."""
    check_multi_process(name, devices)
    return backend_class(name)(cfg, params, devices=devices, **options)


__all__ = ["BACKENDS", "MULTI_PROCESS_BACKENDS", "Backend", "BackendError", "MemoryReport",
           "backend_class", "check_multi_process", "make_backend"]
