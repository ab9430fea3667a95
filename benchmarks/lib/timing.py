"""Timing: medians and percentiles of wall times, and the device's peak FLOP rate.

Every timed call goes through :func:`sample_seconds` (or a script's own loop inside
:func:`benchmarks.lib.compiles.timed_pass`), so its compiles are counted. The loop itself
is ``moejax.calibrate.sample_seconds``, the one the engine calibrates with.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import statistics
import time
from typing import Any, Callable, Sequence

import numpy as np

from benchmarks.lib.compiles import timed_pass

# (device-kind substring, dtype) -> dense TFLOP/s (SXM datasheets; f32 without tensor
# cores). The first matching substring wins, so "h100 pcie" stands before "h100".
PEAK_TABLE = {("h200", "bfloat16"): 989.0, ("h200", "float32"): 67.0,
              ("h100 pcie", "bfloat16"): 756.0, ("h100 pcie", "float32"): 51.0,
              ("h100", "bfloat16"): 989.0, ("h100", "float32"): 67.0}


def is_gpu() -> bool:
    """Whether JAX runs on a GPU (starts JAX)."""
    import jax

    return jax.default_backend() in ("gpu", "cuda", "rocm")


def median(values: Sequence[float]) -> float:
    """The median (NaN when empty)."""
    return float(statistics.median(values)) if len(values) else math.nan


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (q in 0..100, numpy's linear interpolation); NaN when empty."""
    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else math.nan


def timed_call(fn: Callable[[], Any], *, label: str | None) -> tuple[float, Any]:
    """(wall seconds, result) of one call of ``fn`` (for a pass whose result is used, or a
    loop that alternates several workloads): a counted pass named ``label``, or, with
    ``label`` None, a warm-up whose time is reported but is no measurement."""
    with timed_pass(label) if label else contextlib.nullcontext():
        start = time.perf_counter()
        result = fn()
        seconds = time.perf_counter() - start
    return seconds, result


def sample_seconds(fn: Callable[[], Any], repeats: int, *, label: str, warmup: int = 1
                   ) -> list[float]:
    """Wall seconds of ``repeats`` calls of ``fn`` (which must synchronize, e.g. end in
    ``jax.block_until_ready``) after ``warmup`` untimed calls; the timed calls are one
    counted pass named ``label``."""
    from moejax.calibrate import sample_seconds as engine_sample_seconds

    for _ in range(warmup):
        fn()
    with timed_pass(label):
        return engine_sample_seconds(fn, repeats, warmup=0)


def median_seconds(fn: Callable[[], Any], repeats: int, *, label: str, warmup: int = 1
                   ) -> float:
    """Median of :func:`sample_seconds`."""
    return median(sample_seconds(fn, repeats, label=label, warmup=warmup))


def median_seconds_rotating(fn: Callable[..., Any], input_sets: Sequence[Sequence[Any]],
                            repeats: int, *, label: str) -> float:
    """Median synchronized wall seconds of ``fn(*inputs)``, the inputs taken in turn from
    ``input_sets`` (so a repeat does not just find the previous call's data in a cache),
    after one warm-up call per input set."""
    import jax

    turn = itertools.cycle(input_sets)
    return median_seconds(lambda: jax.block_until_ready(fn(*next(turn))), repeats,
                          label=label, warmup=len(input_sets))


def matmul_tflops(dtype: Any, size: int = 2048, repeats: int = 5, input_sets: int = 2
                  ) -> float:
    """The default device's dense matmul rate, [size, size] x [size, size] in ``dtype``
    (f32 accumulation), median of ``repeats``."""
    import jax
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    sets = [tuple(jnp.asarray(rng.standard_normal((size, size)), dtype) for _ in range(2))
            for _ in range(input_sets)]
    fn = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.float32).astype(a.dtype))
    return 2 * size ** 3 / median_seconds_rotating(fn, sets, repeats, label="matmul") / 1e12


def device_peak(peak_tflops: float | None, dtype: str) -> tuple[float, str]:
    """(peak TFLOP/s per device, where it came from): ``peak_tflops`` when given, else
    :data:`PEAK_TABLE` by device kind, else the measured :func:`matmul_tflops`."""
    import jax

    if peak_tflops:
        return peak_tflops, "--peak-tflops"
    kind = jax.devices()[0].device_kind
    value = datasheet_tflops(kind, dtype)
    if value is not None:
        return value, f"table ({kind}, {dtype})"
    return matmul_tflops(dtype), "measured matmul"


def datasheet_tflops(device_kind: str, dtype: str) -> float | None:
    """:data:`PEAK_TABLE`'s dense rate for this device kind and dtype (the first entry
    whose substring the kind contains), None when it has none."""
    for (sub, table_dtype), value in PEAK_TABLE.items():
        if sub in device_kind.lower() and table_dtype == dtype:
            return value
    return None


def mfu_devices(num_devices: int) -> int:
    """Devices a peak is multiplied by: on CPU the host devices share one machine."""
    import jax

    return 1 if jax.default_backend() == "cpu" else num_devices
