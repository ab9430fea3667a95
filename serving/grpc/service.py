"""The RPC handlers of ``moejax.v1.Scoring`` (asyncio): requests in, work items to the
batcher, outcomes back as results or status codes. (``moejax.v1.Generation``'s handler,
with its own status codes, is :mod:`serving.grpc.generation`: the same conventions —
INVALID_ARGUMENT naming the field, RESOURCE_EXHAUSTED with ``retry-after-ms``,
DEADLINE_EXCEEDED, UNAVAILABLE while loading or stopping, the same bearer-token auth.)

Threads: the handlers run on the server's event loop, which also serves health and
reflection, and does only cheap things there — size limits (lengths, no parsing), the
admission decision, waiting on outcomes. Parsing and tokenization (``Scorer.prepare``) run
on the ``prepare`` thread pool (the tokenizer releases the GIL), and the model on the
batcher's worker thread, so no request, however large, delays a health check.

Status codes:

* ``INVALID_ARGUMENT`` — ``Score`` of an invalid request, or one over a size limit
  (``max_text_bytes``, ``max_token_ids``, ``max_candidates``: refused before tokenizing;
  the message names the field and the limit). In ``ScoreBatch`` / ``ScoreStream`` an
  invalid item gets a result with ``error`` set instead.
* ``RESOURCE_EXHAUSTED`` — overload: the queue's cost bound is reached, or too many calls
  are in progress or waiting to be prepared. The trailing metadata ``retry-after-ms`` (and
  ``grpc-retry-pushback-ms``, and the message) say when to retry. Refused without a hint,
  because waiting would not help (the message says the limit and to split): a
  ``ScoreBatch`` of more requests than ``max_preparing`` (refused before anything is
  read from its items), and a request or batch costing more than the whole bound —
  known before tokenizing when its least possible cost (:func:`serving.limits.least_cost`:
  token ids counted, text one token a request) is already over it, else after preparing.
  Messages over the size limit are refused by gRPC itself with the same code.
* ``DEADLINE_EXCEEDED`` — the call's deadline passed; work still queued is dropped.
* ``UNAVAILABLE`` — the model is still loading, or the server is shutting down (a stream
  then ends with this code after the results of the requests it had read).
* ``INTERNAL`` — the model failed on the request's batch, or produced NaN logits (in a
  stream: error results for the affected items, the stream goes on).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import threading
import time
from typing import Any, AsyncIterator, Sequence

import grpc

from serving.grpc import convert, decoding, scoring_pb2 as pb
from serving.grpc.batcher import Batcher, Cancelled, Expired, Failed, WorkItem
from serving.limits import least_cost
from serving.requests import RequestError, request_id_of, request_kind, request_label

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Scoring"].full_name
NAN_ERROR = "the model produced NaN logits"

STREAM_SHARE = 0.5      # a stream waits while the queue holds more than this share of the bound
STREAM_WINDOW = 1024    # results a stream may have pending (queued, scored but not yet sent)
ADMISSION_POLL = 0.02   # seconds between a waiting stream's admission attempts
# The early admission estimate: message bytes per token-equivalent (text runs ~3-4 bytes per
# token, and a token costs at least one token-equivalent).
BYTES_PER_TOKEN_EQUIVALENT = 4


@dataclasses.dataclass(frozen=True)
class OversizedBatch:
    """A ``ScoreBatchRequest`` of ``count`` requests, more than one call may have prepared,
    as the server's deserializer leaves it (:func:`serving.grpc.server.batch_deserializer`):
    counted, its items never turned into Python objects (for 200,000 requests that alone
    would hold the event loop, and so health, for a second or more). Refused unread."""

    count: int


def call_deadline(context: Any) -> float | None:
    """When the call ``context`` must end, on the ``time.monotonic()`` clock (None: no
    deadline)."""
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


class Refused(Exception):
    """A call refused for overload: RESOURCE_EXHAUSTED with a retry hint."""

    def __init__(self, message: str, retry_ms: int | None):
        super().__init__(message)
        self.retry_ms = retry_ms


async def refuse(context: Any, refused: Refused) -> None:
    """End the call with RESOURCE_EXHAUSTED, with ``refused``'s retry hint (if any) in its
    message and trailing metadata."""
    if refused.retry_ms is None:
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(refused))
    hint = str(refused.retry_ms)
    # grpc-retry-pushback-ms: honoured by gRPC's own retry policy when configured.
    await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"{refused}; retry after {hint} ms",
                        trailing_metadata=(("retry-after-ms", hint),
                                           ("grpc-retry-pushback-ms", hint)))


async def _abort_for(outcome: Any, context: Any) -> None:
    """Abort the call for an outcome that is not a result."""
    if isinstance(outcome, Expired):
        await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                            "the deadline passed while the request was queued; it was not "
                            "computed")
    if isinstance(outcome, Cancelled):
        await context.abort(grpc.StatusCode.CANCELLED, "the call was cancelled")
    if isinstance(outcome, Failed):
        await context.abort(grpc.StatusCode.INTERNAL, f"scoring failed: {outcome.error!r}")


class Outcomes:
    """Futures of one call's work items, completed from the worker thread (the gRPC and
    the HTTP handlers' calls alike)."""

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.gone = threading.Event()  # the caller went away: the worker drops its items

    def item(self, prepared: Any, endpoint: str, deadline: float | None = None) -> WorkItem:
        """A work item of ``prepared`` whose outcome :meth:`wait` awaits (``deadline``: a
        ``time.monotonic()`` time or None)."""
        return WorkItem(prepared=prepared, deliver=self._deliver, deadline=deadline,
                        cancelled=self.gone.is_set, future=self.loop.create_future(),
                        endpoint=endpoint)

    def _deliver(self, item: WorkItem, outcome: Any) -> None:
        self.loop.call_soon_threadsafe(_resolve, item.future, outcome)

    async def wait(self, items: Sequence[WorkItem]) -> list[Any]:
        try:
            return list(await asyncio.gather(*(item.future for item in items)))
        except asyncio.CancelledError:
            self.gone.set()
            raise


