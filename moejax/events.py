"""The event core of moejax's discrete-event simulations: one time-ordered queue.

Why one: the ELDR decoder simulator (:mod:`moejax.eldr.simulator`) and the μ-queue loop
(:mod:`moejax.asyncmoe.loop`, the AsyncMoE simulator's and runtime's) both replay events
in virtual time, and each needs the same two guarantees to be deterministic: events run
in time order, and events at one instant run in an order the caller decides, not one
that depends on the heap's layout. :class:`EventQueue` gives both, so each simulator
keeps only its own events and tie rule.

Order at one instant: by ``order`` (any key the events of one queue can compare among
themselves: an int rank per kind of event, or a tuple such as ``(1, decoder_index)``),
then by push order (first pushed, first popped). Payloads are never compared.
"""

from __future__ import annotations

import heapq
import itertools
import math
import numbers
from typing import Any, Generic, TypeVar

Payload = TypeVar("Payload")


class EventQueue(Generic[Payload]):
    """A priority queue of ``(time, order, payload)`` events: :meth:`pop` returns the
    earliest, ties by ``order`` then by push order (module docstring).

    A pushed time must be a real number, not NaN or infinite (an event that can never
    run, or breaks the heap's ordering, is a bug in its caller), and not earlier than the
    last popped event's (the simulation's clock never runs backwards)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, Any, int, Payload]] = []
        self._sequence = itertools.count()
        self._now: float = -math.inf

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    @property
    def now(self) -> float:
        """The time of the last popped event (-inf before the first pop): the clock."""
        return self._now

    def push(self, time: float, order: Any, payload: Payload) -> None:
        """Schedule ``payload`` at ``time``, ranked by ``order`` among the events of the
        same instant. The time is stored as given (an int stays an int), so a caller's
        arithmetic on popped times is what it would be without the queue."""
        if isinstance(time, bool) or not isinstance(time, numbers.Real):
            raise ValueError(f"event time must be a real number of seconds, got {time!r}")
        if not math.isfinite(time):
            raise ValueError(f"event time must be finite, got {time} (order {order!r})")
        if time < self._now:
            raise ValueError(f"event time {time} (order {order!r}) is before the clock, "
                             f"{self._now}: an event cannot be scheduled in the past")
        if order is None:
            raise ValueError("event order must be a comparable key (an int or a tuple), "
                             "got None")
        heapq.heappush(self._heap, (time, order, next(self._sequence), payload))

    def next_time(self) -> float:
        """The time of the next event (IndexError if none is left)."""
        if not self._heap:
            raise IndexError("next_time() of an empty EventQueue")
        return self._heap[0][0]

    def pop(self) -> tuple[float, Any, Payload]:
        """The next event as ``(time, order, payload)``, removed; it sets :attr:`now`
        (IndexError if none is left)."""
        if not self._heap:
            raise IndexError("pop() from an empty EventQueue")
        time, order, _, payload = heapq.heappop(self._heap)
        self._now = time
        return time, order, payload
