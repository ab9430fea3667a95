"""Counting XLA backend compiles in a test, through JAX's monitoring events."""

from __future__ import annotations

import contextlib
from typing import Iterator

import jax.monitoring

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"


@contextlib.contextmanager
def backend_compiles() -> Iterator[list[float]]:
    """The seconds of each backend compile while the block runs (any thread): a test
    asserts the list is empty where nothing may compile."""
    compiles: list[float] = []

    def listener(event: str, seconds: float, **_kwargs: object) -> None:
        if event == BACKEND_COMPILE:
            compiles.append(seconds)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield compiles
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
