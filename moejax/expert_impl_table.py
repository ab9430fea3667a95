"""Which expert path ``expert_impl: auto`` takes, by device and rows per expert (issue 43).

The table is measured, in the pattern of ``grouped_gemm.TILE_ROWS`` and
``kernels_pallas/tile_table.py``: keyed by device kind (``"cpu"``, ``"gpu"``) and hidden
size bucket (``"small"``: d <= 1024, ``"large"``), each a tuple of thresholds in
ascending order of rows per expert. Rows per expert is the routed rows M (tokens × k,
the padded batch's) over the experts E, both static at trace time. A step takes the
first threshold whose ``max_rows_per_expert`` is at least its rows per expert and whose
``max_experts`` (None: any E) admits its E; the last threshold of every list is
open-ended and admits any E, so every step finds one, and a step of unknown size takes
it (the choice before this table: ``pallas`` on a GPU, ``fused_tiles`` elsewhere).

``max_experts`` is what keeps ``dense`` (every row through every expert: E× the routed
work, and a read of every expert whether a row chose it or not) away from large E: it
wins only where the tile loops waste more (each touched expert multiplies a whole tile
of 64 rows, however few of its rows are real) than dense's E loop costs, which on the
measurements below is M <= 32 rows, and never at E = 128.

``pallas`` needs d and f to be multiples of :data:`PALLAS_MIN_DIM_MULTIPLE`
(Triton's blocks must divide them): where they are not, its entries fall back to
``fused_tiles``. Every entry names a path of ``moe.EXPERT_IMPLS``; the measurements are
``benchmarks/expert_impls.py`` runs (the experts read in place, a ``StackLayer`` view of a
2-layer stack, as serving runs them).
"""

from __future__ import annotations

import math
from typing import NamedTuple


class Threshold(NamedTuple):
    """Take ``impl`` up to ``max_rows_per_expert`` rows per expert, where E <=
    ``max_experts`` (None: any E)."""

    max_rows_per_expert: float
    impl: str
    max_experts: int | None = None


# Hidden sizes up to this are the "small" bucket (as grouped_gemm.TILE_ROWS).
SMALL_HIDDEN_MAX = 1024

