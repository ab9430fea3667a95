"""The server's work queue: admission control and the one thread that runs the Scorer.

A :class:`~serving.Scorer` is not thread-safe, so one worker thread owns it. RPC handlers
turn requests into :class:`WorkItem` s and :meth:`Batcher.submit` them; the worker takes
everything queued (oldest first, up to ``batch_tokens`` estimated tokens) as one
micro-batch, so concurrent callers are scored together in one ``Scorer.score`` call, and
hands each item its outcome through the item's ``deliver`` callback.

Admission control bounds the *queued tokens*: the estimated tokens of every item admitted
and not yet answered (waiting or being scored). An item's estimate is its prompt length
(token ids, or UTF-8 bytes of text: an upper bound for byte-level tokenizers) plus its
candidates' lengths, capped at the bound (so one oversized request can still run, alone).
Unary callers over the bound are refused at once (``try_acquire``, the handler answers
RESOURCE_EXHAUSTED with a retry hint); streams wait for room (``acquire``: back-pressure)
and only while the queue holds less than half the bound, so that bulk streams cannot starve
online (unary) callers.

Deadlines: an item whose call has expired, or was cancelled, by the time the worker
reaches it is dropped, not computed (counted in ``stats``).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from typing import Any, Callable, Sequence

from serving.requests import ScoreRequest, ScoreResult, request_label

log = logging.getLogger("moejax.grpc")


def estimate_tokens(request: ScoreRequest) -> int:
    """Token estimate of a parsed request (see the module docstring); at least 1."""
    if request.prompt_token_ids is not None:
        prompt = len(request.prompt_token_ids)
    else:
        prompt = len((request.prompt or "").encode("utf-8"))
    if request.candidate_token_ids is not None:
        candidates = sum(len(c) for c in request.candidate_token_ids)
    else:
        candidates = sum(len(c.encode("utf-8")) for c in request.candidates or ())
    return max(1, prompt + candidates)


class Expired:
    """Outcome of an item whose deadline passed before the worker reached it."""


class Cancelled:
    """Outcome of an item whose call was cancelled (or the server stopped) before it ran."""


@dataclasses.dataclass
class Failed:
    """Outcome of an item whose batch raised in the Scorer."""

    error: BaseException


Outcome = ScoreResult | Expired | Cancelled | Failed


@dataclasses.dataclass(eq=False)
class WorkItem:
    """One request in the queue.

    ``index`` names the request in error messages ("request #3") when it has no id;
    ``deadline`` is a ``time.monotonic()`` time or None; ``cancelled`` tells whether the
    caller has gone; ``deliver(item, outcome)`` is called exactly once."""

    request: ScoreRequest
    index: int
    cost: int
    deliver: Callable[["WorkItem", Outcome], None]
    deadline: float | None = None
    cancelled: Callable[[], bool] = lambda: False
    enqueued: float = dataclasses.field(default_factory=time.monotonic)
    queue_seconds: float = 0.0


class Admission:
    """A bound on queued tokens; ``peak`` is the most ever admitted at once."""

    def __init__(self, bound: int):
        if bound <= 0:
            raise ValueError(f"max_queued_tokens must be positive, got {bound}")
        self.bound = int(bound)
        self.queued = 0
        self.peak = 0
        self.rejected = 0
        self._cond = threading.Condition()

    def cost(self, request: ScoreRequest) -> int:
        """Tokens a request occupies while admitted."""
        return min(estimate_tokens(request), self.bound)

    def _take(self, tokens: int, limit: int) -> bool:
        """Admit when the queue stays within ``limit`` (<= bound), or when it is empty (an
        item costs at most the bound, so the bound still holds)."""
        if self.queued > 0 and self.queued + tokens > limit:
            return False
        self.queued += tokens
        self.peak = max(self.peak, self.queued)
        return True

    def try_acquire(self, tokens: int) -> bool:
        """Admit ``tokens`` now, or refuse (counted in ``rejected``)."""
        with self._cond:
            if tokens <= self.bound and self._take(tokens, self.bound):
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

    def release(self, tokens: int) -> None:
        with self._cond:
            self.queued -= tokens
            self._cond.notify_all()


_STOP = object()


class Batcher:
    """Owns the Scorer: one worker thread scores micro-batches of queued items.

    ``batch_tokens``: estimated tokens gathered into one ``Scorer.score`` call (the first
    item is always taken); ``max_batch_requests`` caps its request count.
    """

    def __init__(self, scorer: Any, *, max_queued_tokens: int, batch_tokens: int,
                 max_batch_requests: int = 4096):
        self.scorer = scorer
        self.admission = Admission(max_queued_tokens)
        self.batch_tokens = max(1, int(batch_tokens))
        self.max_batch_requests = max(1, int(max_batch_requests))
        self._queue: collections.deque[Any] = collections.deque()
        self._cond = threading.Condition()
        self._rate = 0.0  # estimated tokens per second scored (EMA), for retry hints
        self.stats = {"batches": 0, "requests": 0, "scored": 0, "errors": 0,
                      "dropped_expired": 0, "dropped_cancelled": 0, "failed": 0}
        self._thread = threading.Thread(target=self._run, name="moejax-grpc-worker", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ callers
    def submit(self, items: Sequence[WorkItem]) -> None:
        """Queue admitted items (their cost already acquired from ``admission``)."""
        with self._cond:
            self._queue.extend(items)
            self._cond.notify()

    def retry_after_ms(self, tokens: int) -> int:
        """A hint for a refused caller: time until ``tokens`` would fit, 10 ms .. 10 s."""
        excess = self.admission.queued + tokens - self.admission.bound
        if self._rate <= 0:
            return 100
        return int(min(10_000, max(10, 1000 * max(excess, 1) / self._rate)))

    def snapshot(self) -> dict[str, int]:
        """Counters plus the admission state (queued, peak, bound, rejected)."""
        adm = self.admission
        with self._cond:
            waiting = sum(1 for item in self._queue if item is not _STOP)
        return {**self.stats, "queued_tokens": adm.queued, "peak_queued_tokens": adm.peak,
                "max_queued_tokens": adm.bound, "rejected": adm.rejected,
                "queue_length": waiting}

    def stop(self, timeout: float | None = None) -> None:
        """Finish what is queued (dropping cancelled items), then end the worker thread."""
        with self._cond:
            self._queue.append(_STOP)
            self._cond.notify()
        self._thread.join(timeout)

    # ------------------------------------------------------------------ worker
    def _next_batch(self) -> list[WorkItem] | None:
        """The oldest items up to the bounds; None at the stop marker."""
        with self._cond:
            while not self._queue:
                self._cond.wait()
            if self._queue[0] is _STOP:
                return None
            batch, tokens = [], 0
            while (self._queue and self._queue[0] is not _STOP
                   and len(batch) < self.max_batch_requests
                   and (not batch or tokens + self._queue[0].cost <= self.batch_tokens)):
                item = self._queue.popleft()
                batch.append(item)
                tokens += item.cost
            return batch

    def _run(self) -> None:
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            try:
                self._score(batch)
            except BaseException:  # never let the worker die: the server would hang
                log.exception("batch of %d requests failed unexpectedly", len(batch))

    def _finish(self, item: WorkItem, outcome: Outcome) -> None:
        self.admission.release(item.cost)
        try:
            item.deliver(item, outcome)
        except Exception:
            log.exception("delivering the result of request #%d failed", item.index)

    def _triage(self, batch: list[WorkItem]) -> list[WorkItem]:
        """Drop expired and cancelled items; the live ones remain."""
        now = time.monotonic()
        live = []
        for item in batch:
            item.queue_seconds = now - item.enqueued
            if item.deadline is not None and item.deadline <= now:
                self.stats["dropped_expired"] += 1
                self._finish(item, Expired())
            elif item.cancelled():
                self.stats["dropped_cancelled"] += 1
                self._finish(item, Cancelled())
            else:
                live.append(item)
        return live

    def _score(self, batch: list[WorkItem]) -> None:
        live = self._triage(batch)
        self.stats["batches"] += 1
        self.stats["requests"] += len(batch)
        if not live:
            log.info("batch %d: %d requests, all dropped (expired or cancelled)",
                     self.stats["batches"], len(batch))
            return
        start = time.perf_counter()
        try:
            results = self.scorer.score([item.request for item in live], progress=False)
        except Exception as exc:
            log.exception("scoring a batch of %d requests failed", len(live))
            self.stats["failed"] += len(live)
            for item in live:
                self._finish(item, Failed(exc))
            return
        seconds = time.perf_counter() - start
        tokens = sum(item.cost for item in live)
        rate = tokens / max(seconds, 1e-6)
        self._rate = rate if self._rate <= 0 else 0.8 * self._rate + 0.2 * rate
        errors = 0
        for position, (item, result) in enumerate(zip(live, results)):
            errors += result.error is not None
            self._finish(item, _relabel(result, item, position))
        self.stats["scored"] += len(live) - errors
        self.stats["errors"] += errors
        log.info("batch %d: %d requests (%d invalid, %d dropped), ~%d tokens, waited %.1f ms "
                 "(oldest), scored in %.1f ms, %d tokens queued",
                 self.stats["batches"], len(batch), errors, len(batch) - len(live), tokens,
                 1000 * max(item.queue_seconds for item in batch), 1000 * seconds,
                 self.admission.queued)


def _relabel(result: ScoreResult, item: WorkItem, position: int) -> ScoreResult:
    """Error messages name an id-less request by its index *in the Scorer call*; give it
    its index in the caller's call instead."""
    if result.error is not None and position != item.index:
        old = request_label(item.request.id, position) + ":"
        if old.startswith("request #") and result.error.startswith(old):
            result.error = request_label(None, item.index) + ":" + result.error[len(old):]
    return result
