"""The RPC handler of ``moejax.v1.Generation`` (asyncio): one request in, its tokens out
as a server stream, over a :class:`serving.generate.GeneratorLoop` shared by every call.

Threads: the handler runs on the server's event loop and does only cheap things there
(size checks, the admission decision, waiting for events). Validation and tokenization
(``GeneratorLoop.submit``) run on a small thread pool; the model runs on the generator
loop's own thread, whose ``on_event`` callbacks hand the events to the event loop
(``call_soon_threadsafe``). Every call's sequence joins the one continuous batch.

A stream sends one message per scheduler step with the step's new tokens (a few steps'
tokens together when the client reads slower than the model generates); the last message
also carries ``finish_reason``, ``text``, ``prompt_tokens`` and ``id``. Over the whole
stream the tokens are ``GenerationResult.token_ids`` of :meth:`serving.Generator.generate`.

Admission: at most ``max_streams`` generation streams at once, counted from admission
until their sequence has left the scheduler (finished, or dropped after a cancel); beyond,
``RESOURCE_EXHAUSTED`` with a retry hint (the soonest a running sequence should end, from
the measured time per token). A client that cancels or disconnects, and a call whose
deadline passes, has its sequence cancelled: its KV blocks are freed at the next step.

Status codes:

* ``INVALID_ARGUMENT`` — an invalid request (the message names the request and the field,
  as ``serving.Generator`` does: ``"request 'ID': temperature: must be >= 0 ..."``), a
  prompt over the server's size limits (checked before tokenizing), or text that is not
  UTF-8.
* ``RESOURCE_EXHAUSTED`` — ``max_streams`` streams are running; the trailing metadata
  ``retry-after-ms`` (and ``grpc-retry-pushback-ms``, and the message) say when to retry.
* ``DEADLINE_EXCEEDED`` — the deadline passed; the sequence was cancelled (the tokens sent
  before stand).
* ``UNAVAILABLE`` — the model is still loading, or the server is shutting down (a stream
  still running when the grace period ends is cancelled with this code).
* ``INTERNAL`` — the generation step failed.
* ``UNIMPLEMENTED`` — (from gRPC) the server does not serve generation
  (``moejax serve --no-generation``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from typing import Any, AsyncIterator, Awaitable, Callable

import grpc

from serving.grpc import convert, decoding, scoring_pb2 as pb
from serving.grpc.service import Refused, call_deadline, refuse
from serving.requests import RequestError, request_label

GENERATION_SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name
STREAMS_PER_BATCH_ROW = 4      # default max_streams: this many x the generator's batch size
DEFAULT_TOKEN_SECONDS = 0.05   # the retry hint's time per token before any was measured
TOKEN_SECONDS_WEIGHT = 0.1     # weight of a new measurement in the moving average
MIN_RETRY_MS, MAX_RETRY_MS = 10, 60_000


def _text_bytes(text: str, limit: int) -> int:
    """UTF-8 bytes of ``text``; a string of more characters than ``limit`` is over it
    whatever its encoding, and is not encoded."""
    if len(text) > limit or text.isascii():
        return len(text)
    return len(text.encode("utf-8", errors="surrogatepass"))


class GenerationService:
    """The Generate handler; :meth:`attach` a :class:`serving.Generator` (its loop starts
    then). ``workers``: threads that validate and tokenize requests; ``max_streams``:
    generation streams at once (default ``STREAMS_PER_BATCH_ROW`` x the generator's
    ``max_batch_size``); ``max_text_bytes``: UTF-8 bytes of a prompt (default 64 per
    context token, as scoring's ``max_text_bytes``)."""

    def __init__(self, *, workers: int = 2, max_streams: int | None = None,
                 max_text_bytes: int | None = None) -> None:
        self.loop: Any = None                 # the GeneratorLoop, once attached
        self.generator: Any = None
        self.stopping = False                 # set by the server: refuse new calls
        self.max_streams = max_streams
        self.max_text_bytes = max_text_bytes
        self.max_context = 0
        self.streams = 0                      # admitted and not yet out of the scheduler
        # Generate calls whose handler has not returned: a stream's sequence leaves the
        # scheduler (and its admission slot) before its last tokens reach the client, so
        # a stopping server waits on these, not on ``streams``.
        self.open_calls = 0
        self.active: set[GenerationStream] = set()
        self.refused = 0                      # calls refused for overload
        self.token_seconds: float | None = None  # moving average of the time per token
        self.metrics: Any = None              # a serving.metrics.ServingMetrics, or None
        # The threads that validate, tokenize and queue requests (GeneratorLoop.submit).
        self.submit_pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix="moejax-grpc-generate")

    def attach(self, generator: Any) -> None:
        """Serve ``generator`` (continuous batching): start its loop."""
        self.max_context = int(generator.config.max_context)
        if self.max_streams is None:
            self.max_streams = STREAMS_PER_BATCH_ROW * generator.options.max_batch_size
        if self.max_text_bytes is None:
            self.max_text_bytes = 64 * self.max_context
        self.generator = generator
        self.loop = generator.start_loop()

    def cancel_all(self) -> None:
        """Cancel every sequence still running (on the event loop, once the server has
        stopped: no new calls come)."""
        for stream in list(self.active):
            stream.cancel()

    def close(self) -> None:
        """After :meth:`cancel_all`: let the submissions under way end (a call cancelled
        meanwhile cancels its sequence), then stop the generator loop's thread (it drops
        the cancelled sequences first)."""
        self.submit_pool.shutdown(wait=True, cancel_futures=True)
        if self.loop is not None:
            self.loop.close()

    def retry_after_ms(self) -> int:
        """When a stream should next end: the fewest tokens any running sequence has left,
        at the measured time per token (a hint, clamped to [10 ms, 60 s])."""
        per_token = self.token_seconds or DEFAULT_TOKEN_SECONDS
        left = min((s.left for s in self.active if s.left is not None), default=1)
        return int(min(max(left * per_token * 1000, MIN_RETRY_MS), MAX_RETRY_MS))

    def record_token_seconds(self, seconds_per_token: float) -> None:
        """Fold one measured time per token into the moving average of the retry hint."""
        if self.token_seconds is None:
            self.token_seconds = seconds_per_token
        else:
            self.token_seconds += TOKEN_SECONDS_WEIGHT * (seconds_per_token - self.token_seconds)

    def open_stream(self) -> "GenerationStream":
        """A new generation stream, counted against ``max_streams`` (both doors: gRPC and
        HTTP); raises Refused with a retry hint at the limit."""
        if self.streams >= self.max_streams:
            self.refused += 1
            raise Refused(f"the server runs {self.streams} generation streams (its limit)",
                          self.retry_after_ms())
        return GenerationStream(self)

    def _check_limits(self, message: pb.GenerateRequest) -> str | None:
        """The size-limit error of a request (lengths only: runs on the event loop)."""
        label = request_label(convert.get_id(message), 0)
        if message.HasField("prompt"):
            size = _text_bytes(message.prompt, self.max_text_bytes)
            if size > self.max_text_bytes:
                return (f"{label}: prompt: {size} UTF-8 bytes, over the server's limit of "
                        f"{self.max_text_bytes} (max_text_bytes)")
        ids = len(message.prompt_token_ids.ids)
        if ids > self.max_context:
            return (f"{label}: prompt_token_ids: has {ids} tokens, more than the model's "
                    f"context ({self.max_context})")
        stops = len(message.stop_token_ids.ids)
        if stops > self.max_context:
            return (f"{label}: stop_token_ids: has {stops} ids, over the server's limit of "
                    f"{self.max_context}")
        return None

    async def Generate(self, message: Any, context: Any) -> AsyncIterator[pb.GenerateResponse]:
        if self.loop is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                "the model is still loading (health: NOT_SERVING); retry later")
        if self.stopping:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the server is shutting down")
        if isinstance(message, decoding.Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"{request_label(message.request_id(), 0)}: "
                                f"{message.describe()}")
        error = self._check_limits(message)
        if error is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, error)
        try:
            stream = self.open_stream()
        except Refused as refused:
            await refuse(context, refused)
        self.open_calls += 1
        try:
            try:
                await stream.submit(convert.generation_request_from_proto(message))
            except RequestError as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            except RuntimeError as exc:  # the loop is closed (stopping) or has failed
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
            async for response in stream.responses(context):
                yield response
        finally:
            self.open_calls -= 1
            stream.cancel()  # the client went away, the deadline passed, ...: free it