EXPERT_IMPL_TABLE: dict[tuple[str, str], tuple[Threshold, ...]] = {
    # CPU, d <= 1024. Measured 2026-11-29 on the 2-core CPU dev machine (shared: load
    # average 3-6 from other jobs; jax 0.10.2, float32, median ms of interleaved rounds),
    # `python -m benchmarks.expert_impls --shapes demo,demo_e32,qwen3_cpu` and
    # `... --shapes demo,demo_e32 --repeats 15` (dense / fused_tiles, two runs):
    #   demo d=128 f=128 E=8 k=2:   rows/E 0.25: 0.27/0.31, 0.27/0.28 (a tie);
    #     1: 0.61/0.62, 0.59/0.76; 2: 0.55/0.89, 0.36/0.65; 4: 0.58/0.77, 0.47/0.75;
    #     8: 0.83/0.80, 0.73/0.86 (mixed); 16: 1.5/0.93, 1.2/0.90 (fused_tiles from here).
    #   demo-e32 d=128 f=64 E=32 k=4: rows/E 0.125: 0.47/0.32, 0.59/0.33;
    #     0.5: 0.66/0.70, 0.76/0.76 (a tie); 1: 0.88/1.00, 1.11/1.48; 2: 1.39/1.15, 1.59/1.34.
    #   qwen3_cpu d=256 f=128 E=128 k=8: dense 2-7× slower at every rows/E 0.06-4
    #     (e.g. 1: 35/14 ms), so no dense entry admits E > 32.
    # gmm (three grouped GEMMs) was never clearly ahead of fused_tiles (at best 11 %
    # faster at one point, up to 3× slower at others): no entry.
    ("cpu", "small"): (
        Threshold(0.5, "fused_tiles"),        # few rows: dense reads every idle expert
        Threshold(1, "dense", max_experts=32),    # E=8 and E=32 at rows/E 1 (M <= 32)
        Threshold(4, "dense", max_experts=8),     # E=8 at rows/E 2-4 (M 16-32)
        Threshold(math.inf, "fused_tiles"),
    ),
    # CPU, d > 1024. Measured 2026-11-29, same machine, `python -m benchmarks.expert_impls
    # --shapes qwen3 --tokens 1,4,16 --repeats 3` (Qwen3-30B-A3B layer d=2048 f=768
    # E=128 k=8), fused_tiles / gmm / dense ms: rows/E 0.0625: 153 / 117 / 1768;
    # 0.25: 527 / 591 / (not timed: 38 GFLOP); 1: 1297 / 1289 / (not timed). Dense is 12×
    # slower at E=128 and no small-E shape of this width was measured, so it has no entry;
    # gmm's one win (1.3× at a single token) is not enough to set an entry on a loaded
    # machine.
    ("cpu", "large"): (
        Threshold(math.inf, "fused_tiles"),
    ),
    # GPU: no GPU was measured for this table. From issue 43's figures (Qwen3-30B-A3B
    # layer, n=128 experts, bf16 decode): fused_tiles beat pallas for decode batches up
    # to 32 tokens (4.6 vs 7.5 ms at B=16), i.e. up to 32·8/128 = 2 rows per expert at
    # k=8; pallas above. The small bucket has no figures of its own and takes the same.
    # Rerun `python -m benchmarks.expert_impls` on a GPU to replace both.
    ("gpu", "small"): (
        Threshold(2, "fused_tiles"),
        Threshold(math.inf, "pallas"),
    ),
    ("gpu", "large"): (
        Threshold(2, "fused_tiles"),
        Threshold(math.inf, "pallas"),
    ),
}


def device_of(platform: str) -> str:
    """The table's device key: ``gpu`` for CUDA/ROCm backends, ``cpu`` for the rest."""
    return "gpu" if platform in ("gpu", "cuda", "rocm") else "cpu"


# Smallest d and f the Pallas kernel takes on a GPU: Triton's dot needs blocks of at
# least 16 along every dimension, and the blocks must divide d and f.
PALLAS_MIN_DIM_MULTIPLE = 16


def hidden_bucket(hidden: int) -> str:
    return "small" if hidden <= SMALL_HIDDEN_MAX else "large"


def thresholds_for(platform: str, hidden: int) -> tuple[Threshold, ...]:
    """The thresholds of this platform and hidden size."""
    return EXPERT_IMPL_TABLE[(device_of(platform), hidden_bucket(hidden))]


def pallas_fits(hidden: int, intermediate: int) -> bool:
    """Whether the Pallas kernel's blocks can divide d and f
    (:data:`PALLAS_MIN_DIM_MULTIPLE`)."""
    return hidden % PALLAS_MIN_DIM_MULTIPLE == 0 and intermediate % PALLAS_MIN_DIM_MULTIPLE == 0


def expert_impl_for(platform: str, hidden: int, intermediate: int, rows: int | None,
                    num_experts: int | None) -> str:
    """The path for ``rows`` routed rows (M = tokens × k) over ``num_experts`` experts of
    d=``hidden``, f=``intermediate`` on ``platform``; rows or num_experts None: the
    open-ended (last) entry. ``pallas`` where d or f is not a multiple of
    :data:`PALLAS_MIN_DIM_MULTIPLE` becomes ``fused_tiles``."""
    table = thresholds_for(platform, hidden)
    impl = table[-1].impl
    if rows is not None and num_experts is not None:
        per_expert = rows / max(num_experts, 1)
        for entry in table:
            if per_expert <= entry.max_rows_per_expert and (
                    entry.max_experts is None or num_experts <= entry.max_experts):
                impl = entry.impl
                break
    if impl == "pallas" and not pallas_fits(hidden, intermediate):
        return "fused_tiles"
    return impl
