"""The server's work queue: admission by cost, batching by cost, and the one thread that
runs the model.

A :class:`~serving.Scorer` runs one model call at a time, so one worker thread owns its
:meth:`~serving.Scorer.run_ops`. RPC handlers prepare requests (validation, tokenization,
expansion into prefill ops: :meth:`~serving.Scorer.prepare`, on other threads) and
:meth:`Batcher.submit` them as :class:`WorkItem` s; the worker forms a batch of queued
ops up to ``batch_tokens`` and runs them in one call, so concurrent callers share batches.

**Cost.** An item's cost is what computing its ops costs, in *token-equivalents*
(FLOPs over one token's linear FLOPs; :attr:`serving.api.PreparedRequest.cost`): a
prompt shared by 200 candidates counts once, 200 candidates recomputing it count 200
times. Admission bounds the cost of every item admitted and not yet answered
(``max_queued_tokens``). Unary callers over the bound are refused at once
(``try_acquire``: RESOURCE_EXHAUSTED with a retry hint), large ones (costing more than
``batch_tokens / SMALL_SHARE``) already past ``LARGE_SHARE`` of it, so a burst of large
requests leaves room for small ones; streams wait for room (``acquire``), only while the
queue holds less than half the bound, so bulk streams cannot starve online callers. An
item costing more than the whole bound is refused outright.

**Batching by cost, never behind a long request.** Each model call takes the *oldest*
queued item first — whole, or a chunk of its ops when it is larger than a batch — so every
item progresses however much cheaper work keeps arriving; then it fills up with the
*cheapest* queued items (by power-of-two cost class, then age) while they fit in
``batch_tokens``. A split item's rest goes to the back of the queue, behind items that
arrived meanwhile, and each chunk computes the request's prompt once (``share_prompts``).
So a small request waits for the call running when it arrives and is in the next one,
however much large work is queued ahead of it.

Deadlines: an item whose call has expired, or was cancelled, by the time the worker
reaches it is dropped, not computed (counted in ``stats``).
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import logging
import random
import threading
import time
from typing import Any, Callable, Hashable, Sequence

from moejax.ops import OpKey, PrefillOp
from serving.requests import ScoreResult, request_id_of, request_kind

log = logging.getLogger("moejax.grpc")


class Expired:
    """Outcome of an item whose deadline passed before the worker reached it."""


class Cancelled:
    """Outcome of an item whose call was cancelled (or the server stopped) before it ran."""


@dataclasses.dataclass
class Failed:
    """Outcome of an item whose ops raised in the model (the backend has recovered)."""

    error: BaseException


Outcome = ScoreResult | Expired | Cancelled | Failed


@dataclasses.dataclass(eq=False)
class WorkItem:
    """One prepared request in the queue.

    ``prepared``: a :class:`serving.api.PreparedRequest` (its ``index`` names the request
    in messages); ``deadline`` is a ``time.monotonic()`` time or None; ``cancelled`` tells
    whether the caller has gone; ``deliver(item, outcome)`` is called exactly once;
    ``endpoint`` names the call it came in by (metrics)."""

    prepared: Any
    deliver: Callable[["WorkItem", Outcome], None]
    deadline: float | None = None
    cancelled: Callable[[], bool] = lambda: False
    enqueued: float = dataclasses.field(default_factory=time.monotonic)
    queue_seconds: float | None = None
    pending: list[PrefillOp] = dataclasses.field(default_factory=list)
    outputs: dict[Hashable, Any] = dataclasses.field(default_factory=dict)
    timings: dict[Hashable, Any] = dataclasses.field(default_factory=dict)
    chunks: int = 0
    delivered: bool = False
    seq: int = 0         # arrival order in the queue (renewed when a split rest re-enters)
    queued: bool = False
    future: Any = None   # what the caller awaits, when it awaits one
    endpoint: str = ""

    def __post_init__(self) -> None:
        self.pending = list(self.prepared.ops)

    @property
    def index(self) -> int:
        return self.prepared.index

    @property
    def cost(self) -> int:
        return self.prepared.cost

    @property
    def request(self) -> Any:
        return self.prepared.request


def outcome_status(outcome: Outcome) -> str:
    """The metrics status of an item's outcome (``serving.metrics``)."""
    if isinstance(outcome, ScoreResult):
        return "ok" if outcome.error is None else "error"
    return {Expired: "expired", Cancelled: "cancelled", Failed: "failed"}[type(outcome)]


