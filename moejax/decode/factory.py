"""The decode runner of a backend name: ``make_runner("resident" | "offload" | "sync_ep" |
"async_ep", ...)``. A module of its own so that the runner modules
(``moejax.decode.runners``, and ``moejax.decode.sync_ep``, ``moejax.decode.async_ep`` and
``moejax.prefetch.runner``, which build on its classes) do not import each other in a
circle."""

from __future__ import annotations

from typing import Any

from moejax.backends.base import BackendError
from moejax.config import ModelConfig
from moejax.decode.programs import StepOptions
from moejax.decode.runners import DecodeRunner, OffloadRunner, ResidentRunner
from moejax.param_layout import Params

RUNNERS = {"resident": ResidentRunner, "offload": OffloadRunner}
MESH_RUNNERS = ("sync_ep", "async_ep")     # several devices: data-parallel ranks
DECODE_BACKENDS = (*RUNNERS, *MESH_RUNNERS)


def make_runner(backend: str, cfg: ModelConfig, params: Params, *, dtype: Any,
                opts: StepOptions, devices: int = 1, **options: Any) -> DecodeRunner:
    """The decode runner of ``backend`` (``options``: its own keywords)."""
    if backend == "sync_ep":
        from moejax.decode.sync_ep import SyncEPRunner   # imported when used: mesh code
        return SyncEPRunner(cfg, params, dtype=dtype, opts=opts, devices=devices, **options)
    if backend == "async_ep":
        from moejax.decode.async_ep import AsyncEPRunner   # imported when used: mesh code
        return AsyncEPRunner(cfg, params, dtype=dtype, opts=opts, devices=devices, **options)
    if backend == "offload" and any(k.startswith("prefetch") for k in options):
        from moejax.prefetch.runner import PrefetchRunner   # the offload runner + prefetch
        return PrefetchRunner(cfg, params, dtype=dtype, opts=opts, devices=devices, **options)
    if backend not in RUNNERS:
        raise BackendError(f"backend {backend!r} cannot decode; decode runs on "
                           f"{sorted(DECODE_BACKENDS)}")
    try:
        return RUNNERS[backend](cfg, params, dtype=dtype, opts=opts, devices=devices, **options)
    except TypeError as exc:   # an option this backend does not take
        raise BackendError(f"backend {backend!r}: {exc}") from None
