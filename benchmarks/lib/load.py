"""Closed-loop clients for the serving benchmarks: threads that send requests back to back."""

from __future__ import annotations

import multiprocessing
import threading
import time
from typing import Any, Callable


def closed_loop(count: int, concurrency: int,
                make_sender: Callable[[], Callable[[int], str | None]]) -> dict:
    """``concurrency`` threads, each with its own sender (``make_sender()``: e.g. a sender
    over its own connection), send requests 0 … ``count``-1 back to back, each taking the
    next index. A sender returns None when its request was answered, else what went wrong.
    -> ``{"wall": seconds, "latencies": [seconds of each answered request], "failures":
    [...]}``."""
    latencies: list[float] = []
    failures: list[str] = []
    lock = threading.Lock()
    next_index = iter(range(count))

    def run() -> None:
        send = make_sender()
        while True:
            with lock:
                index = next(next_index, None)
            if index is None:
                return
            start = time.perf_counter()
            failure = send(index)
            elapsed = time.perf_counter() - start
            with lock:
                if failure is None:
                    latencies.append(elapsed)
                else:
                    failures.append(failure)

    threads = [threading.Thread(target=run) for _ in range(concurrency)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {"wall": time.perf_counter() - start, "latencies": latencies, "failures": failures}


def in_child_process(target: Callable[..., None], *args: Any, timeout: float = 900) -> Any:
    """Run ``target(*args, out)`` in a spawned child process (its clients then do not
    compete for this process's GIL, as real clients would not) and return what it put on
    ``out``."""
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    child = context.Process(target=target, args=(*args, out))
    child.start()
    result = out.get(timeout=timeout)
    child.join(60)
    return result


__all__ = ("closed_loop", "in_child_process")