def _resolve(future: asyncio.Future, outcome: Any) -> None:
    if not future.done():
        future.set_result(outcome)


class ScoringService:
    """Handlers of the Scoring service; :meth:`attach` a Scorer and its :class:`Batcher`.

    ``prepare_threads``: threads that validate and tokenize requests; ``max_in_flight``:
    scoring calls in progress at once (more are refused with a retry hint);
    ``max_preparing``: requests waiting to be prepared (more: refused likewise), which is
    also the most requests one ``ScoreBatch`` may carry (more: refused without a hint, the
    batch is to be split), so one call never holds the prepare pool for longer than
    preparing that many requests takes, nor keeps other calls from it."""

    def __init__(self, *, prepare_threads: int = 2, max_in_flight: int = 4096,
                 max_preparing: int = 256) -> None:
        self.batcher: Batcher | None = None
        self.scorer: Any = None
        self.info: pb.ModelInfoResponse | None = None
        self.stopping = threading.Event()
        self.in_flight = 0  # scoring calls in progress (a graceful stop waits for them)
        self.preparing = 0  # requests handed to the prepare pool and not yet back
        self.max_in_flight = max_in_flight
        self.max_preparing = max_preparing
        self.refused = 0    # calls refused for overload here (not counting admission)
        self.oversized = 0  # calls refused before tokenizing as more than any call may be
        self.metrics: Any = None   # a serving.metrics.ServingMetrics, or None
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=prepare_threads, thread_name_prefix="moejax-grpc-prepare")

    def attach(self, batcher: Batcher, scorer: Any, info: pb.ModelInfoResponse) -> None:
        self.info = info
        self.scorer = scorer
        self.batcher = batcher

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ helpers
    def count(self, endpoint: str, status: str, kind: str = "unknown", requests: int = 1
              ) -> None:
        """Requests answered here, not by the batcher (refused, invalid), in the metrics."""
        if self.metrics is not None:
            self.metrics.request_done(endpoint, kind, status, count=requests)

    @contextlib.asynccontextmanager
    async def _call(self, context: Any, endpoint: str) -> AsyncIterator[Batcher]:
        """A scoring call: the model is loaded, the server is not stopping, and there is
        room for one more call; counted in ``in_flight`` while it runs."""
        batcher = self.batcher
        if batcher is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                "the model is still loading (health: NOT_SERVING); retry later")
        if self.stopping.is_set():
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
        if self.in_flight >= self.max_in_flight:
            self.refused += 1
            self.count(endpoint, "refused")
            await refuse(context, Refused(f"the server has {self.in_flight} calls in "
                                            f"progress (its limit)", batcher.retry_after_ms(0)))
        self.in_flight += 1
        try:
            yield batcher
        finally:
            self.in_flight -= 1

    def check_limits(self, message: Any, index: int) -> str | None:
        """The size-limit error of a request message (lengths only: runs on the loop)."""
        try:
            self.scorer.limits.check(convert.limit_view(message), index)
        except RequestError as exc:
            return str(exc)
        return None

    def _prepare_one(self, message: Any, index: int) -> Any:
        """Convert, validate and tokenize one request (a prepare-pool thread)."""
        from serving.api import PreparedRequest

        raw = convert.request_from_proto(message)
        try:
            return self.scorer.prepare(raw, index)
        except Exception as exc:  # noqa: BLE001  (never lose the call over one request)
            return PreparedRequest(index=index, request=raw, error=(
                f"{request_label(raw.id, index)}: could not be prepared: {exc!r}"))

    async def prepare(self, batcher: Batcher, messages: Sequence[tuple[int, Any]]) -> list[Any]:
        """Prepared requests of ``(index, message)`` pairs, on the prepare pool; raises
        Refused when too many requests already wait to be prepared. (No call brings more
        than ``max_preparing``: :meth:`_refuse_oversized_batch`; so ``preparing`` never
        exceeds it.)"""
        if self.preparing + len(messages) > self.max_preparing:
            self.refused += 1
            raise Refused(f"{self.preparing} requests are waiting to be prepared (the "
                           f"server's limit is {self.max_preparing})", batcher.retry_after_ms(0))
        self.preparing += len(messages)
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(
                self._pool, lambda: [self._prepare_one(m, i) for i, m in messages])
        finally:
            self.preparing -= len(messages)

    @staticmethod
    def _admit(batcher: Batcher, cost: int) -> None:
        """Acquire ``cost`` or raise Refused."""
        refusal = batcher.admit(cost)
        if refusal is not None:
            message, retry_ms = refusal
            raise Refused(message + (", or use ScoreStream" if retry_ms is None else ""),
                          retry_ms)

    def _refuse_oversized_batch(self, count: int) -> None:
        """Per call, before anything is read from the items: a batch of more requests than
        the server prepares at once (``max_preparing``) is refused without a retry hint
        (it would be refused again): preparing it would hold a prepare thread for as long
        as tokenizing all of it takes, and every other call would be refused meanwhile."""
        if count <= self.max_preparing:
            return
        self.oversized += 1
        raise Refused(f"the batch holds {count} requests, more than the server prepares for "
                       f"one call ({self.max_preparing}, max_preparing): split it into "
                       f"batches of at most {self.max_preparing} requests, or send them "
                       f"over ScoreStream", None)

    def _refuse_over_bound(self, batcher: Batcher, messages: Sequence[tuple[int, Any]]) -> None:
        """Before tokenizing: refuse, without a retry hint, requests whose least possible
        cost (:func:`serving.limits.least_cost`, from lengths: it never exceeds the cost of
        a valid request) is already more than the queue's whole bound; the exact cost,
        known after preparing, would be refused the same way."""
        bound = batcher.admission.bound
        least = sum(least_cost(convert.limit_view(message)) for _, message in messages)
        if least <= bound:
            return
        self.oversized += 1
        raise Refused(f"the request(s) need at least {least} token-equivalents of compute, "
                       f"more than the server's bound of {bound} (max_queued_tokens): split "
                       f"them, or use ScoreStream", None)

    def _refuse_early(self, batcher: Batcher, messages: Sequence[tuple[int, Any]]) -> None:
        """Before any preparing (tokenizing a long prompt takes milliseconds, and a refused
        crowd retries): refuse for good what can never fit (:meth:`_refuse_over_bound`),
        and for now what would not fit the queue by a rough estimate of its cost, its
        messages' bytes over BYTES_PER_TOKEN_EQUIVALENT. The exact cost is checked after
        preparing."""
        self._refuse_over_bound(batcher, messages)
        adm = batcher.admission
        message_bytes = sum(message.ByteSize() for _, message in messages)
        estimate = max(1, message_bytes // BYTES_PER_TOKEN_EQUIVALENT)
        if estimate > adm.bound or adm.would_fit(estimate, batcher.admission_share(estimate)):
            return  # (more than the whole bound: the exact cost decides, after preparing)
        adm.rejected += 1
        raise Refused(f"the server's queue is full ({adm.queued} of {adm.bound} "
                        f"token-equivalents queued)", batcher.retry_after_ms(estimate))

    # ------------------------------------------------------------------ RPCs
    async def Score(self, message: Any, context: Any) -> pb.ScoreResult:
        async with self._call(context, "Score") as batcher:
            if isinstance(message, decoding.Undecodable):
                label = request_label(message.request_id(), 0)
                self.count("Score", "invalid")
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"{label}: {message.describe()}")
            error = self.check_limits(message, 0)
            if error is not None:
                self.count("Score", "invalid")
                # Set, not raised: an abort's traceback would keep the (huge) message alive
                # in a reference cycle until the next garbage collection.
                context.set_code(grpc.StatusCode.INVALID_ARGUMENT)
                context.set_details(error)
                return pb.ScoreResult()
            try:
                self._refuse_early(batcher, [(0, message)])
                prepared = (await self.prepare(batcher, [(0, message)]))[0]
                if prepared.error is not None:
                    self.count("Score", "invalid", request_kind(prepared.request))
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, prepared.error)
                self._admit(batcher, prepared.cost)
            except Refused as refused:
                self.count("Score", "refused")
                await refuse(context, refused)
            outcomes = Outcomes()
            item = outcomes.item(prepared, "Score", call_deadline(context))
            batcher.submit([item])
            outcome = (await outcomes.wait([item]))[0]
            await _abort_for(outcome, context)
            if outcome.error is not None:
                code = (grpc.StatusCode.INTERNAL if outcome.error.endswith(NAN_ERROR)
                        else grpc.StatusCode.INVALID_ARGUMENT)
                await context.abort(code, outcome.error)
            return convert.result_to_proto(outcome, item.queue_seconds)

    async def ScoreBatch(self, items: Any, context: Any) -> pb.ScoreBatchResponse:
        async with self._call(context, "ScoreBatch") as batcher:
            if isinstance(items, decoding.Undecodable):
                self.count("ScoreBatch", "invalid")
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, items.describe())
            count = items.count if isinstance(items, OversizedBatch) else len(items)
            try:
                self._refuse_oversized_batch(count)
            except Refused as refused:
                self.count("ScoreBatch", "refused", requests=count)
                # Set, not raised: an abort's traceback would keep the (huge) batch alive in
                # a reference cycle until the next garbage collection.
                context.set_code(grpc.StatusCode.RESOURCE_EXHAUSTED)
                context.set_details(str(refused))
                return pb.ScoreBatchResponse()
            results: list[Any] = [None] * len(items)
            todo = []
            for index, message in enumerate(items):
                if isinstance(message, decoding.Undecodable):
                    request_id = message.request_id()
                    results[index] = convert.error_result(
                        request_id, f"{request_label(request_id, index)}: {message.describe()}")
                    self.count("ScoreBatch", "error")
                    continue
                error = self.check_limits(message, index)
                if error is not None:
                    results[index] = convert.error_result(convert.get_id(message), error)
                    self.count("ScoreBatch", "error")
                    continue
                todo.append((index, message))
            outcomes = Outcomes()
            work = []
            try:
                if todo:
                    self._refuse_early(batcher, todo)
                for prepared in (await self.prepare(batcher, todo)) if todo else ():
                    if prepared.error is not None:
                        results[prepared.index] = convert.error_result(
                            request_id_of(prepared.request), prepared.error)
                        self.count("ScoreBatch", "error", request_kind(prepared.request))
                    else:
                        work.append(outcomes.item(prepared, "ScoreBatch",
                                                  call_deadline(context)))
                if work:
                    self._admit(batcher, sum(item.cost for item in work))
            except Refused as refused:
                self.count("ScoreBatch", "refused", requests=len(todo))
                await refuse(context, refused)
            if work:
                batcher.submit(work)
            for item, outcome in zip(work, await outcomes.wait(work)):
                await _abort_for(outcome, context)
                results[item.index] = convert.result_to_proto(outcome, item.queue_seconds)
            return pb.ScoreBatchResponse(results=[
                r if isinstance(r, pb.ScoreResult) else convert.result_to_proto(r)
                for r in results])

    async def ScoreStream(self, messages: Any, context: Any) -> AsyncIterator[pb.StreamResult]:
        async with self._call(context, "ScoreStream") as batcher:
            stream = _Stream(self, batcher, context)
            reader = asyncio.ensure_future(stream.read(messages))
            try:
                async for result in stream.results():
                    yield result
            finally:
                stream.gone.set()
                reader.cancel()
            if stream.stopped_early:
                await context.abort(grpc.StatusCode.UNAVAILABLE,
                                    "the server is shutting down; requests after the last "
                                    "result were not read: send them again")

    async def ModelInfo(self, request: pb.ModelInfoRequest, context: Any
                        ) -> pb.ModelInfoResponse:
        if self.info is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                "the model is still loading (health: NOT_SERVING); retry later")
        return self.info