class Admission:
    """A bound on queued cost (token-equivalents); ``peak`` is the most ever admitted."""

    def __init__(self, bound: int):
        if bound <= 0:
            raise ValueError(f"max_queued_tokens must be positive, got {bound}")
        self.bound = int(bound)
        self.queued = 0
        self.peak = 0
        self.rejected = 0
        self._cond = threading.Condition()

    @property
    def full(self) -> bool:
        """Is the queue at its bound (nothing more would be admitted)?"""
        return self.queued >= self.bound

    def _take(self, tokens: int, limit: int) -> bool:
        """Admit when the queue stays within ``limit`` (<= bound), or when it is empty (an
        item costs at most the bound, so the bound still holds)."""
        if self.queued > 0 and self.queued + tokens > limit:
            return False
        self.queued += tokens
        self.peak = max(self.peak, self.queued)
        return True

    def try_acquire(self, tokens: int, share: float = 1.0) -> bool:
        """Admit ``tokens`` now if the queue stays within ``share`` of the bound, or refuse
        (counted in ``rejected``)."""
        with self._cond:
            if tokens <= self.bound and self._take(tokens, max(1, int(self.bound * share))):
                return True
            self.rejected += 1
            return False

    def acquire(self, tokens: int, give_up: Callable[[], bool], *, share: float = 1.0,
                poll: float = 0.05) -> bool:
        """Wait until ``tokens`` fit in ``share`` of the bound; False when ``give_up()``
        turns true first."""
        limit = max(1, int(self.bound * share))
        with self._cond:
            while not self._take(tokens, limit):
                if give_up():
                    return False
                self._cond.wait(poll)
            return True

    def would_fit(self, tokens: int, share: float = 1.0) -> bool:
        """Would ``tokens`` be admitted now (within ``share`` of the bound)? Nothing taken."""
        with self._cond:
            return self.queued == 0 or self.queued + tokens <= int(self.bound * share)

    def try_acquire_share(self, tokens: int, share: float) -> bool:
        """Admit ``tokens`` if they fit in ``share`` of the bound (no waiting, not counted
        as a refusal: a stream polls this)."""
        with self._cond:
            return self._take(tokens, max(1, int(self.bound * share)))

    def release(self, tokens: int) -> None:
        with self._cond:
            self.queued -= tokens
            self._cond.notify_all()


SMALL_SHARE = 8      # an item costing at most batch_tokens / SMALL_SHARE is small
LARGE_SHARE = 0.75   # large items are admitted up to this share of the queue's bound
RATE_BEFORE_FIRST_BATCH = 10_000  # token-equivalents per second assumed for retry hints


@dataclasses.dataclass
class _Chunk:
    """Ops of one item in one batch, and what they cost (token-equivalents)."""

    item: WorkItem
    ops: list[PrefillOp]
    cost: int = 0


