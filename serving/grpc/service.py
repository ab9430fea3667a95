"""The RPC handlers of ``moejax.v1.Scoring``: requests in, work items to the batcher,
outcomes back as results or status codes.

Status codes:

* ``INVALID_ARGUMENT`` — ``Score`` of an invalid request (the message is the validation
  error, "request 'ID': FIELD: problem"; text that is not UTF-8 included). In
  ``ScoreBatch`` / ``ScoreStream`` an invalid item gets a result with ``error`` set instead.
* ``RESOURCE_EXHAUSTED`` — the queue bound is reached (``Score``, ``ScoreBatch``); the
  trailing metadata ``retry-after-ms`` (and the message) say when to retry. A
  ``ScoreBatch`` larger than the whole bound is refused without a hint. Messages over the
  size limit are refused by gRPC itself with the same code.
* ``DEADLINE_EXCEEDED`` — the call's deadline passed; work still queued is dropped.
* ``UNAVAILABLE`` — the model is still loading, or the server is shutting down (a stream
  then ends with this code after the results of the requests it had read).
* ``INTERNAL`` — the Scorer failed on a batch, or the model produced NaN logits (in a
  stream: error results for the affected items, the stream goes on).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from typing import Any, Iterator

import grpc

from serving.grpc import convert, decoding, scoring_pb2 as pb
from serving.grpc.batcher import Batcher, Cancelled, Expired, Failed, WorkItem
from serving.requests import RequestError, parse_request, request_label

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Scoring"].full_name
NAN_ERROR = "the model produced NaN logits"


def _deadline(context: grpc.ServicerContext) -> float | None:
    remaining = context.time_remaining()
    return None if remaining is None else time.monotonic() + remaining


class _Collector:
    """Outcomes of the work items of one unary call, by item index."""

    def __init__(self, context: grpc.ServicerContext):
        self.outcomes: dict[int, Any] = {}
        self._remaining = 0
        self._lock = threading.Lock()
        self._done = threading.Event()
        self.gone = threading.Event()
        context.add_callback(self.gone.set)  # runs when the RPC ends: done, cancelled, expired

    def expect(self, count: int) -> None:
        """Set the number of items to wait for (before they are submitted)."""
        self._remaining = count
        if count == 0:
            self._done.set()

    def deliver(self, item: WorkItem, outcome: Any) -> None:
        with self._lock:
            self.outcomes[item.index] = outcome
            self._remaining -= 1
            if self._remaining == 0:
                self._done.set()

    def wait(self, context: grpc.ServicerContext) -> bool:
        """True when every outcome is in; False when the caller went away first."""
        while not self._done.wait(0.25):
            if self.gone.is_set() or not context.is_active():
                self.gone.set()  # the worker drops what is still queued
                return False
        return True


def _abort_for(outcome: Any, context: grpc.ServicerContext) -> None:
    """Abort the call for an outcome that is not a result."""
    if isinstance(outcome, Expired):
        context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                      "the deadline passed while the request was queued; it was not computed")
    if isinstance(outcome, Cancelled):
        context.abort(grpc.StatusCode.CANCELLED, "the call was cancelled")
    if isinstance(outcome, Failed):
        context.abort(grpc.StatusCode.INTERNAL, f"scoring failed: {outcome.error!r}")


class ScoringService:
    """Handlers of the Scoring service; :meth:`attach` a :class:`Batcher` to serve."""

    def __init__(self) -> None:
        self.batcher: Batcher | None = None
        self.info: pb.ModelInfoResponse | None = None
        self.stopping = threading.Event()
        self.in_flight = 0  # scoring calls in progress (a graceful stop waits for them)
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def _tracked(self) -> Iterator[None]:
        with self._lock:
            self.in_flight += 1
        try:
            yield
        finally:
            with self._lock:
                self.in_flight -= 1

    def attach(self, batcher: Batcher, info: pb.ModelInfoResponse) -> None:
        self.info = info
        self.batcher = batcher

    # ------------------------------------------------------------------ helpers
    def _ready(self, context: grpc.ServicerContext) -> Batcher:
        if self.batcher is None:
            context.abort(grpc.StatusCode.UNAVAILABLE,
                          "the model is still loading (health: NOT_SERVING); retry later")
        return self.batcher

    def _admit(self, batcher: Batcher, items: list[WorkItem],
               context: grpc.ServicerContext) -> None:
        """Acquire the items' tokens or abort with RESOURCE_EXHAUSTED."""
        tokens = sum(item.cost for item in items)
        if tokens > batcher.admission.bound:
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"the batch needs ~{tokens} queued tokens, more than the server's "
                          f"bound of {batcher.admission.bound}: split it, or use ScoreStream")
        if not batcher.admission.try_acquire(tokens):
            wait_ms = batcher.retry_after_ms(tokens)
            # grpc-retry-pushback-ms: honoured by gRPC's own retry policy when configured.
            context.set_trailing_metadata((("retry-after-ms", str(wait_ms)),
                                           ("grpc-retry-pushback-ms", str(wait_ms))))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"the server's queue is full ({batcher.admission.queued} of "
                          f"{batcher.admission.bound} tokens queued); retry after {wait_ms} ms")

    @staticmethod
    def _item(request: Any, index: int, cost_of, context: grpc.ServicerContext, deliver,
              cancelled) -> WorkItem:
        return WorkItem(request=request, index=index, cost=cost_of(request), deliver=deliver,
                        deadline=_deadline(context), cancelled=cancelled)

    # ------------------------------------------------------------------ RPCs
    def Score(self, message: Any, context: grpc.ServicerContext) -> pb.ScoreResult:
        with self._tracked():
            return self._score(message, context)

    def ScoreBatch(self, items: Any, context: grpc.ServicerContext) -> pb.ScoreBatchResponse:
        with self._tracked():
            return self._score_batch(items, context)

    def ScoreStream(self, messages: Iterator[Any], context: grpc.ServicerContext
                    ) -> Iterator[pb.StreamResult]:
        with self._tracked():
            batcher = self._ready(context)
            stream = _Stream(self, batcher, context)
            threading.Thread(target=stream.read, args=(messages,),
                             name="moejax-grpc-stream-reader", daemon=True).start()
            yield from stream.results()

    def ModelInfo(self, request: pb.ModelInfoRequest, context: grpc.ServicerContext
                  ) -> pb.ModelInfoResponse:
        self._ready(context)
        return self.info

    def _score(self, message: Any, context: grpc.ServicerContext) -> pb.ScoreResult:
        batcher = self._ready(context)
        if isinstance(message, decoding.Undecodable):
            label = request_label(message.request_id(), 0)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{label}: {message.describe()}")
        try:
            request = parse_request(convert.request_from_proto(message), 0)
        except RequestError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        collector = _Collector(context)
        item = self._item(request, 0, batcher.admission.cost, context, collector.deliver,
                          collector.gone.is_set)
        collector.expect(1)
        self._admit(batcher, [item], context)
        batcher.submit([item])
        if not collector.wait(context):
            context.abort(grpc.StatusCode.CANCELLED, "the caller went away")
        outcome = collector.outcomes[0]
        _abort_for(outcome, context)
        if outcome.error is not None:
            code = (grpc.StatusCode.INTERNAL if outcome.error.endswith(NAN_ERROR)
                    else grpc.StatusCode.INVALID_ARGUMENT)
            context.abort(code, outcome.error)
        return convert.result_to_proto(outcome, item.queue_seconds)

    def _score_batch(self, items: Any, context: grpc.ServicerContext) -> pb.ScoreBatchResponse:
        batcher = self._ready(context)
        if isinstance(items, decoding.Undecodable):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, items.describe())
        results: list[Any] = [None] * len(items)
        collector = _Collector(context)
        work = []
        for index, message in enumerate(items):
            if isinstance(message, decoding.Undecodable):
                request_id = message.request_id()
                results[index] = convert.error_result(
                    request_id, f"{request_label(request_id, index)}: {message.describe()}")
                continue
            raw = convert.request_from_proto(message)
            try:
                request = parse_request(raw, index)
            except RequestError as exc:
                results[index] = convert.error_result(raw.id, str(exc))
                continue
            work.append(self._item(request, index, batcher.admission.cost, context,
                                   collector.deliver, collector.gone.is_set))
        collector.expect(len(work))
        if work:
            self._admit(batcher, work, context)
            batcher.submit(work)
        if not collector.wait(context):
            context.abort(grpc.StatusCode.CANCELLED, "the caller went away")
        for item in work:
            outcome = collector.outcomes[item.index]
            _abort_for(outcome, context)
            results[item.index] = convert.result_to_proto(outcome, item.queue_seconds)
        return pb.ScoreBatchResponse(results=[
            r if isinstance(r, pb.ScoreResult) else convert.result_to_proto(r) for r in results])



