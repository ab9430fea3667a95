"""Forcing JAX's CPU host-device count from a benchmark script (before JAX starts)."""

from __future__ import annotations

import os
import sys

FLAG = "--xla_force_host_platform_device_count"


def force_host_devices(count: int) -> None:
    """Ask XLA for ``count`` CPU host devices unless the user's XLA_FLAGS already name a
    count (XLA reads the flags once, when JAX starts: call this before anything imports
    jax)."""
    if FLAG in os.environ.get("XLA_FLAGS", ""):
        return
    if "jax" in sys.modules:
        raise RuntimeError(f"force_host_devices({count}) must run before jax is imported")
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FLAG}={count}".strip()
