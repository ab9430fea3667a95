"""The handlers of ``moejax router`` (``moejax.v1`` Scoring and Generation, asyncio): each
call is routed (:class:`serving.grpc.router_core.RoutingCore`), forwarded to its upstream
unchanged, retried once elsewhere on a transport-level failure, and answered exactly once.

* ``Score`` — one request, one upstream ``Score``;
* ``ScoreBatch`` — the batch routed in one Router call, one upstream ``ScoreBatch`` per
  upstream chosen; a group whose upstream fails with a retryable code is routed again,
  once, without that upstream; the batch is answered whole, or the call ends with the
  failure;
* ``ScoreStream`` — a :class:`serving.grpc.router_stream.StreamSession`; a request no
  upstream can answer (after the one retry, or none serving) ends the call with a status
  (UNAVAILABLE, or the upstream's), never with an error result, and the client resends;
* ``ModelInfo`` — the first serving upstream's, as a router (``backend`` "router",
  ``engines`` = the upstreams, ``generation`` while some upstream generates);
* ``Generate`` — routed by its prompt, retried only before its first token was forwarded.

The failure policy is :mod:`serving.grpc.upstream_router`'s ("Failures"); its parts shared
with the streams are :mod:`serving.grpc.router_calls`. Why a module of its own: the handlers
are the router's forwarding; the server around them (options, binding, health, theta) is
:class:`serving.grpc.upstream_router.RouterServer`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
from typing import Any, AsyncIterator, Sequence

import grpc

from moejax.ops import PrefillOp
from serving.grpc import convert, decoding, scoring_pb2 as pb
from serving.grpc.router_calls import (RETRYABLE, SUSPECT, CallFailed, Failure, Item,
                                       abort_with, stamp)
from serving.grpc.router_core import NoUpstream, RoutingCore
from serving.grpc.router_stream import StreamSession
from serving.grpc.upstreams import UpstreamOptions, UpstreamPool
from serving.requests import renamed, request_label

StatusCode = grpc.StatusCode


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

    async def prepare_many(self, items: Sequence[Item]) -> None:
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

    async def _enter(self, context: Any, message: Any = None) -> None:
        """Refuse a call while the router stops, and a unary call whose request could not
        be decoded (``message``: a ``decoding.Undecodable``), naming it as a server does."""
        if self.stopping:
            await context.abort(StatusCode.UNAVAILABLE, "the router is shutting down")
        if isinstance(message, decoding.Undecodable):
            await context.abort(StatusCode.INVALID_ARGUMENT,
                                f"{request_label(message.request_id(), 0)}: "
                                f"{message.describe()}")

    # ------------------------------------------------------------------ Score
    async def Score(self, message: Any, context: Any) -> pb.ScoreResult:
        await self._enter(context, message)
        self.in_flight += 1
        try:
            item = Item(0, message)
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
                    todo.append(Item(index, message))
            await self.prepare_many(todo)
            try:
                if todo:
                    await self._batch(todo, results, (), context)
            except CallFailed as failed:
                await abort_with(context, failed.failure)
            return pb.ScoreBatchResponse(results=results)
        finally:
            self.in_flight -= 1

    async def _batch(self, items: list[Item], results: list[Any], exclude: Sequence[int],
                     context: Any) -> None:
        """Route ``items`` in one Router call; one upstream ScoreBatch per upstream."""
        try:
            routes = self.core.route([item.op for item in items], exclude=exclude)
        except NoUpstream:
            failure = items[0].failures[-1] if items[0].failures else Failure(
                StatusCode.UNAVAILABLE, "no upstream is serving", "router")
            raise CallFailed(failure) from None
        groups: dict[int, list[Item]] = {}
        for item, routed in zip(items, routes):
            item.routed = routed
            groups.setdefault(routed.upstream, []).append(item)
        outcomes = await asyncio.gather(*(self._group(g, group, results, exclude, context)
                                          for g, group in groups.items()),
                                        return_exceptions=True)
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome

    async def _group(self, g: int, group: list[Item], results: list[Any],
                     exclude: Sequence[int], context: Any) -> None:
        upstream = self.pool[g]
        try:
            response = await upstream.scoring.ScoreBatch(
                pb.ScoreBatchRequest(requests=[item.message for item in group]),
                timeout=self.timeout(context), metadata=upstream.metadata)
            if len(response.results) != len(group):
                raise CallFailed(Failure(StatusCode.INTERNAL, f"answered "
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
            raise CallFailed(failure) from None
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
        session = StreamSession(self, context)
        reader = asyncio.ensure_future(session.read(messages))
        watchdog = asyncio.ensure_future(session.watch(self.upstreams.timeout))
        try:
            async for result in session.results():
                yield result
        finally:
            reader.cancel()
            watchdog.cancel()
            # Awaited: a task the loop drops unfinished at exit is logged as "destroyed
            # but pending".
            await asyncio.gather(reader, watchdog, return_exceptions=True)
            await session.close()
            self.in_flight -= 1
        if session.failure is not None:
            # Some request could not be served: the client must send it (and every other
            # unanswered one) again, which an error result would never make it do.
            await abort_with(context, session.ending())
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
        await self._enter(context, message)
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
                            raise CallFailed(Failure(
                                StatusCode.DEADLINE_EXCEEDED, f"no tokens for "
                                f"{self.upstreams.timeout:g} s", upstream.describe())) from None
                        if response is grpc.aio.EOF:
                            break
                        yield response
                        sent += 1
                except (grpc.aio.AioRpcError, CallFailed) as exc:
                    self.core.abandon(routed)
                    failure = (exc.failure if isinstance(exc, CallFailed)
                               else self._failure(exc, routed.upstream, context))
                    if isinstance(exc, CallFailed):
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
