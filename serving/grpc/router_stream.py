"""The ``ScoreStream`` forwarding of ``moejax router``: one client stream spread over
upstream streams.

Each ``ScoreStream`` call (a :class:`StreamSession`) opens (lazily) one upstream
``ScoreStream`` (an :class:`UpstreamStream`) per upstream it uses and forwards each
request, with its index, to its upstream, so upstream flow control and batching apply; at
most ``stream_window`` requests of a call are unanswered at once (the client is then
slowed by gRPC flow control). Results are matched back by index (two requests of one call
with the same index are told apart by arrival order only: give distinct indices).

Requests are routed as they arrive (one ``Router.assign`` call each). When an upstream
stream fails, what it still owes is retried once elsewhere, as one Router call, on fresh
streams. A request whose failure is not worth a retry, whose retry fails too, or that no
upstream can take (none serving: at once, never after a wait) ends the client's stream:
the router stops reading, forwards the results still coming from the other upstream
streams, and ends the call with the failure's status (UNAVAILABLE when no upstream
serves; else the last upstream's code and retry hint, as ``Score`` does), so the client
sends the unanswered requests again. An error result always means the request itself was
refused (by an upstream, or as undecodable), never that a transport failed: a client
writing results to a file must not keep an error for a request that was never scored.
The upstream timeout is the longest wait for the next result while results are owed
(:meth:`StreamSession.watch`). One gRPC limit: an upstream's refusal that crosses a write
of the router's reaches it as INTERNAL "Internal error from Core" (grpc/grpc#36066, the
asyncio client), so such a refusal is retried elsewhere like a transport failure.

Why a module of its own: a stream's bookkeeping (what each upstream stream owes, the
window, the answers' order) is apart from the unary and batch handlers
(:mod:`serving.grpc.router_service`, whose ``ScoreStream`` runs a :class:`StreamSession`).
Everything here runs on the router's event loop.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
from typing import TYPE_CHECKING, Any, AsyncIterator, Sequence

import grpc

from serving.grpc import convert, decoding, scoring_pb2 as pb
from serving.grpc.router_calls import RETRYABLE, Failure, Item, stamp
from serving.grpc.router_core import NoUpstream
from serving.requests import request_label

if TYPE_CHECKING:
    from serving.grpc.router_service import RouterService

log = logging.getLogger("moejax.grpc.router")

StatusCode = grpc.StatusCode

_WAKE = object()


class UpstreamStream:
    """One upstream ScoreStream call of a client's stream: requests go in as they are
    routed to it, results come back to the session; what it still owes when it fails goes
    back to the session for a retry."""

    def __init__(self, session: StreamSession, upstream: Any):
        self.session, self.upstream = session, upstream
        loop = asyncio.get_running_loop()
        self._now = loop.time
        self.requests: asyncio.Queue = asyncio.Queue()
        self.pending: dict[int, collections.deque[Item]] = {}
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

    def send(self, item: Item) -> None:
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

    def take_pending(self) -> list[Item]:
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


class StreamSession:
    """One client ScoreStream call (see the module docstring) of ``service``: ``read``
    routes the client's requests, ``results`` yields the answers, ``watch`` fails upstream
    streams that stall, ``close`` cancels what is left. ``failure``, once set, is why the
    call must end unfinished (:meth:`ending` is the status to end it with)."""

    def __init__(self, service: RouterService, context: Any):
        self.service, self.context = service, context
        self.core, self.pool = service.core, service.pool
        self.out: asyncio.Queue = asyncio.Queue()
        self.window = asyncio.Semaphore(service.stream_window)
        self.open: dict[int, UpstreamStream] = {}   # where first attempts go, per upstream
        self.streams: set[UpstreamStream] = set()   # every live upstream call
        self.unanswered = 0
        self.reading = True
        self.stopped_early = False
        self.failure: Failure | None = None   # a request no upstream could answer

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
                    item = Item(index, message.request)
                    try:
                        item.op = await self.service.prepare(message.request, index)
                        if self.failure is not None:
                            break      # the call ends: the client sends this one again
                        self.dispatch([item])
                    except Exception as exc:  # noqa: BLE001  (a bug: this request's alone)
                        log.exception("routing %s failed", item.label())
                        self._answer_error(item, f"not scored: the router failed: {exc!r}")
                position += 1
                if self.failure is not None:
                    break
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

    def dispatch(self, items: list[Item], exclude: Sequence[int] = ()) -> None:
        """Route ``items`` (one Router call) and send each to its upstream's stream; a
        retry (``exclude``: the upstream that failed) goes on fresh, closed streams. With
        no upstream to take them, the call ends UNAVAILABLE (:meth:`refuse`) at once."""
        try:
            routes = self.core.route([item.op for item in items], exclude=exclude)
        except NoUpstream:
            reason = "no other upstream is serving" if exclude else "no upstream is serving"
            self.refuse(items, Failure(StatusCode.UNAVAILABLE, reason, "router"))
            return
        fresh: dict[int, UpstreamStream] = {}
        for item, routed in zip(items, routes):
            item.routed = routed
            g = routed.upstream
            stream = fresh.get(g) if exclude or not self.reading else self.open.get(g)
            if stream is None or stream.closed or stream.task.done():
                stream = UpstreamStream(self, self.pool[g])
                self.streams.add(stream)
                (fresh if exclude or not self.reading else self.open)[g] = stream
            stream.send(item)
        for stream in fresh.values():
            stream.close()

    # ------------------------------------------------------------------ answers
    def answered(self, item: Item, result: pb.ScoreResult) -> None:
        self.core.finish(item.routed)
        self._answer(item.index, stamp(result, item.routed))

    def failed(self, stream: UpstreamStream, items: list[Item], failure: Failure) -> None:
        """``stream`` failed owing ``items``: retry each once elsewhere, or end the call
        (:meth:`refuse`) for those that cannot be retried."""
        g = stream.upstream.index
        for item in items:
            self.core.abandon(item.routed)
            item.failures.append(failure)
        self.service.note_failure(g, failure)
        retry = [item for item in items if self.failure is None
                 and failure.code in RETRYABLE and len(item.failures) < 2]
        log.warning("%s; %d requests of a stream retried elsewhere, %d not", failure.describe(),
                    len(retry), len(items) - len(retry))
        refused = [item for item in items if item not in retry]
        if refused:
            self.refuse(refused, failure)
        if retry:
            self.dispatch(retry, exclude=(g,))

    def refuse(self, items: list[Item], failure: Failure) -> None:
        """No upstream will answer ``items``: the call ends with ``failure`` (the first
        such failure of the call), once the other upstream streams delivered what they
        owe. ``items`` get no result: the client sends them again."""
        if self.failure is None:
            problems = [f.describe() for f in items[0].failures if f is not failure]
            why = failure.describe() if failure.upstream != "router" else failure.details
            self.failure = dataclasses.replace(failure, details="; ".join([*problems, why]))
            log.warning("a ScoreStream call ends (%s): %s; its %d unanswered requests are "
                        "left to the client to send again", failure.code.name,
                        self.failure.details, self.unanswered)
        self.out.put_nowait(_WAKE)

    def ending(self) -> Failure:
        """The status to end the call with after :meth:`refuse` (the client's cue to send
        its unanswered requests again)."""
        assert self.failure is not None
        return dataclasses.replace(self.failure, details=(
            f"{self.failure.details}; the requests of this stream that got no result "
            f"were not scored: send them again"))

    def ended(self, stream: UpstreamStream) -> None:
        self.streams.discard(stream)
        if self.open.get(stream.upstream.index) is stream:
            del self.open[stream.upstream.index]

    def _answer_error(self, item: Item, reason: str) -> None:
        self._answer(item.index, convert.result_to_proto(convert.error_result(
            convert.get_id(item.message), f"{item.label()}: {reason}")))

    def _answer(self, index: int, result: pb.ScoreResult) -> None:
        self.out.put_nowait(pb.StreamResult(index=index, result=result))

    async def results(self) -> AsyncIterator[pb.StreamResult]:
        """The answers as they come; after :meth:`refuse`, those still owed by the other
        upstream streams (no new requests are read), then the end."""
        while True:
            if self.failure is not None and not any(s.owed for s in self.streams):
                while not self.out.empty():
                    entry = self.out.get_nowait()
                    if entry is not _WAKE:
                        self.unanswered -= 1
                        yield entry
                return
            if not (self.reading or self.unanswered):
                return
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