class GenerationStream:
    """One generation call (gRPC's Generate, HTTP's completions): its slot in the
    admission count, its sequence's events (``events``, queued on the event loop) and its
    handle (to cancel it)."""

    def __init__(self, service: GenerationService):
        self.service = service
        self.events: asyncio.Queue = asyncio.Queue()
        self.event_loop = asyncio.get_running_loop()
        self.handle: Any = None
        self.done = False           # the sequence has left the scheduler: slot released
        self.left: int | None = None  # tokens still to generate (None: not yet known)
        self.received = 0           # tokens that arrived from the generator loop
        self.sent = 0               # tokens sent to the client
        self.last = self.started = time.monotonic()
        service.streams += 1
        service.active.add(self)

    # --------------------------------------------------------------- event loop thread
    def _release(self) -> None:
        if not self.done:
            self.done = True
            self.service.streams -= 1
            self.service.active.discard(self)

    def _arrived(self, event: Any) -> None:
        now = time.monotonic()
        metrics = self.service.metrics
        if event.token_ids:
            per_token = (now - self.last) / len(event.token_ids)
            if self.received:  # (the first token's wait includes the queue and the prefill)
                self.service.record_token_seconds(per_token)
                if metrics is not None:
                    metrics.output_tokens(len(event.token_ids), per_token)
            elif metrics is not None:
                metrics.first_token(now - self.started, len(event.token_ids))
            self.received += len(event.token_ids)
            if self.left is not None:
                self.left = max(0, self.left - len(event.token_ids))
        self.last = now
        if event.result is not None:
            self._release()
        self.events.put_nowait(event)

    async def submit(self, request: dict[str, Any]) -> None:
        """Validate, tokenize and queue the request (on the pool); RequestError for a bad
        one (nothing queued)."""
        loop = self.service.loop
        future = self.event_loop.run_in_executor(
            self.service.submit_pool, lambda: loop.submit(request, self._on_event))
        try:
            self.handle = await asyncio.shield(future)
        except asyncio.CancelledError:
            # Gone while its request was being submitted: cancel it once it is queued.
            future.add_done_callback(self._cancel_when_submitted)
            raise
        except BaseException:
            self._release()
            raise
        self.left = max(0, self.handle.sequence.spec.max_new_tokens - self.received)

    def _cancel_when_submitted(self, future: asyncio.Future) -> None:
        if future.cancelled() or future.exception() is not None:
            self._release()
        else:
            future.result().cancel()

    def cancel(self) -> None:
        """Free the sequence at the next step (no-op once it has ended)."""
        if self.handle is not None and not self.done:
            self.handle.cancel()

    def discard(self) -> None:
        """Give back the slot of a stream that was never submitted (a call whose other
        streams were refused)."""
        if self.handle is None:
            self._release()

    # --------------------------------------------------------------- generator thread
    def _on_event(self, event: Any) -> None:
        try:
            self.event_loop.call_soon_threadsafe(self._arrived, event)
        except RuntimeError:  # the event loop is closed (process exit): nobody listens
            pass

    # --------------------------------------------------------------- the stream
    async def updates(self, next_event: Callable[[], Awaitable[Any]] | None = None
                      ) -> AsyncIterator[tuple[list[int], Any]]:
        """(new token ids, the result on the last update) as they arrive; a slow reader
        gets the tokens of several steps together. ``next_event``: how to wait for the
        next event (default: as long as it takes)."""
        wait = next_event or self.events.get
        while True:
            event = await wait()
            tokens, result = list(event.token_ids), event.result
            while result is None and not self.events.empty():
                event = self.events.get_nowait()
                tokens.extend(event.token_ids)
                result = event.result
            self.sent += len(tokens)
            yield tokens, result
            if result is not None:
                return

    async def _next(self, deadline: float | None, context: Any) -> Any:
        if deadline is None:
            return await self.events.get()
        try:
            return await asyncio.wait_for(self.events.get(), deadline - time.monotonic())
        except asyncio.TimeoutError:
            self.cancel()
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"the deadline passed after {self.sent} generated tokens; the "
                                f"sequence was cancelled")

    async def responses(self, context: Any) -> AsyncIterator[pb.GenerateResponse]:
        deadline = call_deadline(context)
        async for tokens, result in self.updates(lambda: self._next(deadline, context)):
            if result is None:
                if tokens:
                    yield convert.generation_response(tokens)
                continue
            if result.error is None and result.finish_reason in ("stop", "length"):
                yield convert.generation_response(tokens, result)
                return
            if result.finish_reason == "cancelled":
                await context.abort(grpc.StatusCode.UNAVAILABLE,
                                    f"the server is shutting down; the sequence was cancelled "
                                    f"after {self.sent} generated tokens")
            await context.abort(grpc.StatusCode.INTERNAL,
                                result.error or f"generation ended with finish_reason "
                                                f"{result.finish_reason!r}")
