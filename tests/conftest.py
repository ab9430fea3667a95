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

# Modules whose jaxtyping shape annotations (``Float[Array, "T d"]``) and ordinary hints are
# checked by beartype on every call during the tests (never in production: the hook only
# exists here). Append a module once its public functions are annotated.
TYPECHECKED_MODULES = [
    "kernels_pallas.gmm",
    "kernels_pallas.gmm_mosaic",
    "kernels_pallas.metro",
    "kernels_pallas.metro_rounds",
    "kernels_pallas.tile_schedule",
    "moejax.attention",
    "moejax.grouped_gemm",
    "moejax.kv_cache",
    "moejax.mla",
    "moejax.sampling",
    "moejax.moe",
    "moejax.layers",
    "moejax.attention_kinds",
    "moejax.dispatch",
    "moejax.model",
    "moejax.generate",
    "moejax.ops",
    "moejax.decode.paged",
    "moejax.prefetch.defaults",
    "moejax.prefetch.estimator",
    "moejax.prefetch.predictors",
]
# PEP 484's numeric tower (an int passes a ``float`` hint), as static checkers read hints.
TYPECHECKER = "beartype.beartype(conf=beartype.BeartypeConf(is_pep484_tower=True))"


def _install_typecheck_hook():
    """Instrument TYPECHECKED_MODULES at import; must run before anything imports them
    (conftest is imported before every test module), and stays for the whole session."""
    early = [name for name in TYPECHECKED_MODULES if name in sys.modules]
    if early:
        raise RuntimeError(f"imported before the jaxtyping hook, so left unchecked: {early}")
    import beartype  # noqa: F401  (the dev extra; the hook imports it lazily otherwise)
    import jaxtyping

    return jaxtyping.install_import_hook(TYPECHECKED_MODULES, TYPECHECKER)


_TYPECHECK_HOOK = _install_typecheck_hook()

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


@pytest.fixture
def typechecks_off():
    """Run a test without the shape/type checks, as production runs: for tests of a
    function's own input validation (its ValueError), which a hint would pre-empt."""
    import jaxtyping

    before = jaxtyping.config.jaxtyping_disable
    jaxtyping.config.update("jaxtyping_disable", True)
    try:
        yield
    finally:
        jaxtyping.config.update("jaxtyping_disable", before)


@pytest.fixture(autouse=True)
def _keep_the_compilation_cache_setting():
    """A test that runs a command turns on JAX's persistent compilation cache (what the
    ``moejax`` entry points do); put the process-wide setting back afterwards, so that
    later tests do not write every program they compile to some test's cache (a later
    cache write segfaulted XLA:CPU in test_prefix_cache)."""
    import jax

    from jax.experimental.compilation_cache import compilation_cache

    before = jax.config.jax_compilation_cache_dir
    yield
    if jax.config.jax_compilation_cache_dir != before:
        jax.config.update("jax_compilation_cache_dir", before)
    if not before:
        # JAX decides once per process that the cache is in use, and keeps writing to
        # the directory it opened (a test's, since deleted) even after the setting is
        # put back (as some tests do themselves); a reset makes it look again.
        compilation_cache.reset_cache()


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
    """Drop every compiled program after each test module: the whole suite compiles
    thousands of programs in one process, and keeping them all alive ended in a
    segfault inside an XLA:CPU compile late in the suite (test_prefix_cache), which
    passes on its own."""
    import gc

    import jax

    yield
    jax.clear_caches()
    gc.collect()
