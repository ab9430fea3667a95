"""Scoring over HTTP on the gRPC server's engine: the same Scorer, the same batcher (one
worker, one queue) and the same admission bound, so a burst on either door is refused with
a retry hint, never queued without bound, and both share batches.

A call's requests are prepared (validated, tokenized: ``Scorer.prepare``) on a thread pool
of their own (a call of one short request on the event loop: the hop would cost more), admitted together against the bound (their summed cost; more than the whole
bound: refused for good, the caller is to split; past what is free now: refused with a
hint), queued as work items and awaited on the HTTP server's event loop. A request that
cannot be prepared gets its error in its own result; the others are scored.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from typing import Any, Sequence

from serving.grpc.batcher import Cancelled, Expired, Failed
from serving.grpc.service import Outcomes, Refused
from serving.requests import ScoreResult, request_id_of, request_kind, request_label


class Unavailable(Exception):
    """The model is not loaded yet, or the server is draining."""


class HttpScoring:
    """Scores request dicts on a :class:`serving.grpc.server.ScoringServer`'s engine."""

    def __init__(self, server: Any, *, prepare_threads: int = 2):
        self.server = server
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=prepare_threads, thread_name_prefix="moejax-http-prepare")

    @property
    def ready(self) -> bool:
        """The model is loaded and the server is not draining."""
        return self.server.batcher is not None and not self.server.draining.is_set()

    @property
    def model_name(self) -> str | None:
        """The served model's name (``Scorer.model_name``; never its path), or None while
        it loads."""
        scorer = self.server.service.scorer
        return None if scorer is None else scorer.model_name

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def score(self, requests: Sequence[Any], endpoint: str) -> list[ScoreResult]:
        """One result per request, in order (an invalid one: its error). Raises
        :class:`Unavailable` or :class:`Refused` for the whole call."""
        if self.server.batcher is None or self.server.service.stopping.is_set():
            # (While draining, before the stop refuses calls, they are still answered.)
            raise Unavailable("the model is still loading or the server is stopping; "
                              "retry later")
        server = self.server
        batcher, scorer, metrics = server.batcher, server.service.scorer, server.metrics
        if _small(requests):
            # On the event loop: a thread hop costs more than preparing a short request.
            prepared = [scorer.prepare(r, i) for i, r in enumerate(requests)]
        else:
            prepared = await asyncio.get_running_loop().run_in_executor(
                self._pool, lambda: [scorer.prepare(r, i) for i, r in enumerate(requests)])
        results: list[ScoreResult | None] = [None] * len(requests)
        for prep in prepared:
            if prep.error is not None:
                results[prep.index] = ScoreResult(id=request_id_of(prep.request), error=prep.error)
                metrics.request_done(endpoint, request_kind(prep.request), "error")
        todo = [prep for prep in prepared if prep.error is None]
        cost = sum(prep.cost for prep in todo)
        if todo:
            self._admit(batcher, cost, endpoint, len(todo))
        outcomes = Outcomes()        # (a client that goes away: its queued items dropped)
        items = [outcomes.item(prep, endpoint) for prep in todo]
        if items:
            batcher.submit(items)
        for prep, outcome in zip(todo, await outcomes.wait(items)):
            results[prep.index] = _as_result(prep, outcome)
        return results

    @staticmethod
    def _admit(batcher: Any, cost: int, endpoint: str, count: int) -> None:
        refusal = batcher.admit(cost)
        if refusal is None:
            return
        if batcher.metrics is not None:
            batcher.metrics.request_done(endpoint, "unknown", "refused", count=count)
        raise Refused(*refusal)


# A call prepared on the event loop: one request whose texts hold at most this many
# characters (tokenizing them takes well under a millisecond; a longer one goes to the pool,
# so that it never stalls the other calls on the loop).
INLINE_PREPARE_CHARS = 2048


def _small(requests: Sequence[Any]) -> bool:
    if len(requests) != 1 or not isinstance(requests[0], dict):
        return False
    request = requests[0]
    texts = [request.get("prompt"), *(request.get("candidates") or ())]
    if request.get("messages") is not None:
        return False
    return all(t is None or isinstance(t, str) for t in texts) and \
        sum(len(t) for t in texts if t) <= INLINE_PREPARE_CHARS


def _as_result(prep: Any, outcome: Any) -> ScoreResult:
    """A work item's outcome as the request's result."""
    if isinstance(outcome, ScoreResult):
        return outcome
    label = request_label(request_id_of(prep.request), prep.index)
    reason = {Expired: "its deadline passed in the queue",
              Cancelled: "the call was cancelled"}.get(type(outcome))
    if isinstance(outcome, Failed):
        reason = f"internal error while scoring: {outcome.error!r}"
    return ScoreResult(id=request_id_of(prep.request), error=f"{label}: {reason}")




__all__ = ("HttpScoring", "Refused", "Unavailable")
