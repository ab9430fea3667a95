"""XLA flags the overlapping backends rely on, set by the project rather than the user.

On GPUs, XLA overlaps an asynchronous collective (``all-gather-start`` …
``all-gather-done``) with independent compute only when its latency-hiding
scheduler orders the program for it. The flags are appended to ``XLA_FLAGS`` when
``moejax`` is imported, before JAX starts its backends (a flag the user already set,
with any value, is left as the user set it). They are GPU flags; other platforms
accept and ignore them.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("moejax.backends")

OVERLAP_FLAGS = {
    "--xla_gpu_enable_latency_hiding_scheduler": "true",
}


def _flag_names(value: str) -> set[str]:
    return {part.split("=", 1)[0] for part in value.split()}


def apply_overlap_flags(environ=os.environ) -> list[str]:
    """Append the missing overlap flags to ``XLA_FLAGS``; returns the flags added."""
    current = environ.get("XLA_FLAGS", "")
    present = _flag_names(current)
    added = [f"{name}={value}" for name, value in OVERLAP_FLAGS.items() if name not in present]
    if added:
        environ["XLA_FLAGS"] = " ".join([current, *added]).strip()
    return added


def backends_started() -> bool:
    """Has JAX already created its backends (so XLA_FLAGS changes come too late)?"""
    import sys

    if "jax" not in sys.modules:
        return False
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


def warn_if_overlap_flags_missing(backend: str) -> None:
    """Log a warning when a GPU run lacks the flags (JAX started before moejax was imported
    with XLA_FLAGS that override them)."""
    import jax

    if jax.default_backend() not in ("gpu", "cuda", "rocm"):
        return
    flags = os.environ.get("XLA_FLAGS", "")
    missing = [f"{n}={v}" for n, v in OVERLAP_FLAGS.items() if f"{n}={v}" not in flags.split()]
    if missing:
        log.warning("backend %s: XLA_FLAGS lacks %s, so transfers may not overlap compute; "
                    "import moejax before JAX starts its backends, or set the flags yourself",
                    backend, " ".join(missing))
