"""Which grouped-GEMM kernel runs where: Pallas Triton or Pallas Mosaic GPU, by measurement.

JAX 0.11 deprecates the Triton backend of Pallas; :mod:`kernels_pallas.gmm_mosaic`
holds the Mosaic GPU ports. The rule: a (device kind, dtype) pair runs the Mosaic
kernels only where ``benchmarks/gmm.py`` measured them at least as fast as the
Triton ones on both expert shapes it times (Qwen3-30B-A3B and Mixtral, 16K
tokens, ``{M}_{N}_mosaic_over_triton`` ≥ 1.0 in the same run); every such entry
of :data:`MEASURED_BACKENDS` names the run in docs/PERF.md. Everything else runs
Triton, the kernel measured on an H100 (docs/PERF.md, 2026-11-22). The Mosaic
kernels have been lowered for CUDA and checked in interpret mode on CPU, but not
yet timed on a GPU, so the table is empty and Triton runs everywhere until a GPU
session fills it.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax.numpy as jnp

from kernels_pallas import tile_table
from kernels_pallas.mosaic_tiles import DEFAULT_TILES, SUPPORTED_DTYPES, MosaicTiles

BACKENDS = ("triton", "mosaic")
KERNELS = ("gmm", "swiglu")

# (device kind prefix or platform, dtype) -> backend, from measurements only.
MEASURED_BACKENDS: dict[tuple, str] = {}

# Mosaic GPU tiles, keyed as in kernels_pallas.tile_table, per kernel. The platform
# entries are the plain defaults (gmm_mosaic.DEFAULT_TILES: 128×128 for the grouped GEMM,
# 64×128 for the fused gate/up kernel, whose two accumulators would otherwise outgrow the
# register budget); no sweep has run on a GPU yet (benchmarks/gmm.py --sweep-tiles times
# the candidates).
MOSAIC_TILES: dict[str, dict[tuple, MosaicTiles]] = {
    kernel: tile_table.entries(("gpu",), SUPPORTED_DTYPES, DEFAULT_TILES[kernel])
    for kernel in KERNELS}


def choose_backend(dtype, *, device_kind: str | None = None, platform: str | None = None,
                   table: Mapping[tuple, str] = MEASURED_BACKENDS) -> str:
    """``"mosaic"`` where a measurement put it for this device and dtype (2-byte dtypes on
    a GPU only), else ``"triton"``."""
    platform = platform or tile_table.platform_of()
    if platform != "gpu" or jnp.dtype(dtype).name not in SUPPORTED_DTYPES:
        return "triton"
    chosen = tile_table.lookup(table, dtype, device_kind=device_kind, platform=platform)
    if chosen is not None and chosen not in BACKENDS:
        raise ValueError(f"backend table entry {chosen!r} is not one of {BACKENDS}")
    return chosen or "triton"


def mosaic_tiles_for(dtype, *, kernel: str = "gmm", shape: tile_table.Shape | None = None,
                     device_kind: str | None = None, platform: str = "gpu") -> MosaicTiles:
    """The Mosaic GPU tiles of ``kernel`` (``"gmm"`` or the fused ``"swiglu"``) for this
    dtype (and (d, f, E) shape, where swept)."""
    if kernel not in KERNELS:
        raise ValueError(f"unknown kernel {kernel!r}; choose one of {KERNELS}")
    table = MOSAIC_TILES[kernel]
    tiles = tile_table.lookup(table, dtype, device_kind=device_kind, platform=platform,
                              shape=shape)
    if tiles is None:
        raise ValueError(f"no Mosaic GPU {kernel} tiles for {jnp.dtype(dtype).name} on "
                         f"{platform}; known: {sorted(table)}")
    return tiles
