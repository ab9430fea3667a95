"""``moejax serve`` over several processes: process 0 serves, the others follow.

Requests reach process 0 only, but every process must run every step of the model (its
devices hold part of the mesh). So process 0's Scorer is wrapped in a
:class:`LeaderScorer`, whose ``run_ops`` first sends the ops to every process
(``moejax.distributed.agree``, a broadcast over the devices' collectives), and the other
processes run :func:`follow`: receive ops, run them, repeat, until process 0 says stop.
The host side of a run (packing, routing) is deterministic, so every process runs the
same steps in the same order.

One thread of process 0 owns every collective (:class:`LeaderScorer`'s), because
collectives must be issued in the same order everywhere. When there is nothing to run
it sends an idle tick every ``tick_seconds``, so that no follower waits in one
collective long enough for the collectives' own timeouts to give up on it.

A collective that fails between processes (a peer process lost, its connection closed:
:func:`is_collective_failure`) is no request's fault and leaves this process unable to go
on: :func:`serving.results.combine_results` raises :class:`CollectiveFailure` instead of
giving each request of the batch an error result, and the commands end at once
(``serving.cli``), so that no request is answered with a failure it did not cause.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import re
import threading
from typing import Any, Hashable, Sequence

from moejax.distributed import agree

log = logging.getLogger("moejax.multi_process")

# What XLA says when a collective between processes fails: gloo on CPU, NCCL on GPU, and
# the transport under them. Matched in the message of an XLA runtime error only.
_COLLECTIVE_FAILURE = re.compile(
    r"Gloo [\w -]+ failed|NCCL (?:operation|error)|nccl\w*\(.*\) failed|ncclRemoteError|"
    r"ncclSystemError|Connection closed by peer|coordination service", re.IGNORECASE)
_XLA_RUNTIME_ERRORS = ("JaxRuntimeError", "XlaRuntimeError")


class CollectiveFailure(RuntimeError):
    """A collective between the processes of a multi-process run failed (a process was
    lost, or the transport between them broke): no request's fault, and fatal to this
    process. ``__cause__`` is XLA's error."""


def is_collective_failure(error: BaseException) -> bool:
    """Whether ``error`` is a failed collective between processes (XLA's runtime error
    naming gloo, NCCL or a closed peer connection) rather than one batch's own failure."""
    if isinstance(error, CollectiveFailure):
        return True
    if not any(cls.__name__ in _XLA_RUNTIME_ERRORS for cls in type(error).__mro__):
        return False
    return _COLLECTIVE_FAILURE.search(str(error)) is not None


def collective_failure(error: BaseException) -> CollectiveFailure:
    """The :class:`CollectiveFailure` for XLA's ``error`` (its first line: the rest is a
    long list of peers and ranks)."""
    detail = next(iter(str(error).splitlines()), "")
    return CollectiveFailure(f"a collective between the processes failed, so a process of "
                             f"the multi-process run was lost or cannot be reached "
                             f"({type(error).__name__}: {detail})")

DEFAULT_TICK_SECONDS = 5.0
_RUN, _IDLE, _STOP = "run", "idle", "stop"


class LeaderScorer:
    """Process 0's Scorer: the same interface, and every ``run_ops`` also runs on every
    other process. Other attributes are the wrapped Scorer's."""

    def __init__(self, scorer: Any, tick_seconds: float = DEFAULT_TICK_SECONDS):
        if tick_seconds <= 0:
            raise ValueError(f"tick_seconds must be > 0, got {tick_seconds}")
        self._scorer = scorer
        self._tick_seconds = tick_seconds
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._stopped = False
        self._thread = threading.Thread(target=self._lead, name="moejax-leader", daemon=True)
        self._thread.start()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._scorer, name)

    def run_ops(self, ops: Sequence[Any], on_batch_done: Any = None
                ) -> tuple[dict[Hashable, Any], dict[Hashable, Any]]:
        """As :meth:`serving.Scorer.run_ops`, run on every process (the results are
        process 0's)."""
        if self._stopped:
            raise RuntimeError("the multi-process scorer is stopped")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._work.put((list(ops), on_batch_done, future))
        return future.result()

    def stop(self) -> None:
        """Tell the followers to return; later ``run_ops`` calls raise."""
        if self._stopped:
            return
        self._stopped = True
        self._work.put(None)
        self._thread.join()

    def _lead(self) -> None:
        while True:
            try:
                work = self._work.get(timeout=self._tick_seconds)
            except queue.Empty:
                agree((_IDLE, None))
                continue
            if work is None:
                agree((_STOP, None))
                return
            ops, on_batch_done, future = work
            try:
                agree((_RUN, ops))
                future.set_result(self._scorer.run_ops(ops, on_batch_done))
            except BaseException as exc:   # noqa: BLE001  (delivered to the caller)
                future.set_exception(exc)


def follow(scorer: Any) -> int:
    """Run what process 0 sends until it says stop; returns the number of runs."""
    runs = 0
    while True:
        kind, ops = agree(None)
        if kind == _STOP:
            log.info("process 0 stopped serving after %d runs", runs)
            return runs
        if kind == _RUN:
            scorer.run_ops(ops)
            runs += 1
