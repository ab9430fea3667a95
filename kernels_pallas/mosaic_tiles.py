"""Tile sizes and hardware limits of the Mosaic GPU kernels (:mod:`kernels_pallas.gmm_mosaic`).

Apart from the kernels so that choosing tiles (:mod:`kernels_pallas.gmm_select`) does not
import Mosaic GPU: importing ``jax.experimental.pallas.mosaic_gpu`` sets
``MOSAIC_GPU_CUDA_ROOT`` in ``os.environ``, and ``import moejax`` must leave the
environment alone. The kernels module is imported only when a Mosaic kernel runs.
"""

from __future__ import annotations

import dataclasses

WGMMA_ROWS = 64
SUPPORTED_DTYPES = ("bfloat16", "float16")
# Shared memory of one H100 block, bytes (the largest dynamic allocation allowed).
HOPPER_SMEM_BYTES = 227 * 1024
# One warpgroup (128 threads) holds each WGMMA accumulator in registers, f32: a
# [block_m, block_n] accumulator costs block_m·block_n/128 registers per thread. A thread
# has 255; half of them for accumulators leaves room for addresses and the epilogue
# (128×128 for one accumulator, as CUTLASS's Hopper kernels use per warpgroup).
WARPGROUP_THREADS = 128
# SMs of an H100 SXM: the persistent grid when a GPU device does not report its count.
H100_SMS = 132
ACCUMULATOR_REGISTERS = 128


@dataclasses.dataclass(frozen=True)
class MosaicTiles:
    """Tile sizes of the Mosaic GPU kernels.

    block_m rows (a multiple of 64) × block_n columns (a multiple of 8, ≤ 256) per
    work item; block_k the reduction step (64 for 2-byte types: one 128-byte swizzle);
    stages: TMA copies in flight (``max_concurrent_steps``); grid_block_n: how many
    column tiles the persistent loop walks before the next row item (``planar_snake``
    width: neighbours share weight blocks in L2).
    """

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    stages: int = 4
    grid_block_n: int = 1

    def __post_init__(self):
        if self.block_m < WGMMA_ROWS or self.block_m % WGMMA_ROWS:
            raise ValueError(f"MosaicTiles.block_m must be a multiple of {WGMMA_ROWS}, got "
                             f"{self.block_m}")
        if not 8 <= self.block_n <= 256 or self.block_n % 8:
            raise ValueError(f"MosaicTiles.block_n must be a multiple of 8 in [8, 256], got "
                             f"{self.block_n}")
        if self.block_k < 16 or self.block_k & (self.block_k - 1):
            raise ValueError(f"MosaicTiles.block_k must be a power of two >= 16, got "
                             f"{self.block_k}")
        if self.stages < 2:
            raise ValueError(f"MosaicTiles.stages must be >= 2 (one copy in flight while "
                             f"one computes), got {self.stages}")
        if self.grid_block_n < 1:
            raise ValueError(f"MosaicTiles.grid_block_n must be >= 1, got {self.grid_block_n}")

    def accumulator_registers(self, num_weights: int) -> int:
        """f32 registers per thread for ``num_weights`` accumulators (one per product)."""
        return num_weights * self.block_m * self.block_n // WARPGROUP_THREADS

    def smem_bytes(self, itemsize: int, num_weights: int) -> int:
        """Shared memory the kernel asks for: ``stages`` copies of the row block and of
        each weight block, plus the output block."""
        per_stage = self.block_m * self.block_k + num_weights * self.block_k * self.block_n
        return itemsize * (self.stages * per_stage + self.block_m * self.block_n)


# Plain defaults per kernel (the tuned table lives in gmm_select): the fused gate/up
# kernel holds two accumulators, so half the rows keep it inside ACCUMULATOR_REGISTERS.
DEFAULT_TILES = {"gmm": MosaicTiles(block_m=128, block_n=128),
                 "swiglu": MosaicTiles(block_m=64, block_n=128)}
