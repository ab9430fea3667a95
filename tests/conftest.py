"""Shared pytest setup: CPU JAX with 8 virtual devices, repo root on sys.path, ``gpu`` marker,
one compilation cache for the whole run, the memory-map guard, and the slow modules.

The run's directory (``$MOEJAX_TEST_RUN_DIR``, made by the first pytest process and
inherited by its xdist workers and every subprocess a test starts) holds:
- ``jax-cache/``: JAX's persistent compilation cache. A program compiled by one worker, one
  module or one ``moejax`` subprocess is loaded, not compiled, by the next.
- the demo models' copies (it is ``$MOEJAX_CACHE``), made once per run instead of in the
  user's ``~/.cache/moejax``.
It is a fresh temporary directory, deleted at the end, unless ``MOEJAX_TEST_CACHE=DIR``
names one to keep across runs (warm local iteration; CI leaves it unset, so its timings are
cold ones).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

# Must happen before anything imports jax (conftest is imported before the test modules).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# The suite's time is XLA:CPU compiling (measured: 61 of 73 s of test_continuous, 67 of
# 79 s of test_prefix_cache are backend compiles of programs no other test builds), and
# most of a compile is LLVM optimising the generated code. The tests check what the
# programs compute, not how fast they run, and LLVM's optimisation level does not change
# what they compute: XLA:CPU does not turn on fast-math, so no optimisation may reorder
# floating-point arithmetic, and matmuls and convolutions call the same precompiled
# Eigen kernels at any level. At level 0 the two modules compile in 46 and 42 s.
# XLA:CPU's newer fusion emitters (elementwise and reduction fusions lowered through MLIR)
# then take most of what is left: with the older LLVM IR emitters the same programs compile
# in a third of the time (measured, one process: test_continuous 53.0 -> 18.9 s of backend
# compiles over 107 programs, test_scoring 35.4 -> 16.0 s). Both emitters implement the
# same HLO with IEEE arithmetic (no fast-math); they may differ in the last bits of
# transcendental functions, which every test's tolerance against its reference (float64
# NumPy, transformers, or the single-device model compiled the same way) already covers.
# Set MOEJAX_TEST_XLA_OPT=production to run the suite with XLA's defaults.
FAST_COMPILE_FLAGS = ("--xla_backend_optimization_level=0",
                      "--xla_llvm_disable_expensive_passes=true",
                      "--xla_cpu_use_fusion_emitters=false")
if os.environ.get("MOEJAX_TEST_XLA_OPT", "fast") != "production":
    for flag in FAST_COMPILE_FLAGS:
        if flag.split("=")[0] not in os.environ["XLA_FLAGS"]:
            os.environ["XLA_FLAGS"] += " " + flag

RUN_DIR_ENV = "MOEJAX_TEST_RUN_DIR"


def _run_dir() -> tuple[str, bool]:
    """The run's shared directory and whether this process made it (and so removes it)."""
    if os.environ.get(RUN_DIR_ENV):              # an xdist worker, or a nested pytest
        return os.environ[RUN_DIR_ENV], False
    kept = os.environ.get("MOEJAX_TEST_CACHE")
    if kept:
        os.makedirs(kept, exist_ok=True)
        return os.path.abspath(kept), False
    return tempfile.mkdtemp(prefix="moejax-tests-"), True


RUN_DIR, _OWN_RUN_DIR = _run_dir()
os.environ[RUN_DIR_ENV] = RUN_DIR
os.environ["MOEJAX_CACHE"] = RUN_DIR
# The directory serving.compilation_cache's "auto" names under this $MOEJAX_CACHE, so the
# in-process tests and the ``moejax`` commands they start share one cache.
JAX_CACHE_DIR = os.path.join(RUN_DIR, "jax-cache")
# What use_run_compilation_cache sets in this process, for the subprocesses too (a
# ``moejax`` command a test starts opens $MOEJAX_CACHE/jax-cache itself).
CACHE_SETTINGS = {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0.3",
                  "JAX_COMPILATION_CACHE_MAX_SIZE": str(16 << 30)}
os.environ.update(CACHE_SETTINGS)

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

