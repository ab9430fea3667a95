"""Tuned-tile tables keyed by device and shape, and the lookup they share.

A key is ``(device, dtype)`` or ``(device, dtype, (d, f, E))``. ``device`` is a
device-kind prefix as JAX reports it (``"NVIDIA H100"`` matches ``"NVIDIA H100 80GB
HBM3"``) or a platform (``"gpu"``, ``"cpu"``). :func:`lookup` takes the most
specific entry: a shape entry before a dtype entry, the longest matching device
kind before the platform. A device kind that matches no entry of its own is looked up
as its stand-in (:data:`STAND_INS`) before it falls back to the platform. Entries
come from measurements (``benchmarks/gmm.py --sweep-tiles``); each table says where its
figures are recorded.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

import jax
import jax.numpy as jnp

Value = TypeVar("Value")
Shape = tuple[int, int, int]          # (d, f, E) of the grouped GEMM
PLATFORMS = ("gpu", "cpu")

# A device kind with no entries of its own uses its stand-in's, explicitly, before the
# platform's. The H200 is the H100's chip with more and faster memory: the same 132 SMs,
# the same 227 KiB of shared memory per block and the same matrix rates, so the tiles
# swept on the H100 are the best known for it until a sweep on an H200 adds its own.
STAND_INS: dict[str, str] = {"NVIDIA H200": "NVIDIA H100"}


def entries(devices: tuple[str, ...], dtypes: tuple[str, ...], value: Value
            ) -> dict[tuple, Value]:
    """One table entry of ``value`` for every (device, dtype) pair."""
    return {(device, dtype): value for device in devices for dtype in dtypes}


def platform_of(backend: str | None = None) -> str:
    """``gpu`` for CUDA/ROCm backends, else ``cpu`` (the key the tables use)."""
    backend = backend or jax.default_backend()
    return "gpu" if backend in ("gpu", "cuda", "rocm") else "cpu"


def current_device_kind() -> str:
    """The device kind of JAX's first device (``"cpu"`` on CPU)."""
    return jax.devices()[0].device_kind


def stand_in(device_kind: str) -> str | None:
    """The device kind whose entries ``device_kind`` falls back to (:data:`STAND_INS`)."""
    for prefix, other in STAND_INS.items():
        if device_kind.startswith(prefix):
            return other
    return None


def _device_rank(device: str, device_kind: str, platform: str) -> int | None:
    """How well a key's device matches: a device-kind prefix ranks above the platform
    by its length; None when it does not match."""
    if device in PLATFORMS:
        return 0 if device == platform else None
    return len(device) if device_kind.startswith(device) else None


def _best(table: Mapping[tuple, Value], dtype_name: str, device_kind: str, platform: str,
          shape: Shape | None) -> tuple[Value | None, tuple[bool, int] | None]:
    """The most specific entry and its rank (has a shape, device match length)."""
    best, best_rank = None, None
    for key, value in table.items():
        device, key_dtype, *key_shape = key
        if key_dtype != dtype_name or (key_shape and tuple(key_shape[0]) != shape):
            continue
        rank = _device_rank(device, device_kind, platform)
        if rank is None:
            continue
        rank = (bool(key_shape), rank)       # a shape entry wins over any device match
        if best_rank is None or rank > best_rank:
            best, best_rank = value, rank
    return best, best_rank


def lookup(table: Mapping[tuple, Value], dtype, *, device_kind: str | None = None,
           platform: str | None = None, shape: Shape | None = None) -> Value | None:
    """The most specific entry of ``table`` for this device, dtype and shape, or None; a
    device kind none of whose entries match is looked up as its stand-in first."""
    platform = platform or platform_of()
    device_kind = device_kind if device_kind is not None else (
        current_device_kind() if platform == platform_of() else "")
    dtype_name = jnp.dtype(dtype).name
    best, rank = _best(table, dtype_name, device_kind, platform, shape)
    other = stand_in(device_kind)
    if other is not None and (rank is None or rank[1] == 0):
        standing_in, other_rank = _best(table, dtype_name, other, platform, shape)
        if other_rank is not None and other_rank[1] > 0:
            return standing_in
    return best
