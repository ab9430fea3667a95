"""``moejax router``: one gRPC server in front of many ``moejax serve`` upstreams, speaking
the same ``moejax.v1`` API (Scoring, Generation, grpc.health.v1).

Why: one ``moejax serve`` is one model replica; more throughput means more replicas, and a
prefix-aware choice of replica per request keeps each prompt's KV cache hits on the replica
that holds them. The choice is Algorithm 1 of :mod:`serving.router` — the same Router
objects that spread ops over the engines of one Scorer — with one *engine* per upstream.

Per request (routed in arrival order; a ``ScoreBatch`` as one ``Router.assign`` call):

1. the request is validated and tokenized as a Scorer would (``serving.requests``, the
   model's own tokenizer; the router loads only the config and tokenizer, never weights)
   into its prefill ops; the first op (prompt + first candidate, ``prefix_len`` = the
   prompt) stands for the request: its block hashes are the prompt's, its cost is the
   bulk of the request's (siblings reuse the prompt upstream). A request the router cannot
   tokenize (invalid) is still forwarded — to the least loaded upstream — so its error
   result is exactly the upstream's;
2. the Router picks the upstream (prefix affinity, FLOP-aware load W_g, Θ saturation,
   spill) among those that take work (:mod:`serving.grpc.upstreams`: health SERVING, same
   model, no failed call since);
3. the request goes to that upstream unchanged; its answer comes back unchanged except
   ``timings.engines`` = [upstream index] and ``timings.rounds`` = [the router's round];
4. events go back to the Router: on an answer, ``BlocksStored`` (the prompt's blocks are in
   that upstream's cache now) and ``FlopsExecuted`` (its W_g decays by the cost charged);
   on a failure only ``FlopsExecuted`` and the release of the promised blocks.

Generation: a ``Generate`` call is routed by the same Router, its prompt being the op's
prefix (affinity pays: an upstream's Generator copies prompt blocks its Scorer cached);
when it ends only ``FlopsExecuted`` is fed back (a Generator stores no blocks there).

The Router, the op preparation and the shadow caches are
:class:`serving.grpc.upstreams.RoutingCore`; this module forwards calls and retries.

Cache contents (the choice made here): the router's own model of what it sent where. Each
upstream's cache is modelled as an LRU of block hashes (``ShadowCache``) bounded by
that upstream's real capacity (``prefix_cache_blocks`` of its ``ModelInfo.info_json``; 0
for a KV-cache-free upstream): blocks that fall out of the model are reported to the
Router as ``BlocksEvicted``, so affinity to prefixes the upstream has long evicted decays.
The model can be wrong (the upstream evicts in its own order, or restarts): that only
costs cache hits, never correctness — every answer is the upstream's. An upstream found
unreachable and back again is presumed restarted: its whole shadow is dropped.

Failures: a call that fails with a transport-level code (UNAVAILABLE, DEADLINE_EXCEEDED of
``--upstream-timeout``, an upstream-side CANCELLED, ABORTED, UNKNOWN, INTERNAL) or with
RESOURCE_EXHAUSTED is retried once on another upstream that takes work (chosen by the same
Router without the failed one); each request is answered exactly once. If the retry fails
too (or no other upstream serves): ``Score`` / ``Generate`` end with the last status (a
RESOURCE_EXHAUSTED keeps its ``retry-after-ms`` hint), a ``ScoreBatch`` call likewise
(a batch is answered whole, as by a server), a ``ScoreStream`` item gets an error result
naming both failures and the stream goes on. Other codes (INVALID_ARGUMENT,
UNAUTHENTICATED, ...) are passed through at once. A ``Generate`` stream is retried only
before its first token was forwarded. In a stream, the upstream timeout is the longest
wait for the next result while results are owed.

Streams: each ``ScoreStream`` call opens (lazily) one upstream ``ScoreStream`` per upstream
it uses and forwards each request, with its index, to its upstream, so upstream flow
control and batching apply; at most ``stream_window`` requests of a call are unanswered
at once (the client is then slowed by gRPC flow control). Results are matched back by
index (two requests of one call with the same index are told apart by arrival order only:
give distinct indices).

Threads: a ``grpc.aio`` server and ``grpc.aio`` upstream channels on the process's one gRPC
event loop (:func:`serving.grpc.server._server_loop`), routing state touched only there;
tokenizing runs on a small thread pool.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import dataclasses
import json
import logging
import math
import time
from typing import Any, AsyncIterator, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from moejax.config import ModelConfig
from moejax.ops import PrefillOp
from serving.grpc import convert, decoding, scoring_pb2 as pb
from serving.grpc.auth import BearerTokenInterceptor
# The server's handler tables take any object with the handler methods, and its one event
# loop per process is where every grpc.aio object of this process must live.
from serving.grpc.server import (_generation_handlers, _method_handlers, _server_loop,
                                 read_tls_files)
from serving.grpc.upstreams import (GENERATION_SERVICE, SCORING_SERVICE, NoUpstream, Routed,
                                    RoutingCore, UpstreamOptions, UpstreamPool, load_model,
                                    model_mismatch)
from serving.requests import TokenizerAdapter, renamed, request_label
from serving.router import PrefixAwareRouter

log = logging.getLogger("moejax.grpc.router")

StatusCode = grpc.StatusCode
# Failures worth one more try elsewhere (the request itself is fine).
RETRYABLE = frozenset({StatusCode.UNAVAILABLE, StatusCode.DEADLINE_EXCEEDED,
                       StatusCode.CANCELLED, StatusCode.ABORTED, StatusCode.UNKNOWN,
                       StatusCode.INTERNAL, StatusCode.RESOURCE_EXHAUSTED})
# Failures that say the upstream itself is in trouble: no new work until its next check.
SUSPECT = frozenset({StatusCode.UNAVAILABLE, StatusCode.DEADLINE_EXCEEDED})
HINT_KEYS = ("retry-after-ms", "grpc-retry-pushback-ms")


# ---------------------------------------------------------------------------- failures
@dataclasses.dataclass
class Failure:
    """A failed upstream call: its status, and where."""

    code: grpc.StatusCode
    details: str
    upstream: str
    hint: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(cls, exc: grpc.aio.AioRpcError, upstream: str) -> "Failure":
        hint = tuple((k, v) for k, v in (exc.trailing_metadata() or ())
                     if k in HINT_KEYS and isinstance(v, str))
        return cls(exc.code(), exc.details() or "", upstream, hint)

    def describe(self) -> str:
        return f"{self.upstream} failed: {self.code.name}: {self.details}"


class _CallFailed(Exception):
    def __init__(self, failure: Failure):
        super().__init__(failure.describe())
        self.failure = failure


async def abort_with(context: Any, failure: Failure) -> None:
    """End the call with ``failure``'s status, details and retry hint (as the upstream
    ended it)."""
    if failure.hint:
        context.set_trailing_metadata(failure.hint)
    await context.abort(failure.code, failure.details)


def stamp(result: pb.ScoreResult, routed: Routed) -> pb.ScoreResult:
    """Say which upstream (and router round) served a scored result."""
    if result.HasField("timings"):
        del result.timings.engines[:]
        result.timings.engines.append(routed.upstream)
        del result.timings.rounds[:]
        result.timings.rounds.append(routed.assignment.round if routed.assignment else 0)
    return result


# ---------------------------------------------------------------------------- streams
_WAKE = object()


@dataclasses.dataclass(eq=False)
class _Item:
    """One request of a call on its way through the router."""

    index: int
    message: pb.ScoreRequest
    op: PrefillOp | None = None
    routed: Routed | None = None
    failures: list[Failure] = dataclasses.field(default_factory=list)

    def label(self) -> str:
        return request_label(convert.get_id(self.message), self.index)


class _UpstreamStream:
    """One upstream ScoreStream call of a client's stream: requests go in as they are
    routed to it, results come back to the session; what it still owes when it fails goes
    back to the session for a retry."""

    def __init__(self, session: "_StreamSession", upstream: Any):
        self.session, self.upstream = session, upstream
        loop = asyncio.get_running_loop()
        self._now = loop.time
        self.requests: asyncio.Queue = asyncio.Queue()
        self.pending: dict[int, collections.deque[_Item]] = {}
        self.owed = 0
        self.last = self._now()
        self.closed = self.timed_out = False
        self.call = upstream.scoring.ScoreStream(self._messages(), metadata=upstream.metadata,
                                                 timeout=session.service.remaining(
                                                     session.context))
        self.task = asyncio.create_task(self._read())

    async def _messages(self) -> AsyncIterator[pb.StreamRequest]:
        while (message := await self.requests.get()) is not None:
            yield message

    def send(self, item: _Item) -> None:
        if not self.owed:
            self.last = self._now()   # the timeout counts from the first result owed
        self.pending.setdefault(item.index, collections.deque()).append(item)
        self.owed += 1
        self.requests.put_nowait(pb.StreamRequest(request=item.message, index=item.index))

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.requests.put_nowait(None)

    def overdue(self, timeout: float) -> bool:
        return self.owed > 0 and self._now() - self.last > timeout

    def take_pending(self) -> list[_Item]:
        items = [item for queue in self.pending.values() for item in queue]
        self.pending.clear()
        self.owed = 0
        return items

    async def _read(self) -> None:
        failure = None
        name = self.upstream.describe()
        try:
            async for response in self.call:
                queue = self.pending.get(response.index)
                if not queue:
                    log.warning("%s answered index %d, which it does not owe", name,
                                response.index)
                    continue
                item = queue.popleft()
                if not queue:
                    del self.pending[response.index]
                self.owed -= 1
                self.last = self._now()
                self.session.answered(item, response.result)
            if self.owed:
                failure = Failure(StatusCode.UNAVAILABLE, f"the stream ended without "
                                  f"{self.owed} results", name)
        except asyncio.CancelledError:
            if not self.timed_out:
                raise
            failure = Failure(StatusCode.DEADLINE_EXCEEDED, f"no result for "
                              f"{self.session.service.upstreams.timeout:g} s", name)
        except grpc.aio.AioRpcError as exc:
            failure = (Failure(StatusCode.DEADLINE_EXCEEDED, "no result in time", name)
                       if self.timed_out else Failure.of(exc, name))
        finally:
            self.close()          # ends the request iterator (a failed call reads no more)
            self.session.ended(self)
        if failure is not None and self.owed:
            self.session.failed(self, self.take_pending(), failure)


class _StreamSession:
    """One client ScoreStream call (see the module docstring, "Streams")."""

    def __init__(self, service: "RouterService", context: Any):
        self.service, self.context = service, context
        self.core, self.pool = service.core, service.pool
        self.out: asyncio.Queue = asyncio.Queue()
        self.window = asyncio.Semaphore(service.stream_window)
        self.open: dict[int, _UpstreamStream] = {}   # where first attempts go, per upstream
        self.streams: set[_UpstreamStream] = set()   # every live upstream call
        self.unanswered = 0
        self.reading = True
        self.stopped_early = False

    # ------------------------------------------------------------------ reading
    async def read(self, messages: Any) -> None:
        position = 0
        incoming = messages.__aiter__()
        try:
            while True:
                await self.window.acquire()    # one slot per unanswered request
                try:
                    message = await incoming.__anext__()
                except StopAsyncIteration:
                    self.window.release()
                    break
                self.unanswered += 1
                if isinstance(message, decoding.Undecodable):
                    lenient = message.lenient
                    index = (lenient.index if lenient is not None and lenient.HasField("index")
                             else position)
                    request_id = message.request_id("request")
                    self._answer(index, convert.result_to_proto(convert.error_result(
                        request_id, f"{request_label(request_id, index)}: "
                                    f"{message.describe('request.')}")))
                else:
                    index = message.index if message.HasField("index") else position
                    item = _Item(index, message.request)
                    try:
                        item.op = await self.service.prepare(message.request, index)
                        if not self.pool.available():
                            await self.pool.wait_available(self.service.upstreams.timeout)
                        self.dispatch([item])
                    except Exception as exc:  # noqa: BLE001  (a bug: this request's alone)
                        log.exception("routing %s failed", item.label())
                        self._give_up(item, f"the router failed: {exc!r}")
                position += 1
                if self.service.stopping:
                    self.stopped_early = True
                    break
        except asyncio.CancelledError:
            raise
        except Exception:  # noqa: BLE001  (the client cancelled or the connection broke)
            pass
        finally:
            self.reading = False
            for stream in self.open.values():
                stream.close()
            self.open.clear()
            self.out.put_nowait(_WAKE)

    def dispatch(self, items: list[_Item], exclude: Sequence[int] = ()) -> None:
        """Route ``items`` (one Router call) and send each to its upstream's stream; a
        retry (``exclude``: the upstream that failed) goes on fresh, closed streams."""
        try:
            routes = self.core.route([item.op for item in items], exclude=exclude)
        except NoUpstream:
            for item in items:
                self._give_up(item, "no other upstream is serving" if exclude
                              else "no upstream is serving")
            return
        fresh: dict[int, _UpstreamStream] = {}
        for item, routed in zip(items, routes):
            item.routed = routed
            g = routed.upstream
            stream = fresh.get(g) if exclude or not self.reading else self.open.get(g)
            if stream is None or stream.closed or stream.task.done():
                stream = _UpstreamStream(self, self.pool[g])
                self.streams.add(stream)
                (fresh if exclude or not self.reading else self.open)[g] = stream
            stream.send(item)
        for stream in fresh.values():
            stream.close()

    # ------------------------------------------------------------------ answers
    def answered(self, item: _Item, result: pb.ScoreResult) -> None:
        self.core.finish(item.routed)
        self._answer(item.index, stamp(result, item.routed))

    def failed(self, stream: _UpstreamStream, items: list[_Item], failure: Failure) -> None:
        """``stream`` failed owing ``items``: retry each once elsewhere, or answer it with
        the error."""
        g = stream.upstream.index
        for item in items:
            self.core.abandon(item.routed)
            item.failures.append(failure)
        self.service.note_failure(g, failure)
        retry = [item for item in items
                 if failure.code in RETRYABLE and len(item.failures) < 2]
        log.warning("%s; %d requests of a stream retried elsewhere, %d answered with the "
                    "error", failure.describe(), len(retry), len(items) - len(retry))
        for item in items:
            if item not in retry:
                self._give_up(item)
        if retry:
            self.dispatch(retry, exclude=(g,))

    def ended(self, stream: _UpstreamStream) -> None:
        self.streams.discard(stream)
        if self.open.get(stream.upstream.index) is stream:
            del self.open[stream.upstream.index]

    def _give_up(self, item: _Item, reason: str | None = None) -> None:
        problems = [f.describe() for f in item.failures] + ([reason] if reason else [])
        self._answer(item.index, convert.result_to_proto(convert.error_result(
            convert.get_id(item.message), f"{item.label()}: not scored: "
                                          f"{'; '.join(problems)}")))

    def _answer(self, index: int, result: pb.ScoreResult) -> None:
        self.out.put_nowait(pb.StreamResult(index=index, result=result))

    async def results(self) -> AsyncIterator[pb.StreamResult]:
        while self.reading or self.unanswered:
            entry = await self.out.get()
            if entry is _WAKE:
                continue
            self.unanswered -= 1
            self.window.release()
            yield entry

    async def watch(self, timeout: float) -> None:
        """Fail upstream streams that owe results and sent none for ``timeout`` s."""
        while True:
            await asyncio.sleep(min(1.0, timeout / 4))
            for stream in list(self.streams):
                if stream.overdue(timeout) and not stream.timed_out:
                    stream.timed_out = True
                    stream.call.cancel()
                    stream.task.cancel()

    async def close(self) -> None:
        """The client is gone (or the call ended): cancel what is still running."""
        for stream in list(self.streams):
            stream.call.cancel()
            stream.task.cancel()
            for item in stream.take_pending():
                self.core.abandon(item.routed)
        await asyncio.gather(*(s.task for s in self.streams), return_exceptions=True)


# ---------------------------------------------------------------------------- the service
class RouterService:
    """The Scoring and Generation handlers of the router (asyncio)."""

    def __init__(self, core: RoutingCore, pool: UpstreamPool, upstreams: UpstreamOptions,
                 *, workers: int = 2, stream_window: int = 1024, model_name: str = ""):
        self.core, self.pool, self.upstreams = core, pool, upstreams
        self.stream_window = stream_window
        self.model_name = model_name
        self.stopping = False
        self.in_flight = 0
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix="moejax-router-prepare")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ helpers
    async def prepare(self, message: pb.ScoreRequest, index: int) -> PrefillOp | None:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self.core.prepare, message, index)

    async def prepare_many(self, items: Sequence[_Item]) -> None:
        loop = asyncio.get_running_loop()
        ops = await loop.run_in_executor(
            self._pool, lambda: [self.core.prepare(i.message, i.index) for i in items])
        for item, op in zip(items, ops):
            item.op = op

    def remaining(self, context: Any) -> float | None:
        """The client's remaining time (None: no deadline)."""
        remaining = context.time_remaining()
        return None if remaining is None else max(0.0, remaining)

    def timeout(self, context: Any) -> float:
        """An upstream call's timeout: ``--upstream-timeout``, within the client's deadline."""
        remaining = self.remaining(context)
        return self.upstreams.timeout if remaining is None else min(self.upstreams.timeout,
                                                                    remaining)

    def note_failure(self, index: int, failure: Failure) -> None:
        if failure.code in SUSPECT:
            self.pool.suspect(index, f"{failure.code.name}: {failure.details}",
                              lost=failure.code == StatusCode.UNAVAILABLE)

    def _failure(self, exc: grpc.aio.AioRpcError, g: int, context: Any) -> Failure:
        failure = Failure.of(exc, self.pool[g].describe())
        if failure.code == StatusCode.DEADLINE_EXCEEDED and self.remaining(context) == 0:
            return failure          # the client's own deadline: the upstream is not at fault
        self.note_failure(g, failure)
        return failure

    async def _enter(self, context: Any) -> None:
        if self.stopping:
            await context.abort(StatusCode.UNAVAILABLE, "the router is shutting down")

    # ------------------------------------------------------------------ Score
    async def Score(self, message: Any, context: Any) -> pb.ScoreResult:
        await self._enter(context)
        if isinstance(message, decoding.Undecodable):
            await context.abort(StatusCode.INVALID_ARGUMENT,
                                f"{request_label(message.request_id(), 0)}: "
                                f"{message.describe()}")
        self.in_flight += 1
        try:
            item = _Item(0, message)
            item.op = await self.prepare(message, 0)
            exclude: list[int] = []
            while True:
                try:
                    routed = self.core.route([item.op], exclude=exclude)[0]
                except NoUpstream:
                    if item.failures:
                        await abort_with(context, item.failures[-1])
                    await context.abort(StatusCode.UNAVAILABLE, "no upstream is serving")
                upstream = self.pool[routed.upstream]
                try:
                    result = await upstream.scoring.Score(message, timeout=self.timeout(context),
                                                          metadata=upstream.metadata)
                except grpc.aio.AioRpcError as exc:
                    self.core.abandon(routed)
                    failure = self._failure(exc, routed.upstream, context)
                    item.failures.append(failure)
                    if failure.code not in RETRYABLE or len(item.failures) > 1:
                        await abort_with(context, failure)
                    exclude.append(routed.upstream)
                    continue
                except BaseException:
                    self.core.abandon(routed)
                    raise
                self.core.finish(routed)
                return stamp(result, routed)
        finally:
            self.in_flight -= 1

    # ------------------------------------------------------------------ ScoreBatch
    async def ScoreBatch(self, batch: Any, context: Any) -> pb.ScoreBatchResponse:
        await self._enter(context)
        if isinstance(batch, decoding.Undecodable):
            await context.abort(StatusCode.INVALID_ARGUMENT, batch.describe())
        self.in_flight += 1
        try:
            results: list[pb.ScoreResult | None] = [None] * len(batch)
            todo = []
            for index, message in enumerate(batch):
                if isinstance(message, decoding.Undecodable):
                    request_id = message.request_id()
                    results[index] = convert.result_to_proto(convert.error_result(
                        request_id, f"{request_label(request_id, index)}: "
                                    f"{message.describe()}"))
                else:
                    todo.append(_Item(index, message))
            await self.prepare_many(todo)
            try:
                if todo:
                    await self._batch(todo, results, (), context)
            except _CallFailed as failed:
                await abort_with(context, failed.failure)
            return pb.ScoreBatchResponse(results=results)
        finally:
            self.in_flight -= 1

    async def _batch(self, items: list[_Item], results: list[Any], exclude: Sequence[int],
                     context: Any) -> None:
        """Route ``items`` in one Router call; one upstream ScoreBatch per upstream."""
        try:
            routes = self.core.route([item.op for item in items], exclude=exclude)
        except NoUpstream:
            failure = items[0].failures[-1] if items[0].failures else Failure(
                StatusCode.UNAVAILABLE, "no upstream is serving", "router")
            raise _CallFailed(failure) from None
        groups: dict[int, list[_Item]] = {}
        for item, routed in zip(items, routes):
            item.routed = routed
            groups.setdefault(routed.upstream, []).append(item)
        outcomes = await asyncio.gather(*(self._group(g, group, results, exclude, context)
                                          for g, group in groups.items()),
                                        return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome

    async def _group(self, g: int, group: list[_Item], results: list[Any],
                     exclude: Sequence[int], context: Any) -> None:
        upstream = self.pool[g]
        try:
            response = await upstream.scoring.ScoreBatch(
                pb.ScoreBatchRequest(requests=[item.message for item in group]),
                timeout=self.timeout(context), metadata=upstream.metadata)
            if len(response.results) != len(group):
                raise _CallFailed(Failure(StatusCode.INTERNAL, f"answered "
                                          f"{len(response.results)} of {len(group)} requests",
                                          upstream.describe()))
        except grpc.aio.AioRpcError as exc:
            for item in group:
                self.core.abandon(item.routed)
            failure = self._failure(exc, g, context)
            for item in group:
                item.failures.append(failure)
            if failure.code in RETRYABLE and not exclude:
                await self._batch(group, results, (g,), context)
                return
            raise _CallFailed(failure) from None
        except BaseException:
            for item in group:
                self.core.abandon(item.routed)
            raise
        for position, (item, result) in enumerate(zip(group, response.results)):
            self.core.finish(item.routed)
            if result.HasField("error") and position != item.index:
                # The upstream named an id-less request by its place in the sub-batch.
                result.error = renamed(result.error, position, request_label(None, item.index))
            results[item.index] = stamp(result, item.routed)

    # ------------------------------------------------------------------ ScoreStream
    async def ScoreStream(self, messages: Any, context: Any) -> AsyncIterator[pb.StreamResult]:
        await self._enter(context)
        self.in_flight += 1
        session = _StreamSession(self, context)
        reader = asyncio.ensure_future(session.read(messages))
        watchdog = asyncio.ensure_future(session.watch(self.upstreams.timeout))
        try:
            async for result in session.results():
                yield result
        finally:
            reader.cancel()
            watchdog.cancel()
            await session.close()
            self.in_flight -= 1
        if session.stopped_early:
            await context.abort(StatusCode.UNAVAILABLE,
                                "the router is shutting down; requests after the last result "
                                "were not read: send them again")

    # ------------------------------------------------------------------ ModelInfo
    async def ModelInfo(self, request: pb.ModelInfoRequest, context: Any
                        ) -> pb.ModelInfoResponse:
        serving = self.pool.available()
        if not serving:
            await context.abort(StatusCode.UNAVAILABLE, "no upstream is serving")
        info = pb.ModelInfoResponse()
        info.CopyFrom(self.pool[serving[0]].info)
        info.engines = len(self.pool)
        info.backend = "router"
        info.generation = bool(self.pool.available(generation=True))
        try:
            details = json.loads(info.info_json or "{}")
        except ValueError:
            details = {}
        details.update(backend="router", engines=len(self.pool),
                       routing=self.core.router.name, upstreams_serving=len(serving),
                       upstream_backend=details.get("backend"))
        info.info_json = json.dumps(details, default=str, sort_keys=True)
        return info

    # ------------------------------------------------------------------ Generate
    async def Generate(self, message: Any, context: Any) -> AsyncIterator[pb.GenerateResponse]:
        await self._enter(context)
        if isinstance(message, decoding.Undecodable):
            await context.abort(StatusCode.INVALID_ARGUMENT,
                                f"{request_label(message.request_id(), 0)}: "
                                f"{message.describe()}")
        self.in_flight += 1
        try:
            loop = asyncio.get_running_loop()
            op = await loop.run_in_executor(self._pool, self.core.prepare_generation, message)
            failures: list[Failure] = []
            exclude: list[int] = []
            while True:
                try:
                    routed = self.core.route([op], exclude=exclude, generation=True)[0]
                except NoUpstream:
                    if failures:
                        await abort_with(context, failures[-1])
                    await context.abort(StatusCode.UNAVAILABLE,
                                        "no upstream is serving generation")
                upstream = self.pool[routed.upstream]
                call = upstream.generation.Generate(message, timeout=self.remaining(context),
                                                    metadata=upstream.metadata)
                sent = 0
                try:
                    while True:
                        try:
                            response = await asyncio.wait_for(call.read(),
                                                              self.upstreams.timeout)
                        except asyncio.TimeoutError:
                            call.cancel()
                            raise _CallFailed(Failure(
                                StatusCode.DEADLINE_EXCEEDED, f"no tokens for "
                                f"{self.upstreams.timeout:g} s", upstream.describe())) from None
                        if response is grpc.aio.EOF:
                            break
                        yield response
                        sent += 1
                except (grpc.aio.AioRpcError, _CallFailed) as exc:
                    self.core.abandon(routed)
                    failure = (exc.failure if isinstance(exc, _CallFailed)
                               else self._failure(exc, routed.upstream, context))
                    if isinstance(exc, _CallFailed):
                        self.note_failure(routed.upstream, failure)
                    failures.append(failure)
                    if sent or failure.code not in RETRYABLE or len(failures) > 1:
                        await abort_with(context, failure)
                    exclude.append(routed.upstream)
                    continue
                except BaseException:
                    call.cancel()
                    self.core.abandon(routed)
                    raise
                self.core.finish(routed, stored=False)
                return
        finally:
            self.in_flight -= 1


# ---------------------------------------------------------------------------- the server
@dataclasses.dataclass
class RouterOptions:
    """``moejax router`` settings. ``upstreams``: "HOST:PORT" targets. ``model``: the
    upstreams' model (dir or built-in name: config and tokenizer only). ``routing``: a
    ``serving.router.ROUTER_NAMES`` name. ``theta``: Θ in FLOPs (default: the first
    upstream's calibrated Θ, else one full batch of its ``max_batch_tokens``). ``token``,
    ``tls_cert``, ``tls_key``: toward clients, as ``moejax serve``. ``upstream``: toward the
    upstreams. ``startup_timeout``: how long :meth:`RouterServer.check_upstreams` waits for
    every upstream's ModelInfo."""

    upstreams: Sequence[str]
    model: str = "demo"
    host: str = "127.0.0.1"
    port: int = 50050
    routing: str = "prefix"
    theta: float | None = None
    seed: int = 0
    token: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    upstream: UpstreamOptions = dataclasses.field(default_factory=UpstreamOptions)
    max_message_mib: float = 16.0
    workers: int = 2
    stream_window: int = 1024
    grace_seconds: float = 30.0
    startup_timeout: float = 60.0

    def __post_init__(self) -> None:
        from serving.router import ROUTER_NAMES

        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("TLS needs both a certificate (--tls-cert) and a key (--tls-key)")
        if self.routing not in ROUTER_NAMES:
            raise ValueError(f"unknown routing {self.routing!r}: choose one of "
                             f"{', '.join(ROUTER_NAMES)}")
        if self.theta is not None and not self.theta >= 0:
            raise ValueError(f"theta must be >= 0 FLOPs, got {self.theta}")
        if min(self.max_message_mib, self.workers, self.stream_window) <= 0:
            raise ValueError("max_message_mib, workers and stream_window must be positive")
        if self.token is not None and not self.token:
            raise ValueError("the auth token must not be empty")

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host
        return f"{host}:{self.port}"


class RouterServer:
    """The router's gRPC server (module docstring). ``start`` binds and starts watching the
    upstreams; ``check_upstreams`` waits for their ModelInfo; ``stop`` drains. Its methods
    are called from ordinary threads; the server runs on the process's gRPC loop."""

    def __init__(self, options: RouterOptions, *, model: tuple[ModelConfig, TokenizerAdapter,
                                                                  str] | None = None):
        self.options = options
        self.config, self.tokenizer, self.model_name = model or load_model(options.model)
        self.port: int | None = None
        self.pool: UpstreamPool | None = None
        self.core: RoutingCore | None = None
        self.service: RouterService | None = None
        self._health: Any = None
        self._server: grpc.aio.Server | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._theta_set = options.theta is not None

    def _run(self, coroutine: Any, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    def start(self) -> int:
        """Bind, serve health (NOT_SERVING until an upstream serves), watch the upstreams;
        returns the bound port."""
        opts = self.options
        credentials = None
        if opts.tls_cert is not None:
            key, cert = read_tls_files(opts.tls_cert, opts.tls_key)
            credentials = grpc.ssl_server_credentials([(key, cert)])
        opts.upstream.credentials()     # an unreadable CA fails here, before binding
        self._loop = _server_loop()
        self.port = self._run(self._start(credentials))
        log.info("router listening on %s:%d (%s, %s) over %d upstreams, %s routing",
                 opts.host, self.port, "TLS" if credentials else "plaintext",
                 "bearer-token auth" if opts.token else "no auth", len(opts.upstreams),
                 opts.routing)
        return self.port

    async def _start(self, credentials: grpc.ServerCredentials | None) -> int:
        opts = self.options
        self.pool = UpstreamPool(opts.upstreams, opts.upstream, check_model=self._check_model,
                                 on_change=self._on_change, on_reset=self._on_reset)
        theta = opts.theta if opts.theta is not None else math.inf
        self.core = RoutingCore(self.config, self.tokenizer, self.pool, opts.routing, theta,
                                opts.seed)
        self.service = RouterService(self.core, self.pool, opts.upstream, workers=opts.workers,
                                     stream_window=opts.stream_window,
                                     model_name=self.model_name)
        services = [f"/{SCORING_SERVICE}/", f"/{GENERATION_SERVICE}/"]
        server = grpc.aio.server(
            interceptors=[BearerTokenInterceptor(opts.token, services)] if opts.token else [],
            options=[("grpc.max_receive_message_length", int(opts.max_message_mib * (1 << 20))),
                     ("grpc.so_reuseport", 0)])
        server.add_generic_rpc_handlers((_method_handlers(self.service),
                                         _generation_handlers(self.service)))
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        reflection.enable_server_reflection(
            (SCORING_SERVICE, GENERATION_SERVICE,
             health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME), server)
        await self._publish_health()
        try:
            port = (server.add_secure_port(opts.address, credentials) if credentials
                    else server.add_insecure_port(opts.address))
        except RuntimeError as exc:
            raise OSError(f"cannot listen on {opts.address}: {exc}") from exc
        if port == 0:
            raise OSError(f"cannot listen on {opts.address}")
        await server.start()
        self._server = server
        await self.pool.open()
        return port

    def check_upstreams(self, timeout: float | None = None) -> tuple[list[str], list[str]]:
        """Wait (up to ``timeout``, default ``startup_timeout``) for every upstream's
        ModelInfo -> (refused, silent): the upstreams of another model (or refusing the
        router's credentials), and those that did not answer in time, as messages."""
        timeout = self.options.startup_timeout if timeout is None else timeout
        silent = self._run(self.pool.wait_checked(timeout))
        refused = [f"{u.describe()}: {u.mismatch}" for u in self.pool.upstreams
                   if u.mismatch is not None]
        return refused, [f"{u.describe()}: no ModelInfo yet (down or still loading)"
                         for u in silent]

    def upstream_states(self) -> list[dict[str, Any]]:
        """Per upstream: target, serving, model problem (for logs and tests)."""
        return [{"target": u.target, "serving": u.serving, "mismatch": u.mismatch}
                for u in self.pool.upstreams]

    def _check_model(self, info: pb.ModelInfoResponse) -> str | None:
        return model_mismatch(self.config, info)

    def _on_change(self) -> None:
        for upstream in self.pool.upstreams:
            if upstream.info is not None and upstream.mismatch is None:
                self.core.set_capacity(upstream.index, upstream.info)
                self._adopt_theta(upstream.info)
        asyncio.ensure_future(self._publish_health())

    def _on_reset(self, index: int) -> None:
        upstream = self.pool[index]
        log.info("%s is back: forgetting what was cached there", upstream.describe())
        self.core.reset(index)
        if upstream.info is not None:
            self.core.set_capacity(index, upstream.info)

    def _adopt_theta(self, info: pb.ModelInfoResponse) -> None:
        """Θ of the first upstream seen, unless --theta pinned it."""
        if self._theta_set or not isinstance(self.core.router, PrefixAwareRouter):
            return
        from moejax.calibrate import fallback_theta

        theta = (info.theta_flops if info.HasField("theta_flops") and info.theta_flops > 0
                 else fallback_theta(self.config, info.max_batch_tokens or 4096))
        self.core.router.set_theta(theta)
        self._theta_set = True
        log.info("routing with Θ = %.3g FLOPs (%s)", theta,
                 "the upstream's calibrated Θ" if info.HasField("theta_flops")
                 else "one batch of the upstream's max_batch_tokens")

    async def _publish_health(self) -> None:
        if self._health is None:
            return
        serving = health_pb2.HealthCheckResponse.SERVING
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        scoring = bool(self.pool and self.pool.available()) and not self.service.stopping
        generation = bool(self.pool and self.pool.available(generation=True)) and scoring
        for name in ("", SCORING_SERVICE):
            await self._health.set(name, serving if scoring else not_serving)
        await self._health.set(GENERATION_SERVICE, serving if generation else not_serving)

    def stop(self, grace: float | None = None) -> None:
        """Health NOT_SERVING, refuse new calls, let in-flight ones finish within ``grace``
        seconds (default ``grace_seconds``), close the upstream channels."""
        if self._server is None:
            return
        grace = self.options.grace_seconds if grace is None else grace
        self.service.stopping = True
        self._run(self._stop(grace))
        self.service.close()
        self._server = None
        log.info("router stopped")

    async def _stop(self, grace: float) -> None:
        await self._health.enter_graceful_shutdown()
        deadline = time.monotonic() + grace
        while self.service.in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        await self._server.stop(0)
        await self.pool.close()
