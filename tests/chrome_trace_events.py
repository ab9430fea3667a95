"""Chrome-trace events for synthetic profiler traces in the tests of the trace parsing."""

from __future__ import annotations


def meta(pid: int, name: str, tid: int | None = None) -> dict:
    """A process's name (``tid`` None) or a thread's name, as a profiler writes it."""
    if tid is None:
        return {"ph": "M", "pid": pid, "name": "process_name", "args": {"name": name}}
    return {"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": name}}


def op(pid: int, tid: int, name: str, ts: float, dur: float) -> dict:
    """A complete event ``name`` on thread ``tid`` of ``pid``, from ``ts`` for ``dur`` µs."""
    return {"ph": "X", "pid": pid, "tid": tid, "name": name, "ts": ts, "dur": dur}
