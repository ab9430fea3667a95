"""The event core (moejax.events.EventQueue): time order, ties by order then push order,
the clock, a heap-free reference on random events, and bad input."""

from __future__ import annotations

import math

import numpy as np
import pytest

from moejax.events import EventQueue


def drain(queue):
    """Every event left, in pop order."""
    out = []
    while queue:
        out.append(queue.pop())
    return out


def test_pops_in_time_order():
    queue = EventQueue()
    for time, name in [(3.5, "c"), (0.25, "a"), (2.0, "b"), (10.0, "d")]:
        queue.push(time, 0, name)
    assert len(queue) == 4 and queue
    assert queue.next_time() == 0.25
    assert [payload for _, _, payload in drain(queue)] == ["a", "b", "c", "d"]
    assert len(queue) == 0 and not queue


def test_same_instant_by_order_then_push_order():
    # The μ-queue loop's rule: batch ends (0), deliveries (1), arrivals (2), each FIFO.
    queue = EventQueue()
    queue.push(1.0, 2, "arrival 1")
    queue.push(1.0, 1, "delivery 1")
    queue.push(1.0, 0, "done 1")
    queue.push(1.0, 2, "arrival 2")
    queue.push(1.0, 0, "done 2")
    queue.push(0.5, 2, "earlier arrival")
    queue.push(1.0, 1, "delivery 2")
    assert drain(queue) == [(0.5, 2, "earlier arrival"), (1.0, 0, "done 1"),
                            (1.0, 0, "done 2"), (1.0, 1, "delivery 1"),
                            (1.0, 1, "delivery 2"), (1.0, 2, "arrival 1"),
                            (1.0, 2, "arrival 2")]


def test_tuple_and_negative_orders():
    # The ELDR simulator's rule: arrivals (-1) before boundaries, which go by decoder.
    queue = EventQueue()
    queue.push(4.0, 2, 2)
    queue.push(4.0, 0, 0)
    queue.push(4.0, -1, "request 7")
    queue.push(4.0, -1, "request 8")
    assert [order for _, order, _ in drain(queue)] == [-1, -1, 0, 2]
    queue = EventQueue()
    queue.push(1.0, (1, 3), "boundary 3")
    queue.push(1.0, (0, 9), "arrival 9")
    queue.push(1.0, (1, 0), "boundary 0")
    assert [payload for _, _, payload in drain(queue)] == ["arrival 9", "boundary 0",
                                                            "boundary 3"]


def test_payloads_are_never_compared():
    # dicts do not order: a tie on (time, order) must be broken by push order alone.
    queue = EventQueue()
    first, second = {"id": 1}, {"id": 2}
    queue.push(0.0, 0, first)
    queue.push(0.0, 0, second)
    assert queue.pop()[2] is first and queue.pop()[2] is second


def test_events_pushed_while_draining_join_their_instant():
    # A delivery scheduled at the current instant (zero delay) runs before a later event
    # and before arrivals of the same instant.
    queue = EventQueue()
    queue.push(2.0, 0, "done")
    queue.push(2.0, 2, "arrival")
    queue.push(3.0, 0, "later")
    assert queue.pop() == (2.0, 0, "done")
    assert queue.now == 2.0
    queue.push(2.0, 1, "delivery")
    assert [p for _, _, p in drain(queue)] == ["delivery", "arrival", "later"]
    assert queue.now == 3.0


def test_times_are_returned_as_given():
    queue = EventQueue()
    queue.push(np.float64(1.5), 0, "numpy")
    queue.push(1, 0, "int")
    time, _, _ = queue.pop()
    assert time == 1 and isinstance(time, int)
    time, _, _ = queue.pop()
    assert time == 1.5 and isinstance(time, np.float64)


def test_matches_a_stable_sort_on_random_events():
    rng = np.random.default_rng(7)
    times = rng.integers(0, 20, 500) / 4.0           # many ties
    orders = rng.integers(-1, 4, 500)
    queue = EventQueue()
    for i, (time, order) in enumerate(zip(times.tolist(), orders.tolist())):
        queue.push(time, order, i)
    expected = sorted(range(500), key=lambda i: (times[i], orders[i]))   # stable: push order
    assert [payload for _, _, payload in drain(queue)] == expected


def test_clock_starts_before_every_time():
    queue = EventQueue()
    assert queue.now == -math.inf
    queue.push(-5.0, 0, "negative times are fine before the clock passes them")
    assert queue.pop()[0] == -5.0


@pytest.mark.parametrize("time", [math.nan, np.float64("nan")])
def test_nan_time_is_an_error(time):
    with pytest.raises(ValueError, match=r"event time must be finite, got nan"):
        EventQueue().push(time, 0, "x")


@pytest.mark.parametrize("time", [math.inf, -math.inf])
def test_infinite_time_is_an_error(time):
    with pytest.raises(ValueError, match=r"event time must be finite, got -?inf \(order 1\)"):
        EventQueue().push(time, 1, "x")


@pytest.mark.parametrize("time", ["1.0", None, True, 1 + 2j, [1.0]])
def test_non_number_time_is_an_error(time):
    with pytest.raises(ValueError, match=r"event time must be a real number of seconds"):
        EventQueue().push(time, 0, "x")


def test_scheduling_in_the_past_is_an_error():
    queue = EventQueue()
    queue.push(5.0, 0, "a")
    queue.push(6.0, 0, "b")
    queue.pop()
    with pytest.raises(ValueError, match=r"event time 4.5 \(order 3\) is before the clock, "
                                         r"5.0"):
        queue.push(4.5, 3, "late")
    queue.push(5.0, 3, "now is fine")
    assert [p for _, _, p in drain(queue)] == ["now is fine", "b"]


def test_none_order_is_an_error():
    with pytest.raises(ValueError, match=r"event order must be a comparable key"):
        EventQueue().push(0.0, None, "x")


def test_empty_queue_errors():
    queue = EventQueue()
    with pytest.raises(IndexError, match=r"pop\(\) from an empty EventQueue"):
        queue.pop()
    with pytest.raises(IndexError, match=r"next_time\(\) of an empty EventQueue"):
        queue.next_time()
