"""Validation of the simulator's numbers: each names what was wrong."""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

def number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)) \
            or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def nonnegative(name: str, value: Any) -> float:
    value = number(name, value)
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return value


def positive(name: str, value: Any) -> float:
    value = number(name, value)
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    return value


def int_at_least(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def grid(name: str, values: Any) -> tuple[float, ...]:
    """A measured axis: a non-empty, strictly increasing list of positive numbers."""
    if isinstance(values, (str, bytes)) or not isinstance(values, (Sequence, np.ndarray)) \
            or len(values) == 0:
        raise ValueError(f"{name} must be a non-empty list of numbers, got {values!r}")
    grid = tuple(positive(f"{name}[{i}]", v) for i, v in enumerate(values))
    if any(b <= a for a, b in zip(grid, grid[1:])):
        raise ValueError(f"{name} must be strictly increasing, got {list(grid)}")
    return grid


def seconds_row(name: str, values: Any, length: int) -> tuple[float, ...]:
    if isinstance(values, (str, bytes)) or not isinstance(values, (Sequence, np.ndarray)) \
            or len(values) != length:
        raise ValueError(f"{name} must be a list of {length} seconds, got {values!r}")
    return tuple(nonnegative(f"{name}[{i}]", v) for i, v in enumerate(values))


def segment(x: float, grid: tuple[float, ...]) -> tuple[int, float]:
    """(i, t) with x = grid[i] + t·(grid[i+1] − grid[i]), i clamped to the end segments
    (t < 0 or t > 1 extrapolates linearly); (0, 0.0) on a one-point grid."""
    if len(grid) == 1:
        return 0, 0.0
    i = min(max(bisect.bisect_right(grid, x) - 1, 0), len(grid) - 2)
    return i, (x - grid[i]) / (grid[i + 1] - grid[i])


def interp1(x: float, grid: tuple[float, ...], values: tuple[float, ...]) -> float:
    i, t = segment(x, grid)
    if len(grid) == 1:
        return values[0]
    return values[i] + t * (values[i + 1] - values[i])
