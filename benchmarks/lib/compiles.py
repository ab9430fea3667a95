"""XLA compiles counted in every timed pass: a pass that compiled is not a measurement.

JAX reports each backend compile as a ``jax.monitoring`` duration event,
:data:`COMPILE_EVENT` (in JAX 0.10 once per program handed to XLA, including a program
loaded from a persistent compilation cache, which costs a load instead of a compile but
is no steady-state figure either). One process-wide listener counts them; :func:`counting`
reads the count around a block, and :func:`timed_pass` is the block every timed pass of
the benchmarks runs in: it records the pass's compiles in this run's tally (written
into the JSON by :func:`benchmarks.lib.meta.finish_run`) and prints a warning line when
the pass compiled.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import sys
import threading
from typing import Iterator

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
COMPILE_STAGES = "/jax/core/compile/"     # tracing, lowering and compiling durations

_lock = threading.Lock()
_compiles = 0                 # since the listener was installed, every thread
_compile_seconds = 0.0        # tracing + lowering + compiling, likewise
_listening = False
# This run's timed passes: label -> compiles summed over its passes, and passes counted.
_tally: dict[str, int] = collections.Counter()
_passes: dict[str, int] = collections.Counter()


def _on_duration(event: str, seconds: float, **_kwargs: object) -> None:
    global _compiles, _compile_seconds
    if event.startswith(COMPILE_STAGES):
        with _lock:
            _compiles += event == COMPILE_EVENT
            _compile_seconds += seconds


def _install() -> None:
    """Register the listener once (JAX offers no way to remove one)."""
    global _listening
    with _lock:
        if _listening:
            return
        _listening = True
    from jax import monitoring

    monitoring.register_event_duration_secs_listener(_on_duration)


def compiles_so_far() -> tuple[int, float]:
    """(backend compiles, seconds spent tracing, lowering and compiling) seen in this
    process since counting started. (A benchmark that never imports JAX cannot compile:
    it is not made to import JAX here.)"""
    if "jax" in sys.modules:
        _install()
    with _lock:
        return _compiles, _compile_seconds


@dataclasses.dataclass
class CompileCount:
    """Compiles seen inside one :func:`counting` block, and the seconds they took (final
    when the block ends)."""

    count: int = 0
    seconds: float = 0.0


@contextlib.contextmanager
def counting() -> Iterator[CompileCount]:
    """Count the backend compiles (any thread) while the block runs."""
    result = CompileCount()
    count, seconds = compiles_so_far()
    try:
        yield result
    finally:
        count_after, seconds_after = compiles_so_far()
        result.count, result.seconds = count_after - count, seconds_after - seconds


@contextlib.contextmanager
def timed_pass(label: str) -> Iterator[CompileCount]:
    """The block of one timed pass (or one group of timed repeats) named ``label``: its
    compiles are added to this run's tally, and a pass that compiled is flagged."""
    with counting() as result:
        yield result
    with _lock:
        _tally[label] += result.count
        _passes[label] += 1
    if result.count:
        print(f"WARNING: timed pass {label!r} compiled {result.count} program(s): its time "
              f"includes compiling and is not a steady-state measurement", flush=True)


def start_run() -> None:
    """Forget the timed passes of an earlier run in this process (a test calling several
    benchmarks' ``main``)."""
    with _lock:
        _tally.clear()
        _passes.clear()


def run_figures() -> dict[str, int]:
    """This run's compile figures, flat keys for its JSON: ``compiles_in_timed_passes``
    (total), ``timed_passes`` (how many blocks were counted) and, for each pass label that
    compiled, ``compiles_in_timed_pass_<label>``."""
    with _lock:
        out = {"compiles_in_timed_passes": int(sum(_tally.values())),
               "timed_passes": int(sum(_passes.values()))}
        out.update({f"compiles_in_timed_pass_{label}": int(count)
                    for label, count in _tally.items() if count})
    return out