_READER_DONE = object()


STREAM_SHARE = 0.5      # a stream waits while the queue holds more than this share of the bound
STREAM_WINDOW = 1024    # results a stream may have pending (queued, scored but not yet sent)


class _Stream:
    """One ScoreStream call: a reader thread admits and submits the incoming requests
    (waiting for room in the queue), the handler yields results as they come.

    Memory: the reader reads a message only when fewer than ``STREAM_WINDOW`` of the
    stream's results are pending, so a client that sends without reading is slowed down by
    gRPC flow control instead of filling the server's memory."""

    def __init__(self, service: ScoringService, batcher: Batcher,
                 context: grpc.ServicerContext):
        self.service, self.batcher, self.context = service, batcher, context
        self.out: queue.Queue = queue.Queue()
        self.window = threading.Semaphore(STREAM_WINDOW)
        self.submitted = 0
        self.stopped_early = False
        self.gone = threading.Event()
        context.add_callback(self.gone.set)

    def _give_up(self) -> bool:
        return (self.gone.is_set() or self.service.stopping.is_set()
                or not self.context.is_active())

    def _wait_for_window(self) -> bool:
        while not self.window.acquire(timeout=0.05):
            if self._give_up():
                return False
        return True

    def _error(self, index: int, request_id: Any, error: str) -> None:
        self.out.put(pb.StreamResult(index=index, result=convert.result_to_proto(
            convert.error_result(request_id, error))))

    def _deliver(self, item: WorkItem, outcome: Any) -> None:
        self.out.put((item, outcome))

    def _submit(self, message: pb.StreamRequest, index: int) -> bool:
        """Validate, admit (waiting for room) and queue one request; False to stop reading."""
        raw = convert.request_from_proto(message.request)
        try:
            request = parse_request(raw, index)
        except RequestError as exc:
            self._error(index, raw.id, str(exc))
            return True
        item = WorkItem(request=request, index=index, cost=self.batcher.admission.cost(request),
                        deliver=self._deliver, deadline=_deadline(self.context),
                        cancelled=self.gone.is_set)
        if not self.batcher.admission.acquire(item.cost, self._give_up, share=STREAM_SHARE):
            return False
        self.submitted += 1
        self.batcher.submit([item])
        return True

    def read(self, messages: Iterator[Any]) -> None:
        position = 0
        try:
            while True:
                if not self._wait_for_window():  # one slot per result, freed once it is sent
                    self.stopped_early = not self.gone.is_set()
                    break
                message = next(messages, None)
                if message is None:
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
                    if not self._submit(message, index):
                        self.stopped_early = True
                        break
                position += 1
                if self.service.stopping.is_set():
                    self.stopped_early = True
                    break
        except Exception:  # the client cancelled or the connection broke
            self.gone.set()
        finally:
            self.out.put(_READER_DONE)

    def results(self) -> Iterator[pb.StreamResult]:
        answered, reader_done = 0, False
        while not (reader_done and answered == self.submitted):
            try:
                entry = self.out.get(timeout=0.25)
            except queue.Empty:
                if not self.context.is_active():
                    self.gone.set()
                    return
                continue
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
                _abort_for(outcome, self.context)
            if isinstance(outcome, Failed):
                outcome = convert.error_result(item.request.id, (
                    f"{request_label(item.request.id, item.index)}: internal error while "
                    f"scoring: {outcome.error!r}"))
            yield pb.StreamResult(index=item.index,
                                  result=convert.result_to_proto(outcome, item.queue_seconds))
        if self.stopped_early and not self.gone.is_set():
            self.context.abort(grpc.StatusCode.UNAVAILABLE,
                               "the server is shutting down; requests after the last result "
                               "were not read: send them again")
