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
from kernels_pallas.gmm_mosaic import SUPPORTED_DTYPES, MosaicTiles

BACKENDS = ("triton", "mosaic")

# (device kind prefix or platform, dtype) -> backend, from measurements only.
MEASURED_BACKENDS: dict[tuple, str] = {}

# Mosaic GPU tiles, keyed as in kernels_pallas.tile_table. The platform default is the
# largest tile whose fused gate/up kernel fits an H100 block (see MosaicTiles.smem_bytes);
# no sweep has been run on a GPU yet (benchmarks/gmm.py --sweep-tiles times these).
MOSAIC_TILES: dict[tuple, MosaicTiles] = {
    ("gpu", "bfloat16"): MosaicTiles(block_m=128, block_n=128, block_k=64, stages=4),
    ("gpu", "float16"): MosaicTiles(block_m=128, block_n=128, block_k=64, stages=4),
}


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


def mosaic_tiles_for(dtype, *, shape: tile_table.Shape | None = None,
                     device_kind: str | None = None, platform: str = "gpu") -> MosaicTiles:
    """The Mosaic GPU tiles for this dtype (and (d, f, E) shape, where swept)."""
    tiles = tile_table.lookup(MOSAIC_TILES, dtype, device_kind=device_kind, platform=platform,
                              shape=shape)
    if tiles is None:
        raise ValueError(f"no Mosaic GPU tiles for {jnp.dtype(dtype).name} on {platform}; "
                         f"known: {sorted(MOSAIC_TILES)}")
    return tiles