# Modules whose jaxtyping shape annotations (``Float[Array, "T d"]``) and ordinary hints are
# checked by beartype on every call during the tests (never in production: the hook only
# exists here). Append a module once its public functions are annotated.
TYPECHECKED_MODULES = [
    "kernels_pallas.gmm",
    "kernels_pallas.gmm_fp8",
    "kernels_pallas.gmm_mosaic",
    "kernels_pallas.metro",
    "kernels_pallas.metro_rounds",
    "kernels_pallas.tile_schedule",
    "moejax.attention",
    "moejax.grouped_gemm",
    "moejax.fp8_experts",
    "moejax.static.cache",
    "moejax.mla",
    "moejax.sampling",
    "moejax.moe",
    "moejax.layers",
    "moejax.attention_kinds",
    "moejax.dispatch",
    "moejax.model",
    "moejax.static.decode",
    "moejax.expert_trace",
    "moejax.kv.pool",
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

    use_run_compilation_cache(jax)

    if jax.default_backend() == "gpu":
        # XLA runs float32 matmuls as TF32 on GPUs by default (~3e-4 relative error); the
        # float32 tests compare with float64 references at float32 tolerances.
        jax.config.update("jax_default_matmul_precision", "highest")


def pytest_unconfigure(config):
    if _OWN_RUN_DIR and not hasattr(config, "workerinput"):
        shutil.rmtree(RUN_DIR, ignore_errors=True)


def use_run_compilation_cache(jax) -> None:
    """Point JAX's persistent compilation cache at the run's directory. A size limit turns on
    JAX's file lock around every read and write: the xdist workers and the subprocesses
    share the directory, and an unlocked reader could load another's half-written entry.
    Programs under 0.3 s to compile are not worth a file each."""
    jax.config.update("jax_compilation_cache_dir", JAX_CACHE_DIR)
    jax.config.update("jax_persistent_cache_min_compile_time_secs",
                      float(CACHE_SETTINGS["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]))
    jax.config.update("jax_compilation_cache_max_size",
                      int(CACHE_SETTINGS["JAX_COMPILATION_CACHE_MAX_SIZE"]))


# Modules that ``make test-quick`` (``-m "not slow"``) leaves out whole: each took over
# 25 s of worker time in the full suite, or runs a benchmark or a backend's recovery and
# pipeline end to end (measured on the 2-core CI machine, 2 workers).
# They are the end-to-end ones: subprocesses and servers (gRPC, router, remote scoring,
# multi-process, CLI), every model family and generation against transformers, the
# backends against resident, the decode runtime and its techniques, the Pallas kernels
# in interpret mode, the demo models' accuracy and training, and the benchmarks' quick
# runs. test-quick keeps the unit tests of every package plus the model, the MoE layer
# and scoring on the demo model. Single tests elsewhere carry their own slow mark.
SLOW_MODULES = frozenset("""
    test_asyncmoe_runtime test_attention_variants test_backend_sync_ep test_backend_tp
    test_backends test_benchmark_backends test_cli_hostile test_compiles test_continuous
    test_decode_sync_ep test_decoders test_demo_accuracy test_demo_e32 test_demo_train
    test_families test_full_model_bench test_generate test_generation_bench
    test_gmm_kernel test_gmm_mosaic test_gpt_oss test_grpc_generation test_grpc_overload
    test_grpc_router test_grpc_server test_issue7_benchmarks test_multi_process test_ops
    test_parity test_prefetch test_prefix_cache test_recovery test_remote_score
    test_request_fuzz test_serving_frontend test_streamed_pipeline test_time_breakdown
    test_traces
""".split())


@pytest.hookimpl(tryfirst=True)       # before -m "not slow" deselects by mark
def pytest_collection_modifyitems(config, items):
    unknown = SLOW_MODULES - {path.stem for path in Path(__file__).parent.glob("test_*.py")}
    if unknown:
        raise pytest.UsageError(f"conftest.SLOW_MODULES names no test module: {sorted(unknown)}")
    slow = pytest.mark.slow
    for item in items:
        if item.module is not None and item.module.__name__.rsplit(".", 1)[-1] in SLOW_MODULES:
            item.add_marker(slow)
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
    """A test that runs a command, or tests the cache setting itself, points JAX's
    persistent compilation cache elsewhere (a tmp dir, or none); put the run's cache back
    afterwards. JAX opens the cache directory once per process and keeps writing to the one
    it opened (a test's, since deleted) even after the setting is put back, so a changed
    setting also resets JAX's open cache."""
    import jax

    from jax.experimental.compilation_cache import compilation_cache

    yield
    if jax.config.jax_compilation_cache_dir != JAX_CACHE_DIR:
        use_run_compilation_cache(jax)
        compilation_cache.reset_cache()


def mapped_regions() -> int:
    """How many memory mappings this process holds (lines of /proc/self/maps)."""
    with open("/proc/self/maps", "rb") as fh:
        return sum(1 for _ in fh)


def map_count_limit() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as fh:
            return int(fh.read())
    except (OSError, ValueError):
        return 65530            # Linux's default


# Compiled programs are kept across modules (a later module that builds the same program
# finds it in memory), until the process nears the kernel's limit on memory mappings.
# Each XLA:CPU executable maps its code and data in ~6 regions (measured: 6.4 per program),
# so a process that keeps ~10,000 programs alive reaches vm.max_map_count (65,530 by
# default); LLVM's next code allocation then fails inside a compile and the process
# segfaults: the crash seen late in the single-process suite (test_prefix_cache), which
# passes alone. Dropping every compiled program then (they come back from the run's
# compilation cache) keeps the process far below the limit.
MAP_BUDGET = map_count_limit() * 2 // 5


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs_near_the_map_limit():
    import gc

    import jax

    yield
    if mapped_regions() > MAP_BUDGET:
        jax.clear_caches()
        gc.collect()


# The demo models' shared Scorers and Generators: one agreed set of options, built once per
# test process and used by every module whose tests do not depend on the options (their
# programs are then traced, lowered and compiled once). A test that needs other options
# builds its own and says why. The objects are shared: a test must not change their
# settings, and must not assert on counters (stats, compiles) that other tests move.
DEMO_SCORER_OPTIONS = {"dtype": "float32", "max_batch_tokens": 2048}
DEMO_GENERATOR_OPTIONS = {"dtype": "float32", "max_batch_size": 2}


@pytest.fixture(scope="session")
def demo_scorer():
    from serving import Scorer

    return Scorer("demo", **DEMO_SCORER_OPTIONS)


@pytest.fixture(scope="session")
def demo_e32_scorer():
    from serving import Scorer

    return Scorer("demo-e32", **DEMO_SCORER_OPTIONS)


@pytest.fixture(scope="session")
def demo_generator():
    from serving import Generator

    return Generator("demo", **DEMO_GENERATOR_OPTIONS)


@pytest.fixture(scope="session")
def demo_e32_generator():
    from serving import Generator

    return Generator("demo-e32", **DEMO_GENERATOR_OPTIONS)
