"""The device a run measures on, its measured bf16 matmul rate (the rate every fraction of
a GPU run is taken of) and its measured memory bandwidth (the floor of memory-bound work).

A datasheet peak (989 TFLOP/s bf16 dense for an H100 or H200 SXM) is not what a kernel
can reach: clocks, power and the matmul library set the ceiling. So a device run first
times a large square bf16 matmul (f32 accumulation, the median of ``--repeats``, inputs
rotated so that no repeat finds the last one's data in cache) and every MFU and
fraction-of-matmul after it divides by that measured rate (``benchmarks.gpu_once`` passes
it to each benchmark as ``--peak-tflops`` / ``--matmul-tflops``).

The bandwidth is a large elementwise pass (``a + 1`` over bf16 arrays, rotated), counting
the bytes read plus the bytes written: the ceiling a decode step's expert and KV reads
are measured against.

    python -m benchmarks.device_env [--quick] [--json PATH] [--size N] [--repeats R]

JSON keys: ``matmul_bf16_tflops`` (measured), ``matmul_size``, ``datasheet_bf16_tflops``
(the peak table's entry for this device kind, absent when it has none),
``matmul_over_datasheet``, ``copy_tbps`` (measured, read + written bytes per second / 1e12),
``copy_bytes`` (bytes of one array), ``platform``, ``device_kind``, ``device_count``,
``jax_version``, ``nvidia_smi`` (its CSV query, absent without the tool),
``tiles_stand_in`` (the device kind whose tuned tiles this one uses where it has none of
its own: ``kernels_pallas.tile_table.STAND_INS``, e.g. the H100's for an H200; absent
when there is none).
"""

from __future__ import annotations

import argparse

import shutil
import subprocess
from typing import Any

from benchmarks.lib.cli import bench_parser, parse_args
from benchmarks.lib.meta import finish_run, platform_figures
from benchmarks.lib.timing import (datasheet_tflops, is_gpu, matmul_tflops,
                                   median_seconds_rotating)
from kernels_pallas.tile_table import stand_in

NVIDIA_SMI_QUERY = "name,memory.total,driver_version,clocks.max.sm,power.limit"
# [N, N] x [N, N]: large enough on an H100/H200 to reach the matmul library's steady rate
# (8192: 1.1 TFLOP per call, ~1.2 ms); small on CPU and with --quick.
GPU_SIZE, CPU_SIZE, QUICK_SIZE = 8192, 1024, 256
# Elements of one array of the bandwidth pass (bf16): 1 GiB on a GPU, many times its L2.
GPU_COPY, CPU_COPY, QUICK_COPY = 1 << 29, 1 << 24, 1 << 20


def copy_tbps(elements: int, repeats: int) -> float:
    """Measured memory bandwidth, TB/s: ``a + 1`` over ``elements`` bf16 values (one read
    and one write of each), two arrays in turn, median of ``repeats``."""
    import jax
    import jax.numpy as jnp

    sets = [(jax.random.normal(jax.random.key(i), (elements,), jnp.bfloat16),)
            for i in range(2)]
    seconds = median_seconds_rotating(jax.jit(lambda a: a + 1), sets, repeats, label="copy")
    return 2 * elements * 2 / seconds / 1e12


def nvidia_smi() -> str | None:
    """``nvidia-smi``'s CSV line(s) for the devices, None where the tool is absent or fails."""
    tool = shutil.which("nvidia-smi")
    if tool is None:
        return None
    try:
        done = subprocess.run([tool, f"--query-gpu={NVIDIA_SMI_QUERY}", "--format=csv"],
                              capture_output=True, text=True, timeout=20, check=True)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"nvidia-smi failed: {type(exc).__name__}: {exc}"
    return done.stdout.strip()


def build_parser() -> argparse.ArgumentParser:
    parser = bench_parser(__doc__, quick_help=f"a {QUICK_SIZE}-square matmul (seconds on CPU)",
                          repeats=None, repeats_help="timed matmuls, median kept "
                                                     "(default 20 GPU, 3 CPU)")
    parser.add_argument("--size", type=int, help=f"matrix side (default {GPU_SIZE} GPU, "
                                                  f"{CPU_SIZE} CPU, {QUICK_SIZE} quick)")
    return parser


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = build_parser()
    args = parse_args(parser, argv)
    import jax

    smi = nvidia_smi()
    if smi is not None:
        print(smi)
    figures: dict[str, Any] = {**platform_figures(), "device_count": jax.device_count(),
                               "jax_version": jax.__version__}
    print(f"JAX {jax.__version__} on {figures['platform']}: {jax.devices()}", flush=True)
    gpu = is_gpu()
    size = args.size or (QUICK_SIZE if args.quick else GPU_SIZE if gpu else CPU_SIZE)
    repeats = args.repeats or (20 if gpu else 3)
    rate = matmul_tflops("bfloat16", size, repeats)
    figures.update(matmul_bf16_tflops=rate, matmul_size=size)
    if smi is not None:
        figures["nvidia_smi"] = smi
    sheet = datasheet_tflops(figures["device_kind"], "bfloat16")
    line = f"measured bf16 matmul ({size}^3, median of {repeats}): {rate:.4g} TFLOP/s"
    if sheet is not None:
        figures.update(datasheet_bf16_tflops=sheet, matmul_over_datasheet=rate / sheet)
        line += f" = {rate / sheet:.1%} of the datasheet's {sheet:g}"
    print(line, flush=True)
    elements = QUICK_COPY if args.quick else GPU_COPY if gpu else CPU_COPY
    figures.update(copy_tbps=copy_tbps(elements, repeats), copy_bytes=2 * elements)
    print(f"measured memory bandwidth (a + 1 over {2 * elements / 2**20:.0f} MiB, read + "
          f"written): {figures['copy_tbps']:.4g} TB/s", flush=True)
    other = stand_in(figures["device_kind"])
    if other is not None:
        figures["tiles_stand_in"] = other
        print(f"tuned tiles: where {figures['device_kind']} has no entries of its own, "
              f"{other}'s are used (kernels_pallas.tile_table.STAND_INS)")
    return finish_run(figures, args.json_path)


if __name__ == "__main__":
    main()
