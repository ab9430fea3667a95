"""XLA flags that moejax's entry points set, and :func:`configure_xla` that sets them.

On GPUs, XLA overlaps an asynchronous collective (``all-gather-start`` …
``all-gather-done``) with independent compute only when its latency-hiding
scheduler orders the program for it; the overlapping backends (async_ep, offload,
hybrid) rely on that. ``import moejax`` changes nothing: the ``moejax`` command calls
:func:`configure_xla` before JAX starts, and library users call ``moejax.configure_xla()``
themselves. XLA reads ``XLA_FLAGS`` once, when JAX creates its backends, so the call must
come before the first JAX computation or device query. A flag already in ``XLA_FLAGS``,
with any value, is left as the user set it. The GPU flags are accepted and ignored by
other platforms.
"""

from __future__ import annotations

import logging
import os
from typing import MutableMapping

log = logging.getLogger("moejax.backends")

OVERLAP_FLAGS = {
    "--xla_gpu_enable_latency_hiding_scheduler": "true",
}
HOST_DEVICE_FLAG = "--xla_force_host_platform_device_count"
COLLECTIVE_TIMEOUT_FLAG = "--xla_cpu_collective_timeout_seconds"


def _flag_names(value: str) -> set[str]:
    return {part.split("=", 1)[0] for part in value.split()}


def _append_missing(flags: dict[str, str], environ: MutableMapping[str, str]) -> list[str]:
    current = environ.get("XLA_FLAGS", "")
    present = _flag_names(current)
    added = [f"{name}={value}" for name, value in flags.items() if name not in present]
    if added:
        environ["XLA_FLAGS"] = " ".join([current, *added]).strip()
    return added


def apply_overlap_flags(environ: MutableMapping[str, str] = os.environ) -> list[str]:
    """Append the missing overlap flags to ``XLA_FLAGS``; returns the flags added."""
    return _append_missing(OVERLAP_FLAGS, environ)


def apply_host_device_count(count: int | None,
                            environ: MutableMapping[str, str] = os.environ) -> list[str]:
    """Ask for ``count`` CPU host devices (CPU runs of multi-device backends and engines;
    GPUs ignore the flag); nothing for a count below 2. Returns the flags added."""
    if not count or count < 2:
        return []
    return _append_missing({HOST_DEVICE_FLAG: str(count)}, environ)


def apply_collective_timeout(seconds: int,
                             environ: MutableMapping[str, str] = os.environ) -> list[str]:
    """Time XLA's CPU collectives out after ``seconds`` (multi-process CPU runs: see
    :func:`moejax.distributed.with_collective_timeout`); GPUs ignore the flag. Returns the
    flags added."""
    return _append_missing({COLLECTIVE_TIMEOUT_FLAG: str(seconds)}, environ)


def configure_xla(*, host_devices: int | None = None,
                  environ: MutableMapping[str, str] | None = None) -> list[str]:
    """Add the flags moejax's entry points need to ``XLA_FLAGS``; returns the flags added.

    The GPU overlap flags (:data:`OVERLAP_FLAGS`) always; with ``host_devices`` > 1 also
    ``--xla_force_host_platform_device_count`` (CPU only). Flags already present keep the
    user's value. Call it before JAX starts its backends (the first computation or device
    query): XLA reads the flags once, so later they only reach child processes. (JAX has no
    public way to ask whether its backends started; a GPU backend that finds the overlap
    flags missing logs a warning, :func:`warn_if_overlap_flags_missing`.)
    ``environ``: the mapping to edit instead of ``os.environ`` (no warning then).
    """
    target = os.environ if environ is None else environ
    added = apply_overlap_flags(target) + apply_host_device_count(host_devices, target)
    return added


def warn_if_overlap_flags_missing(backend: str) -> None:
    """Log a warning when a GPU run lacks the flags (``moejax.configure_xla()`` was not
    called before JAX started, or XLA_FLAGS overrides them)."""
    import jax

    if jax.default_backend() not in ("gpu", "cuda", "rocm"):
        return
    flags = os.environ.get("XLA_FLAGS", "")
    missing = [f"{n}={v}" for n, v in OVERLAP_FLAGS.items() if f"{n}={v}" not in flags.split()]
    if missing:
        log.warning("backend %s: XLA_FLAGS lacks %s, so transfers may not overlap compute; "
                    "call moejax.configure_xla() before JAX starts its backends (the moejax "
                    "command does), or set the flags in XLA_FLAGS yourself",
                    backend, " ".join(missing))
