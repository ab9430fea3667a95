"""Shared pytest setup: CPU JAX with 8 virtual devices, repo root on sys.path, ``gpu`` marker."""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Must happen before anything imports jax (conftest is imported before the test modules).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import pytest  # noqa: E402


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a GPU backend (skipped when jax has none)")
    import jax

    if jax.default_backend() == "gpu":
        # XLA runs float32 matmuls as TF32 on GPUs by default (~3e-4 relative error); the
        # float32 tests compare with float64 references at float32 tolerances.
        jax.config.update("jax_default_matmul_precision", "highest")


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return
    import jax

    if jax.default_backend() == "gpu":
        return
    skip = pytest.mark.skip(reason=f"needs a GPU (jax backend is {jax.default_backend()!r})")
    for item in gpu_items:
        item.add_marker(skip)