class Batcher:
    """Owns the Scorer's model calls: one worker thread runs batches of queued ops.

    ``batch_tokens``: token-equivalents of ops per model call (an item is split when it is
    larger); ``max_batch_requests`` caps the items of one call.
    """

    def __init__(self, scorer: Any, *, max_queued_tokens: int, batch_tokens: int,
                 max_batch_requests: int = 4096, metrics: Any = None):
        self.scorer = scorer
        self.metrics = metrics    # a serving.metrics.ServingMetrics, or None
        self.admission = Admission(max_queued_tokens)
        self.batch_tokens = max(1, int(batch_tokens))
        self.max_batch_requests = max(1, int(max_batch_requests))
        # The queue, ordered twice (lazy deletion: an entry is live while its item is queued
        # under that seq): by arrival, for the oldest; by cost class, cheapest first.
        self.small_cost = max(1, self.batch_tokens // SMALL_SHARE)
        self._by_age: collections.deque[tuple[int, WorkItem]] = collections.deque()
        self._by_cost: list[tuple[int, int, WorkItem]] = []
        self._seq = 0
        self._waiting = 0
        self._stopping = False
        self._cond = threading.Condition()
        self._rate = 0.0  # token-equivalents per second computed (EMA), for retry hints
        self.stats = {"batches": 0, "requests": 0, "scored": 0, "errors": 0, "split": 0,
                      "dropped_expired": 0, "dropped_cancelled": 0, "failed": 0}
        self._thread = threading.Thread(target=self._run, name="moejax-grpc-worker", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ callers
    def submit(self, items: Sequence[WorkItem]) -> None:
        """Queue admitted items (their cost already acquired from ``admission``)."""
        with self._cond:
            for item in items:
                self._push(item)
            self._cond.notify()

    def admission_share(self, tokens: int) -> float:
        """The share of the admission bound an item costing ``tokens`` may fill: all of it
        for a small item (at most ``small_cost``), LARGE_SHARE for a large one."""
        return 1.0 if tokens <= self.small_cost else LARGE_SHARE

    def admit(self, cost: int) -> tuple[str, int | None] | None:
        """Acquire ``cost`` token-equivalents for a call's items (its share of the bound:
        :meth:`admission_share`): None when admitted, else why not and when to retry (None:
        never as sent, it costs more than the whole bound; the caller is to split it)."""
        adm = self.admission
        if adm.try_acquire(cost, self.admission_share(cost)):
            return None
        if cost > adm.bound:
            return (f"the request(s) need ~{cost} token-equivalents of compute, more than "
                    f"the server's bound of {adm.bound} (max_queued_tokens): split them",
                    None)
        return (f"the server's queue is full ({adm.queued} of {adm.bound} token-equivalents "
                f"queued)", self.retry_after_ms(cost))

    def retry_after_ms(self, tokens: int) -> int:
        """A hint for a refused caller, 10 ms .. 10 s: the time until ``tokens`` would fit,
        plus a random share of the time the queue takes to drain, so that a crowd refused
        together does not come back together (each retry costs the server a parse)."""
        queued = self.admission.queued
        rate = self._rate if self._rate > 0 else RATE_BEFORE_FIRST_BATCH
        excess = max(queued + tokens - self.admission.bound, 1)
        seconds = (excess + random.random() * queued) / rate
        return int(min(10_000, max(10, 1000 * seconds)))

    def snapshot(self) -> dict[str, int]:
        """Counters plus the admission state (queued, peak, bound, rejected)."""
        adm = self.admission
        with self._cond:
            waiting = self._waiting
        return {**self.stats, "queued_tokens": adm.queued, "peak_queued_tokens": adm.peak,
                "max_queued_tokens": adm.bound, "rejected": adm.rejected,
                "queue_length": waiting}

    def stop(self, timeout: float | None = None) -> None:
        """Finish what is queued (dropping cancelled items), then end the worker thread."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout)

    # ------------------------------------------------------------------ batch forming
    def _chunk_costs(self, item: WorkItem) -> list[int]:
        """Token-equivalents of the item's pending ops, in order, when they start a chunk:
        the first one whole (it computes the shared prompt again), the others shared."""
        done = len(item.prepared.ops) - len(item.pending)
        costs = list(item.prepared.op_costs[done:])
        if done and costs:
            costs[0] = self.scorer.token_equivalents(item.pending[0].flops(self.scorer.config))
        return costs

    def _push(self, item: WorkItem) -> None:
        """Queue ``item`` (or the rest of a split one) behind everything queued."""
        self._seq += 1
        item.seq, item.queued = self._seq, True
        self._waiting += 1
        self._by_age.append((item.seq, item))
        cost_class = sum(self._chunk_costs(item)).bit_length()  # powers of two of its cost
        heapq.heappush(self._by_cost, (cost_class, item.seq, item))

    @staticmethod
    def _live(seq: int, item: WorkItem) -> bool:
        return item.queued and item.seq == seq

    def _oldest(self) -> WorkItem | None:
        while self._by_age and not self._live(*self._by_age[0]):
            self._by_age.popleft()
        return self._by_age[0][1] if self._by_age else None

    def _take(self, item: WorkItem, batch: list[_Chunk], room: int,
              costs: list[int] | None = None) -> int:
        """Put ``item`` in the batch: whole when it fits ``room``, else a chunk of its ops
        that fits (at least one). ``costs``: its :meth:`_chunk_costs`, when known. Returns
        the token-equivalents taken."""
        item.queued = False
        self._waiting -= 1
        costs = self._chunk_costs(item) if costs is None else costs
        if sum(costs) <= room:
            batch.append(_Chunk(item, item.pending, sum(costs)))
            item.pending = []
            return sum(costs)
        taken, used = 0, 0
        while taken < len(costs) and (taken == 0 or used + costs[taken] <= room):
            used += costs[taken]
            taken += 1
        batch.append(_Chunk(item, item.pending[:taken], used))
        item.pending = item.pending[taken:]
        item.chunks += 1
        self.stats["split"] += item.chunks == 1
        return used   # the rest is queued again once this chunk has run (see _run)

    def _next_batch(self) -> list[_Chunk] | None:
        """Up to ``batch_tokens``: the oldest queued item (whole, or a chunk of it: so every
        item progresses, however much cheaper work keeps arriving), then the cheapest
        items (by cost class, then age) whole while they fit. None once stopping with
        nothing queued."""
        with self._cond:
            while self._oldest() is None and not self._stopping:
                self._cond.wait()
            oldest = self._oldest()
            if oldest is None:
                return None
            batch: list[_Chunk] = []
            spent = self._take(oldest, batch, self.batch_tokens)
            while self._by_cost and len(batch) < self.max_batch_requests:
                _, seq, item = self._by_cost[0]
                if not self._live(seq, item):
                    heapq.heappop(self._by_cost)
                    continue
                costs = self._chunk_costs(item)
                if spent + sum(costs) > self.batch_tokens:
                    break
                heapq.heappop(self._by_cost)
                spent += self._take(item, batch, self.batch_tokens - spent, costs)
            return batch

    # ------------------------------------------------------------------ worker
    def _run(self) -> None:
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            try:
                self._score(batch)
            except BaseException:  # never let the worker die: the server would hang
                log.exception("batch of %d requests failed unexpectedly", len(batch))
                for chunk in batch:
                    self._fail(chunk.item, RuntimeError("the server failed on this batch"))
            # The rest of a split item queues behind what arrived while its chunk ran.
            with self._cond:
                for chunk in batch:
                    if chunk.item.pending and not chunk.item.delivered:
                        self._push(chunk.item)

    def _finish(self, item: WorkItem, outcome: Outcome) -> None:
        """Deliver ``outcome`` (once) and release the item's admission."""
        if item.delivered:
            return
        item.delivered = True
        if item.pending:  # the rest is still queued: take it out
            with self._cond:
                item.pending = []
                if item.queued:
                    item.queued = False   # its queue entries are dead now
                    self._waiting -= 1
        self.admission.release(item.cost)
        if self.metrics is not None:
            self.metrics.request_done(item.endpoint or "unknown", request_kind(item.request),
                                      outcome_status(outcome), time.monotonic() - item.enqueued)
        try:
            item.deliver(item, outcome)
        except Exception:
            log.exception("delivering the result of request #%d failed", item.index,
                          extra={"request_id": request_id_of(item.request)})

    def _fail(self, item: WorkItem, error: BaseException) -> None:
        if not item.delivered:
            self.stats["failed"] += 1
            self._finish(item, Failed(error))

    def _triage(self, batch: list[_Chunk]) -> list[_Chunk]:
        """Drop chunks of expired and cancelled items; the live ones remain."""
        now = time.monotonic()
        live = []
        for chunk in batch:
            item = chunk.item
            if item.queue_seconds is None:
                item.queue_seconds = now - item.enqueued
                if self.metrics is not None:
                    self.metrics.queue_wait(item.queue_seconds)
            if item.deadline is not None and item.deadline <= now:
                self.stats["requests"] += 1
                self.stats["dropped_expired"] += 1
                self._finish(item, Expired())
            elif item.cancelled():
                self.stats["requests"] += 1
                self.stats["dropped_cancelled"] += 1
                self._finish(item, Cancelled())
            else:
                live.append(chunk)
        return live

    def _score(self, batch: list[_Chunk]) -> None:
        live = self._triage(batch)
        self.stats["batches"] += 1
        if not live:
            log.info("batch %d: %d requests, all dropped (expired or cancelled)",
                     self.stats["batches"], len(batch))
            return
        # Keys unique within the call: items of different calls may share an index.
        keys = [[OpKey(position, op.candidate_index) for op in chunk.ops]
                for position, chunk in enumerate(live)]
        ops = [op if op.key == key else dataclasses.replace(op, key=key)
               for chunk, chunk_keys in zip(live, keys) for op, key in zip(chunk.ops, chunk_keys)]
        start = time.perf_counter()
        raw, timings = self.scorer.run_ops(ops)
        seconds = time.perf_counter() - start
        tokens = sum(chunk.cost for chunk in live)
        rate = tokens / max(seconds, 1e-6)
        self._rate = rate if self._rate <= 0 else 0.8 * self._rate + 0.2 * rate
        if self.metrics is not None:
            self.metrics.model_call(len(live), tokens, seconds)
        finished, errors = 0, 0
        for chunk, chunk_keys in zip(live, keys):
            item = chunk.item
            for op, key in zip(chunk.ops, chunk_keys):
                item.outputs[op.key] = raw[key]
                item.timings[op.key] = timings[key]
            if item.pending:
                continue  # more chunks to come
            finished += 1
            errors += self._complete(item)
        log.info("batch %d: %d requests (%d finished, %d with errors, %d dropped), ~%d "
                 "token-equivalents, oldest waited %.1f ms, ran in %.1f ms, %d queued",
                 self.stats["batches"], len(batch), finished, errors, len(batch) - len(live),
                 tokens, 1000 * max(chunk.item.queue_seconds for chunk in batch),
                 1000 * seconds, self.admission.queued)

    def _complete(self, item: WorkItem) -> int:
        """Combine a finished item's outputs into its result and deliver it; 1 when it is
        an error (a failed op: Failed)."""
        self.stats["requests"] += 1
        failure = next((out for out in item.outputs.values() if isinstance(out, Exception)),
                       None)
        if failure is not None:
            self._fail(item, failure)
            return 1
        try:
            result = self.scorer.combine([item.prepared], item.outputs, item.timings)[0]
        except Exception as exc:  # noqa: BLE001  (outputs that do not match: an engine bug)
            log.exception("combining the result of request #%d failed", item.index,
                          extra={"request_id": request_id_of(item.request)})
            self._fail(item, exc)
            return 1
        self.stats["scored"] += result.error is None
        self.stats["errors"] += result.error is not None
        self._finish(item, result)
        return int(result.error is not None)