_READER_DONE = object()


class _Stream:
    """One ScoreStream call: a reader task prepares, admits (waiting for room) and
    submits the incoming requests; the handler yields results as they come.

    Memory: the reader reads a message only when fewer than ``STREAM_WINDOW`` of the
    stream's results are pending, so a client that sends without reading is slowed down by
    gRPC flow control instead of filling the server's memory."""

    def __init__(self, service: ScoringService, batcher: Batcher, context: Any):
        self.service, self.batcher, self.context = service, batcher, context
        self.out: asyncio.Queue = asyncio.Queue()
        self.window = asyncio.Semaphore(STREAM_WINDOW)
        self.outcomes = Outcomes()
        self.gone = self.outcomes.gone
        self.submitted = 0
        self.stopped_early = False

    def _give_up(self) -> bool:
        return self.gone.is_set() or self.service.stopping.is_set()

    def _error(self, index: int, request_id: Any, error: str) -> None:
        self.service.count("ScoreStream", "error")
        self.out.put_nowait(pb.StreamResult(index=index, result=convert.result_to_proto(
            convert.error_result(request_id, error))))

    def _deliver(self, item: WorkItem, outcome: Any) -> None:
        self.outcomes.loop.call_soon_threadsafe(self.out.put_nowait, (item, outcome))

    async def _submit(self, message: pb.StreamRequest, index: int) -> bool:
        """Prepare, admit (waiting for room) and queue one request; False to stop."""
        error = self.service.check_limits(message.request, index)
        if error is not None:
            self._error(index, convert.get_id(message.request), error)
            return True
        while True:
            try:
                prepared = (await self.service.prepare(self.batcher,
                                                       [(index, message.request)]))[0]
                break
            except Refused:
                if self._give_up():
                    return False
                await asyncio.sleep(ADMISSION_POLL)
        if prepared.error is not None:
            self._error(index, request_id_of(prepared.request), prepared.error)
            return True
        admission = self.batcher.admission
        if prepared.cost > admission.bound:
            self._error(index, request_id_of(prepared.request), (
                f"{request_label(request_id_of(prepared.request), index)}: needs "
                f"~{prepared.cost} token-equivalents of compute, more than the server's bound "
                f"of {admission.bound} (max_queued_tokens)"))
            return True
        while not admission.try_acquire_share(prepared.cost, STREAM_SHARE):
            if self._give_up():
                return False
            await asyncio.sleep(ADMISSION_POLL)
        item = WorkItem(prepared=prepared, deliver=self._deliver,
                        deadline=call_deadline(self.context), cancelled=self.gone.is_set,
                        endpoint="ScoreStream")
        self.submitted += 1
        self.batcher.submit([item])
        return True

    async def read(self, messages: Any) -> None:
        position = 0
        incoming = messages.__aiter__()
        try:
            while True:
                await self.window.acquire()  # one slot per result, freed once it is sent
                try:
                    message = await incoming.__anext__()
                except StopAsyncIteration:
                    break
                if isinstance(message, decoding.Undecodable):
                    lenient = message.lenient
                    index = (lenient.index if lenient is not None and lenient.HasField("index")
                             else position)
                    request_id = message.request_id("request")
                    self._error(index, request_id, f"{request_label(request_id, index)}: "
                                                   f"{message.describe('request.')}")
                else:
                    index = message.index if message.HasField("index") else position
                    if not await self._submit(message, index):
                        self.stopped_early = not self.gone.is_set()
                        break
                position += 1
                if self.service.stopping.is_set():
                    self.stopped_early = True
                    break
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001  (the client cancelled or the connection broke)
            self.gone.set()
        finally:
            self.out.put_nowait(_READER_DONE)

    async def results(self) -> AsyncIterator[pb.StreamResult]:
        answered, reader_done = 0, False
        while not (reader_done and answered == self.submitted):
            entry = await self.out.get()
            if entry is _READER_DONE:
                reader_done = True
                continue
            self.window.release()
            if isinstance(entry, pb.StreamResult):
                yield entry
                continue
            item, outcome = entry
            answered += 1
            if isinstance(outcome, (Expired, Cancelled)):
                self.gone.set()
                await _abort_for(outcome, self.context)
            if isinstance(outcome, Failed):
                outcome = convert.error_result(item.request.id, (
                    f"{request_label(item.request.id, item.index)}: internal error while "
                    f"scoring: {outcome.error!r}"))
            yield pb.StreamResult(index=item.index,
                                  result=convert.result_to_proto(outcome, item.queue_seconds))
