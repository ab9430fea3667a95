"""Group-aware row-tile schedules for grouped GEMMs over rows sorted by expert.

Rows ``[T, d]`` arrive grouped by expert (group g is the next ``group_sizes[g]``
rows). A kernel that cuts them into row tiles of ``block_m`` meets tiles that
straddle a group boundary; with many small experts (Qwen3-30B-A3B: 128 experts,
~1,000 rows each at 16K tokens) that is a large share of the tiles.

:func:`work_items` is the megablox-style schedule: one *work item* per
(group, row tile) pair the group touches, so every item multiplies rows of one
group by one expert matrix, and a straddling tile becomes two (or more) items
that each own a disjoint row range of it. There are at most
``cdiv(T, block_m) + E - 1`` items, a static bound, so the schedule has static
shapes; items past the real count have ``rows == 0`` and do nothing. A GPU kernel
runs the items in parallel (a persistent loop over SMs) and each stores only its
own rows, so nothing is accumulated across programs.

:func:`schedule_cost` counts what a schedule computes (rows multiplied, whole
tiles, rows wasted on masking) for a group-size vector, in NumPy: the tile sweep
uses it to explain a shape's measured rate, and the tests hold :func:`work_items`
to it.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int, Integer


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class WorkItems:
    """The schedule: item i multiplies rows ``[tile[i]*block_m + row_lo[i], + rows[i])``
    (all in group ``group[i]``) by expert ``group[i]``'s matrix.

    group, tile, row_lo, rows: [W] int32 with W = ``max_work_items(T, E, block_m)``;
    items past ``count`` have ``rows == 0`` (and group / tile 0). count: [] int32.
    """

    group: Int[Array, "W"]
    tile: Int[Array, "W"]
    row_lo: Int[Array, "W"]
    rows: Int[Array, "W"]
    count: Int[Array, ""]


def max_work_items(num_rows: int, num_groups: int, block_m: int, tail: bool = False) -> int:
    """The static bound on work items: every row tile once, plus one more item per group
    boundary that can fall inside a tile (the tail is one more group)."""
    if num_rows < 0 or num_groups < 1 or block_m < 1:
        raise ValueError(f"need num_rows >= 0, num_groups >= 1 and block_m >= 1, got "
                         f"{num_rows}, {num_groups}, {block_m}")
    return max(-(-num_rows // block_m), 1) + num_groups - 1 + int(tail)


def work_items(group_sizes: Integer[Array, "E"], num_rows: int, block_m: int,
               tail: bool = False) -> WorkItems:
    """The group-aware schedule of ``num_rows`` rows grouped by ``group_sizes`` (jittable).

    Rows past ``sum(group_sizes)`` belong to no item, or with ``tail=True`` to items of
    group ``E`` (one past the last expert): a kernel writes zeros there, so that every
    output row is written exactly once without a separate zeroing pass.
    """
    sizes = group_sizes.astype(jnp.int32)
    if tail:
        sizes = jnp.concatenate([sizes, jnp.maximum(num_rows - jnp.sum(sizes), 0)[None]])
    num_groups = sizes.shape[0]
    capacity = max_work_items(num_rows, num_groups, block_m)   # (the tail is in sizes)
    group_end = jnp.cumsum(sizes)
    group_start = group_end - sizes
    first_tile = group_start // block_m
    last_tile = (group_end - 1) // block_m
    tiles_of_group = jnp.where(sizes > 0, last_tile - first_tile + 1, 0)
    item_end = jnp.cumsum(tiles_of_group)
    item = jnp.arange(capacity, dtype=jnp.int32)
    # The group of item i is the first whose items end past i (empty groups own none).
    group = jnp.minimum(jnp.searchsorted(item_end, item, side="right"), num_groups - 1)
    group = group.astype(jnp.int32)
    valid = item < item_end[-1]
    tile = first_tile[group] + item - (item_end[group] - tiles_of_group[group])
    tile_start = tile * block_m
    lo = jnp.maximum(group_start[group], tile_start)
    hi = jnp.minimum(group_end[group], tile_start + block_m)
    zero = jnp.zeros_like(item)
    return WorkItems(group=jnp.where(valid, group, zero), tile=jnp.where(valid, tile, zero),
                     row_lo=jnp.where(valid, lo - tile_start, zero),
                     rows=jnp.where(valid, hi - lo, zero), count=item_end[-1].astype(jnp.int32))


@dataclasses.dataclass(frozen=True)
class ScheduleCost:
    """What a schedule multiplies, in rows of ``block_m``-row tiles.

    useful_rows: rows that belong to a group; computed_rows: rows the tiles multiply
    (whole tiles, masked or not); waste: 1 - useful / computed.
    """

    items: int
    useful_rows: int
    computed_rows: int

    @property
    def waste(self) -> float:
        return 1.0 - self.useful_rows / self.computed_rows if self.computed_rows else 0.0


def schedule_cost(group_sizes: np.ndarray, block_m: int, schedule: str = "work_items"
                  ) -> ScheduleCost:
    """The rows a schedule multiplies for these group sizes (NumPy).

    ``"work_items"``: one whole tile per (group, tile) pair (this module's schedule and
    the Triton kernel's per-tile group visits: both run a straddling tile once per
    group). ``"padded"``: each group's rows padded to whole tiles, as a dispatcher that
    lays groups at tile-aligned offsets would give (no straddling tiles, padding rows).
    """
    sizes = np.asarray(group_sizes, np.int64)
    if sizes.ndim != 1 or (sizes < 0).any():
        raise ValueError(f"group_sizes must be a 1-D array of counts >= 0, got {sizes!r}")
    useful = int(sizes.sum())
    if schedule == "padded":
        tiles = int((-(-sizes // block_m)).sum())
        return ScheduleCost(items=tiles, useful_rows=useful, computed_rows=tiles * block_m)
    if schedule != "work_items":
        raise ValueError(f"unknown schedule {schedule!r}; choose 'work_items' or 'padded'")
    end = np.cumsum(sizes)
    start = end - sizes
    nonempty = sizes > 0
    items = int(((end[nonempty] - 1) // block_m - start[nonempty] // block_m + 1).sum())
    return ScheduleCost(items=items, useful_rows=useful, computed_rows=items * block_m)
