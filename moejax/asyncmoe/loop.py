"""The μ-queue event loop: G :class:`~moejax.asyncmoe.engine.DeviceEngine` s driven in
(virtual) time, shared by the simulator and the real runtime.

The loop owns the clock and the order of events; an :class:`Executor` owns the
arithmetic. The simulator's executor only replays routing (no payloads); the runtime's
(``moejax.asyncmoe.runtime``) runs the model's layers on the devices. Both see the same
batches in the same order for the same routing and costs, because this one loop decides
them.

Events (batch done, records delivered, request arrived) run in time order (one
:class:`moejax.events.EventQueue`, ranked by ``EVENT_*``); at one instant, batch ends
first, then deliveries, then arrivals, each in the order they were scheduled; then
every idle device with queued tokens starts ``engine.next_batch()`` (lowest device
first). A batch takes ``duration(batch)`` seconds. Its outputs
(``engine.route``) are sent per destination device as one transfer taking
``link(bytes)`` (free on the same device) and handed to that engine's ``deliver``; each
token it merges becomes ``merged.next_record(executor.merge(...))`` (the next block's
attention, or the head); a head batch completes its tokens' step, and a request that
continues enqueues step s + 1 at block 0. Devices compute one batch at a time;
transfers overlap compute. A request arrives with its prompt in the KV cache
(``executor.start`` does the prefill where there is one) and is bound for life to the
attention rank with the fewest active requests (ties: the lowest rank). The attention
ranks are the engines that host attention (all of them in the colocated layout; with
attention disaggregated from experts, ``moejax.asyncmoe.placement``, only those).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, Protocol

import numpy as np

from moejax.asyncmoe.engine import Batch, DeviceEngine, Merged
from moejax.asyncmoe.records import (ATTENTION, ATTENTION_UNIT, EXPERT, HEAD, HEAD_UNIT,
                                     TokenRecord, attention_record)
from moejax.events import EventQueue

MU_QUEUE = "mu_queue"
SYNC_EP = "sync_ep"

# Same-instant event order (lower first).
EVENT_DONE = 0
EVENT_DELIVERY = 1
EVENT_ARRIVAL = 2

ITL_P50 = 50.0
ITL_P99 = 99.0


def assign_rank(active: Sequence[int]) -> int:
    """The attention rank for a new request: fewest active requests, ties lowest rank."""
    return int(np.argmin(np.asarray(active)))


class LoopRequest(NamedTuple):
    """What the loop needs of a request: its id, arrival and prompt length (the KV
    context its first decode step extends)."""

    request_id: int
    arrival_s: float
    prompt_length: int


class Executor(Protocol):
    """The arithmetic of a μ-queue run (module docstring)."""

    def start(self, request: Any, rank: int) -> tuple[bool, Any]:
        """Before step 0 (prefill, if any): (whether a decode step follows, the payload
        of step 0's block-0 attention input)."""

    def attention(self, device: int, batch: Batch) -> tuple[Any, Any, Sequence[Any] | None]:
        """An attention batch: (top-k ids [n, k], gate weights [n, k], per token the
        payload its expert copies carry, or None)."""

    def expert(self, device: int, batch: Batch) -> Sequence[Any] | None:
        """An expert batch: per record its output payload (or None)."""

    def merge(self, device: int, merged: Merged) -> Any:
        """The next input's payload from a token's k expert outputs (the rank's side)."""

    def head(self, device: int, batch: Batch) -> Sequence[tuple[bool, Any]]:
        """A head batch: per record (whether its request decodes another step, the payload
        of that step's block-0 attention input)."""


class ExecutedBatch(NamedTuple):
    """One execution: start ``time``, ``device``, block ``layer``, ``unit`` (-1
    attention, -2 head, else expert id), ``size`` in tokens, and its ``end``."""

    time: float
    device: int
    layer: int
    unit: int
    size: int
    end: float


class RequestTiming(NamedTuple):
    """A request's rank, arrival and the completion time of each decode token."""

    request_id: int
    rank: int
    arrival_s: float
    token_times: tuple[float, ...]

    @property
    def finish_s(self) -> float:
        """The last decode token's completion (the arrival for a request that ended at
        prefill and never decoded)."""
        return self.token_times[-1] if self.token_times else self.arrival_s


@dataclasses.dataclass(frozen=True)
class SimResult:
    """What a simulation measured (``mode``: "mu_queue" or "sync_ep").

    ``requests``: per request its timings (arrival order). ``batches``: every execution
    in start order (ties by device). ``queue_depth``: (time, tokens waiting) samples —
    μ-queue: tokens in all μ-queues after each instant's events; EP: requests arrived but
    not yet admitted, at each step boundary. ``stall_fraction``: module docstring.
    ``leftover_queued`` / ``leftover_pooled``: tokens still in μ-queues / token pools at
    the end (0 for a correct run; EP has none)."""

    mode: str
    requests: tuple[RequestTiming, ...]
    batches: tuple[ExecutedBatch, ...]
    queue_depth: tuple[tuple[float, int], ...]
    stall_fraction: float
    leftover_queued: int
    leftover_pooled: int

    @property
    def tokens_generated(self) -> int:
        return sum(len(r.token_times) for r in self.requests)

    @property
    def makespan_s(self) -> float:
        """Last token completion − first arrival."""
        return max(r.finish_s for r in self.requests) - min(r.arrival_s for r in self.requests)

    @property
    def throughput_tokens_per_s(self) -> float:
        return self.tokens_generated / self.makespan_s if self.makespan_s > 0 else 0.0

    @property
    def itl_s(self) -> tuple[float, ...]:
        """Every gap between consecutive token completions of a request, all requests."""
        return tuple(float(gap) for r in self.requests for gap in np.diff(r.token_times))

    def itl_percentile(self, q: float) -> float:
        """The q-th percentile of :attr:`itl_s` (nan when no request has two tokens)."""
        itl = self.itl_s
        return float(np.percentile(itl, q)) if itl else math.nan

    @property
    def itl_p50_s(self) -> float:
        return self.itl_percentile(ITL_P50)

    @property
    def itl_p99_s(self) -> float:
        return self.itl_percentile(ITL_P99)

    def mean_batch_size(self, kind: str) -> float:
        """Mean tokens per execution of ``kind`` ("attention", "expert", "head")."""
        units = {ATTENTION: lambda u: u == ATTENTION_UNIT, HEAD: lambda u: u == HEAD_UNIT,
                 EXPERT: lambda u: u >= 0}
        if kind not in units:
            raise ValueError(f"kind must be one of {sorted(units)}, got {kind!r}")
        sizes = [b.size for b in self.batches if units[kind](b.unit)]
        return float(np.mean(sizes)) if sizes else 0.0

    @property
    def mean_expert_batch(self) -> float:
        return self.mean_batch_size(EXPERT)

    @property
    def mean_attention_batch(self) -> float:
        return self.mean_batch_size(ATTENTION)

    @property
    def arrival_times(self) -> np.ndarray:
        """Arrival time per request (the order of :attr:`requests`)."""
        return np.array([r.arrival_s for r in self.requests])

    @property
    def completion_times(self) -> np.ndarray:
        """Finish time (last token) per request (the order of :attr:`requests`)."""
        return np.array([r.finish_s for r in self.requests])

    def batch_sequence(self, device: int) -> list[tuple[int, int, int]]:
        """(layer, unit, size) of ``device``'s executions in order."""
        return [(b.layer, b.unit, b.size) for b in self.batches if b.device == device]


class RequestProgress:
    """A request's mutable progress in a run (``spec``: anything with ``request_id`` and
    ``arrival_s``)."""

    def __init__(self, spec: Any, rank: int) -> None:
        self.spec = spec
        self.rank = rank
        self.token_times: list[float] = []

    def timing(self) -> RequestTiming:
        return RequestTiming(self.spec.request_id, self.rank, self.spec.arrival_s,
                             tuple(self.token_times))


class MuQueueLoop:
    """One μ-queue run over ``engines`` (module docstring): ``duration(batch)`` seconds per
    execution, ``link(bytes)`` per transfer between devices, ``bytes_per_token`` per
    record sent."""

    def __init__(self, engines: Sequence[DeviceEngine], executor: Executor,
                 duration: Callable[[Batch], float], link: Callable[[float], float],
                 bytes_per_token: int) -> None:
        self.engines = list(engines)
        self.ranks = [d for d, engine in enumerate(self.engines) if engine.hosts_attention]
        if not self.ranks:
            raise ValueError("MuQueueLoop: no engine hosts attention; requests need an "
                             "attention rank")
        self.executor = executor
        self.duration, self.link = duration, link
        self.bytes_per_token = bytes_per_token
        self.progress: dict[int, RequestProgress] = {}
        self.active = [0] * len(self.engines)
        self.busy = [False] * len(self.engines)
        # Ordered by time, then EVENT_* (lower first), then push order (module docstring).
        self.events: EventQueue[Any] = EventQueue()
        self.batches: list[ExecutedBatch] = []
        self.depth: list[tuple[float, int]] = []
        self.stall_s = 0.0
        self.active_s = 0.0

    def push(self, time: float, order: int, payload: Any) -> None:
        """Schedule an event of kind ``order`` (EVENT_*) at ``time``."""
        self.events.push(time, order, payload)

    def run(self, requests: Sequence[Any]) -> SimResult:
        """Every request (``request_id``, ``arrival_s``, ``prompt_length``) to the end."""
        for request in requests:
            self.push(request.arrival_s, EVENT_ARRIVAL, request)
        last = 0.0
        while self.events:
            now = self.events.next_time()
            if sum(self.active):
                self.active_s += now - last
                self.stall_s += (now - last) * self.busy.count(False)
            last = now
            while self.events and self.events.next_time() == now:
                _, order, payload = self.events.pop()
                if order == EVENT_DONE:
                    self.finish_batch(now, *payload)
                elif order == EVENT_DELIVERY:
                    self.deliver(*payload)
                else:
                    self.arrive(now, payload)
            self.start_idle_devices(now)
            self.depth.append((now, sum(e.queued() for e in self.engines)))
        total = len(self.engines) * self.active_s
        return SimResult(MU_QUEUE, tuple(self.progress[r.request_id].timing()
                                         for r in requests),
                         tuple(self.batches), tuple(self.depth),
                         self.stall_s / total if total > 0 else 0.0,
                         sum(e.queued() for e in self.engines),
                         sum(e.pool.pending() for e in self.engines))

    def arrive(self, now: float, request: Any) -> None:
        rank = self.ranks[assign_rank([self.active[d] for d in self.ranks])]
        self.progress[request.request_id] = RequestProgress(request, rank)
        decodes, payload = self.executor.start(request, rank)
        if not decodes:                  # done at prefill: no decode step
            return
        self.active[rank] += 1
        self.engines[rank].enqueue(attention_record(request.request_id, 0, 0, rank,
                                                    request.prompt_length + 1, payload))

    def start_idle_devices(self, now: float) -> None:
        for device, engine in enumerate(self.engines):
            if self.busy[device]:
                continue
            batch = engine.next_batch()
            if batch is None:
                continue
            end = now + self.duration(batch)
            self.busy[device] = True
            self.batches.append(ExecutedBatch(now, device, batch.layer, batch.unit,
                                              batch.size, end))
            self.push(end, EVENT_DONE, (device, batch))

    def finish_batch(self, now: float, device: int, batch: Batch) -> None:
        self.busy[device] = False
        engine = self.engines[device]
        if batch.kind == HEAD:
            self.finish_step(now, engine, batch, self.executor.head(device, batch))
            return
        if batch.kind == ATTENTION:
            ids, weights, outputs = self.executor.attention(device, batch)
            routed = engine.route(batch, np.asarray(ids), np.asarray(weights), outputs)
        else:
            routed = engine.route(batch, outputs=self.executor.expert(device, batch))
        by_destination: dict[int, list[TokenRecord]] = {}
        for destination, record in routed:
            by_destination.setdefault(destination, []).append(record)
        for destination in sorted(by_destination):
            records = by_destination[destination]
            delay = 0.0 if destination == device else self.link(
                len(records) * self.bytes_per_token)
            self.push(now + delay, EVENT_DELIVERY, (destination, records, batch.kind))

    def deliver(self, destination: int, records: list[TokenRecord], source_kind: str) -> None:
        engine = self.engines[destination]
        for merged in engine.deliver(records, source_kind):
            engine.enqueue(merged.next_record(self.executor.merge(destination, merged)))

    def finish_step(self, now: float, engine: DeviceEngine, batch: Batch,
                    outcomes: Sequence[tuple[bool, Any]]) -> None:
        if len(outcomes) != batch.size:
            raise RuntimeError(f"the executor gave {len(outcomes)} head outcomes for a batch "
                               f"of {batch.size}")
        for record, (continues, payload) in zip(batch.records, outcomes):
            request = self.progress[record.request_id]
            if record.step != len(request.token_times):
                raise RuntimeError(f"{record.describe()} finished out of order: request has "
                                   f"{len(request.token_times)} tokens")
            request.token_times.append(now)
            if continues:
                engine.enqueue(attention_record(record.request_id, record.step + 1, 0,
                                                record.rank, record.context + 1, payload))
            else:
                self.active[request.rank] -= 1
