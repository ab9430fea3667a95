"""The gRPC server: the Scoring and Generation services, standard health and reflection,
auth, TLS, and a graceful shutdown.

Lifecycle (what ``moejax serve`` does)::

    server = ScoringServer(ServerOptions(port=0))
    port = server.start()        # listening; health NOT_SERVING, calls UNAVAILABLE
    server.attach(Scorer(...), Generator(...))   # models loaded: health SERVING
    ...
    server.stop()                # health NOT_SERVING, (drain delay), refuse new calls,
                                 # finish in-flight ones within the grace period

Health (``grpc.health.v1.Health``) answers for the overall server ("", the scorer), for
``moejax.v1.Scoring`` and, unless ``generation=False``, for ``moejax.v1.Generation``
(SERVING once a Generator is attached; without ``generation`` the service is not
registered at all, and gRPC answers its calls UNIMPLEMENTED).

Threads: the server is asyncio (``grpc.aio``) on one event-loop thread of its own, which
serves health and reflection and runs the handlers' cheap parts (size limits, admission,
waiting); a call waiting for its result holds no thread, so no number of calls in flight
can starve a health check. ``workers`` threads prepare requests
(parse, tokenize), and one worker thread owns the model (:mod:`serving.grpc.batcher`).
Every refusal under load is the server's own, with a retry hint: the queue's cost bound
(``max_queued_tokens``), calls in progress (``max_concurrent_rpcs``), requests waiting to
be prepared (``max_preparing``), generation streams (``max_generation_streams``). What no
wait would let in is refused before tokenizing, without a hint: a ``ScoreBatch`` of more
than ``max_preparing`` requests, and requests whose least possible cost is over the whole
cost bound (:mod:`serving.grpc.service`). The
Generator's own loop thread runs the continuous batch that every Generate call joins
(:mod:`serving.grpc.generation`).
"""

from __future__ import annotations

import asyncio
import atexit
import dataclasses
import errno
import logging
import ssl
import threading
import time
from typing import Any, Awaitable, Callable, Sequence

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from serving.grpc import convert, decoding, scoring_pb2 as pb
from serving.grpc.auth import BearerTokenInterceptor
from serving.grpc.batcher import Batcher
from serving.grpc.generation import GENERATION_SERVICE_NAME, GenerationService
from serving.grpc.service import SERVICE_NAME, OversizedBatch, ScoringService
from serving.metrics import ServingMetrics

log = logging.getLogger("moejax.grpc")


@dataclasses.dataclass
class ServerOptions:
    """Server settings (the ``moejax serve`` flags).

    ``port`` 0 picks a free port. ``max_queued_tokens``: admission bound (token-equivalents
    of compute queued or running). ``batch_tokens``: token-equivalents per model call
    (default 4 x the Scorer's ``max_batch_tokens``; larger requests are split).
    ``grace_seconds``: how long in-flight calls may run after a stop. ``drain_seconds``:
    time between health NOT_SERVING and refusing new calls (for load balancers to notice).
    ``token``: require ``authorization: Bearer <token>`` on Scoring and Generation calls.
    ``tls_cert`` / ``tls_key``: PEM files; TLS when both are set. ``max_message_mib``:
    largest request message accepted. ``workers``: threads that prepare (parse, tokenize)
    requests (and as many validate and tokenize generation requests).
    ``max_concurrent_rpcs``: scoring calls in progress at once; ``max_preparing``: requests
    waiting to be prepared (past either: RESOURCE_EXHAUSTED with a retry hint), and the
    most requests of one ``ScoreBatch`` (more: RESOURCE_EXHAUSTED without a hint, saying to
    split the batch; refused before its items are tokenized).
    ``generation``: serve ``moejax.v1.Generation`` (with a Generator given to
    :meth:`ScoringServer.attach`); ``max_generation_streams``: generation streams at once
    (default 4 x the Generator's ``max_batch_size``; more: RESOURCE_EXHAUSTED with a retry
    hint). ``metrics_port``: serve Prometheus metrics (``serving.metrics``) over HTTP on
    ``host:metrics_port`` at ``/metrics`` (0 picks a free port; None: not served, though
    :attr:`ScoringServer.metrics` still counts).
    """

    host: str = "127.0.0.1"
    port: int = 50051
    max_queued_tokens: int = 262_144
    batch_tokens: int | None = None
    max_batch_requests: int = 4096
    grace_seconds: float = 30.0
    drain_seconds: float = 0.0
    token: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    max_message_mib: float = 16.0
    workers: int = 2
    max_concurrent_rpcs: int = 4096
    max_preparing: int = 256
    generation: bool = True
    max_generation_streams: int | None = None
    metrics_port: int | None = None

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("TLS needs both a certificate (--tls-cert) and a key (--tls-key)")
        if min(self.max_queued_tokens, self.max_message_mib, self.workers,
               self.max_concurrent_rpcs, self.max_batch_requests, self.max_preparing) <= 0:
            raise ValueError("max_queued_tokens, max_message_mib, workers, max_concurrent_rpcs, "
                             "max_preparing and max_batch_requests must be positive")
        if self.max_generation_streams is not None and self.max_generation_streams <= 0:
            raise ValueError("max_generation_streams must be positive")
        if self.grace_seconds < 0 or self.drain_seconds < 0:
            raise ValueError("grace_seconds and drain_seconds must be >= 0")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be a TCP port (0 picks a free one), got "
                             f"{self.metrics_port}")

    @property
    def max_message_bytes(self) -> int:
        return int(self.max_message_mib * (1 << 20))

    @property
    def address(self) -> str:
        return listen_address(self.host, self.port)


def read_tls_files(cert_path: str, key_path: str) -> tuple[bytes, bytes]:
    """(key, certificate) PEM bytes, checked to be a matching pair: gRPC would only say
    "Failed to bind to address". Raises ValueError naming the file and the problem."""
    pems = {}
    for what, path in (("certificate", cert_path), ("key", key_path)):
        try:
            with open(path, "rb") as fh:
                pems[what] = fh.read()
        except OSError as exc:
            raise ValueError(f"TLS {what} {path}: cannot be read ({exc.strerror})") from exc
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    try:
        # An encrypted key must not make OpenSSL prompt on the terminal: no password.
        context.load_cert_chain(cert_path, key_path, password=lambda: b"")
    except ssl.SSLError as exc:
        reason = exc.reason or str(exc)
        if "KEY_VALUES_MISMATCH" in str(exc).upper() or "mismatch" in str(exc).lower():
            problem = f"the key {key_path} does not match the certificate {cert_path}"
        else:
            problem = (f"the certificate {cert_path} or the key {key_path} is not valid PEM "
                       f"({reason})")
        raise ValueError(f"TLS: {problem}") from exc
    return pems["key"], pems["certificate"]


def scoring_handlers(service: Any, *, max_batch_requests: int | None = None
                     ) -> grpc.GenericRpcHandler:
    """The Scoring methods of ``service`` (a :class:`ScoringService`, or any object with
    its handler methods: the router's), with deserializers that name non-UTF-8 fields
    (:mod:`serving.grpc.decoding`) instead of failing the whole call, and a ``ModelInfo``
    whose request does not parse answered INVALID_ARGUMENT (gRPC would answer UNKNOWN and
    log a traceback per call). ``max_batch_requests``: a ``ScoreBatch`` of more requests
    reaches ``service`` as an :class:`OversizedBatch` (:func:`batch_deserializer`)."""
    handlers = {
        "Score": grpc.unary_unary_rpc_method_handler(
            service.Score, request_deserializer=lambda data: decoding.parse(pb.ScoreRequest, data),
            response_serializer=pb.ScoreResult.SerializeToString),
        "ScoreBatch": grpc.unary_unary_rpc_method_handler(
            service.ScoreBatch, request_deserializer=batch_deserializer(max_batch_requests),
            response_serializer=pb.ScoreBatchResponse.SerializeToString),
        "ScoreStream": grpc.stream_stream_rpc_method_handler(
            service.ScoreStream,
            request_deserializer=lambda data: decoding.parse(pb.StreamRequest, data),
            response_serializer=pb.StreamResult.SerializeToString),
        "ModelInfo": grpc.unary_unary_rpc_method_handler(
            refusing_undecodable(service.ModelInfo),
            request_deserializer=lambda data: decoding.parse(pb.ModelInfoRequest, data),
            response_serializer=pb.ModelInfoResponse.SerializeToString),
    }
    return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)


def batch_deserializer(max_requests: int | None) -> Callable[[bytes], Any]:
    """``ScoreBatch``'s request deserializer: :func:`serving.grpc.decoding.parse_batch`,
    except that a batch of more than ``max_requests`` requests (None: no limit) is only
    counted, an :class:`OversizedBatch`. It runs on the event loop, where parsing the wire
    is quick but making a Python object of each of 200,000 requests is not."""
    if max_requests is None:
        return decoding.parse_batch

    def deserialize(data: bytes) -> Any:
        batch = decoding.parse(pb.ScoreBatchRequest, data)
        parsed = batch if isinstance(batch, pb.ScoreBatchRequest) else batch.lenient
        count = 0 if parsed is None else len(parsed.requests)
        if count > max_requests:
            return OversizedBatch(count)
        if isinstance(batch, pb.ScoreBatchRequest):
            return list(batch.requests)
        return decoding.parse_batch(data)   # (text that is not UTF-8: named item by item)

    return deserialize


def refusing_undecodable(handler: Callable[[Any, Any], Awaitable[Any]]
                         ) -> Callable[[Any, Any], Awaitable[Any]]:
    """``handler`` behind a check: a request that did not parse
    (:class:`serving.grpc.decoding.Undecodable`) is refused with INVALID_ARGUMENT naming the
    problem, and ``handler`` only ever sees parsed requests."""

    async def checked(request: Any, context: Any) -> Any:
        if isinstance(request, decoding.Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.describe())
        return await handler(request, context)

    return checked


def generation_handlers(service: Any) -> grpc.GenericRpcHandler:
    """The Generation method of ``service`` (a :class:`GenerationService`, or any object
    with a ``Generate`` handler); its deserializer names non-UTF-8 fields, as Scoring's."""
    return grpc.method_handlers_generic_handler(GENERATION_SERVICE_NAME, {
        "Generate": grpc.unary_stream_rpc_method_handler(
            service.Generate,
            request_deserializer=lambda data: decoding.parse(pb.GenerateRequest, data),
            response_serializer=pb.GenerateResponse.SerializeToString)})


def server_credentials(tls_cert: str | None, tls_key: str | None
                       ) -> grpc.ServerCredentials | None:
    """TLS credentials of a server (None: plaintext, no certificate given); the files are
    read and checked now (:func:`read_tls_files`), so a bad pair fails before binding."""
    if tls_cert is None:
        return None
    key, cert = read_tls_files(tls_cert, tls_key)
    return grpc.ssl_server_credentials([(key, cert)])


def listen_address(host: str, port: int) -> str:
    """The "host:port" address to bind (an IPv6 host in brackets)."""
    host = f"[{host}]" if ":" in host and not host.startswith("[") else host
    return f"{host}:{port}"


def new_server(services: Sequence[str], *, token: str | None,
               max_message_bytes: int) -> grpc.aio.Server:
    """A ``grpc.aio`` server whose ``services`` (full names) require ``token`` when one is
    given (health and reflection stay open), taking requests of up to
    ``max_message_bytes``; with SO_REUSEPORT off, so that a port in use fails to bind."""
    interceptors = ([BearerTokenInterceptor(token, [f"/{name}/" for name in services])]
                    if token else [])
    return grpc.aio.server(interceptors=interceptors,
                           options=[("grpc.max_receive_message_length", max_message_bytes),
                                    ("grpc.so_reuseport", 0)])


def add_health_and_reflection(server: grpc.aio.Server, services: Sequence[str]) -> Any:
    """Serve ``grpc.health.v1`` and reflection (of ``services``, health and reflection) on
    ``server``; returns the health servicer, whose statuses the caller sets."""
    servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    reflection.enable_server_reflection(
        (*services, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
         reflection.SERVICE_NAME), server)
    return servicer


def listen(server: grpc.aio.Server, address: str,
           credentials: grpc.ServerCredentials | None) -> int:
    """Bind ``server`` to ``address`` (TLS with ``credentials``) -> the bound port;
    OSError naming the address when it cannot be bound."""
    try:
        port = (server.add_secure_port(address, credentials) if credentials
                else server.add_insecure_port(address))
    except RuntimeError as exc:
        raise OSError(f"cannot listen on {address}: {exc}") from exc
    if port == 0:
        raise OSError(f"cannot listen on {address}")
    return port


class ScoringServer:
    """A gRPC server of one Scorer (see the module docstring). Its methods are called from
    ordinary threads; the server itself runs on an event loop in a thread of its own."""

    def __init__(self, options: ServerOptions | None = None):
        self.options = options or ServerOptions()
        opts = self.options
        self.service = ScoringService(prepare_threads=opts.workers,
                                      max_in_flight=opts.max_concurrent_rpcs,
                                      max_preparing=opts.max_preparing)
        self.generation = GenerationService(workers=opts.workers,
                                            max_streams=opts.max_generation_streams)
        self.health: Any = None
        self.batcher: Batcher | None = None
        self.metrics = ServingMetrics()
        self.service.metrics = self.generation.metrics = self.metrics
        self.metrics_port: int | None = None     # bound when options.metrics_port is set
        # Set when a stop begins (before health turns NOT_SERVING): HTTP /ready says 503.
        self.draining = threading.Event()
        self.port: int | None = None
        self._server: grpc.aio.Server | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _run(self, coroutine: Any, timeout: float | None = None) -> Any:
        """Run ``coroutine`` on the server's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    def _services(self) -> tuple[str, ...]:
        """The moejax services this server registers."""
        return (SERVICE_NAME, GENERATION_SERVICE_NAME) if self.options.generation else (
            SERVICE_NAME,)

    async def _set_health(self, status: int, names: tuple[str, ...] = ("", SERVICE_NAME)
                          ) -> None:
        for name in names:
            await self.health.set(name, status)

    def start(self) -> int:
        """Bind and start serving health and reflection; returns the bound port."""
        opts = self.options
        # A bad key or certificate fails here, before binding.
        credentials = server_credentials(opts.tls_cert, opts.tls_key)
        if opts.metrics_port is not None:      # (a taken port fails here, before gRPC binds)
            self.metrics_port = self.metrics.serve(opts.metrics_port, opts.host)
        self._loop = server_loop()
        try:
            port = self._run(self._start(credentials))
        except BaseException:
            self._close_loop()
            self.metrics.close()
            raise
        log.info("listening on %s:%d (%s, %s); health NOT_SERVING until the model is loaded",
                 opts.host, port, "TLS" if credentials else "plaintext",
                 "bearer-token auth" if opts.token else "no auth")
        if self.metrics_port is not None:
            log.info("metrics on http://%s:%d/metrics", opts.host, self.metrics_port)
        return port

    async def _start(self, credentials: grpc.ServerCredentials | None) -> int:
        opts = self.options
        server = new_server(self._services(), token=opts.token,
                            max_message_bytes=opts.max_message_bytes)
        server.add_generic_rpc_handlers((scoring_handlers(
            self.service, max_batch_requests=self.service.max_preparing),))
        if opts.generation:
            server.add_generic_rpc_handlers((generation_handlers(self.generation),))
        self.health = add_health_and_reflection(server, self._services())
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING,
                               ("", *self._services()))
        port = listen(server, opts.address, credentials)
        await server.start()
        self._server, self.port = server, port
        return port

    def attach(self, scorer: Any, generator: Any = None) -> None:
        """Serve ``scorer`` (loaded and calibrated): start its worker; health SERVING. With
        ``generator`` (a :class:`serving.Generator`, continuous batching; the server then
        owns it: its loop runs until :meth:`stop`), serve Generation too."""
        opts = self.options
        if generator is not None and not opts.generation:
            raise ValueError("a Generator was given to a server started with generation=False")
        if generator is not None:
            self.generation.max_text_bytes = int(scorer.info["limits"]["max_text_bytes"])
            self.generation.attach(generator)
        scorer_info = scorer.info
        batch_tokens = opts.batch_tokens or int(scorer_info["max_batch_tokens"])
        self.batcher = Batcher(scorer, max_queued_tokens=opts.max_queued_tokens,
                               batch_tokens=batch_tokens,
                               max_batch_requests=opts.max_batch_requests,
                               metrics=self.metrics)
        self.metrics.watch(scorer, self.batcher,
                           self.generation if generator is not None else None)
        info = convert.info_to_proto(scorer_info, max_queued_tokens=opts.max_queued_tokens,
                                     max_message_bytes=opts.max_message_bytes)
        if generator is not None:
            info.generation = True
            info.max_generation_streams = self.generation.max_streams
        self.service.attach(self.batcher, scorer, info)
        self._run(self._set_health(health_pb2.HealthCheckResponse.SERVING,
                                   ("", SERVICE_NAME) + ((GENERATION_SERVICE_NAME,)
                                                         if generator is not None else ())))
        log.info("serving %s (%s, %s backend%s); health SERVING", info.architecture,
                 scorer_info.get("model_name", "?"), info.backend,
                 f", generation: up to {info.max_generation_streams} streams"
                 if generator is not None else "")

    def stats(self) -> dict[str, int]:
        """The batcher's counters (batches, scored, dropped_expired, peak_queued_tokens, ...),
        the calls refused for overload before admission (``refused_overload``) and those
        refused before tokenizing as larger than any call may be (``refused_oversized``: a
        ScoreBatch over ``max_preparing`` requests, or requests whose least possible cost
        is over ``max_queued_tokens``)."""
        if self.batcher is None:
            return {}
        return {**self.batcher.snapshot(), "refused_overload": self.service.refused,
                "refused_oversized": self.service.oversized,
                "in_flight": self.service.in_flight,
                "generation_streams": self.generation.streams,
                "generation_refused": self.generation.refused}

    def stop(self, grace: float | None = None) -> None:
        """Health NOT_SERVING, wait ``drain_seconds``, refuse new calls, let in-flight calls
        finish within ``grace`` seconds (default ``grace_seconds``), stop the worker."""
        if self._server is None:
            return
        grace = self.options.grace_seconds if grace is None else grace
        self.draining.set()
        self._run(self.health.enter_graceful_shutdown())
        if self.options.drain_seconds > 0:
            time.sleep(self.options.drain_seconds)
        self.service.stopping.set()
        self.generation.stopping = True
        log.info("stopping: refusing new calls, %.1f s for %d in-flight ones", grace,
                 self.service.in_flight + self.generation.open_calls)
        self._run(self._stop(grace))
        if self.batcher is not None:
            self.batcher.stop(timeout=max(grace, 1.0))
        self.service.close()
        self.generation.close()
        self.metrics.close()
        self._close_loop()
        self._server = None
        log.info("stopped")

    async def _stop(self, grace: float) -> None:
        # New calls are refused already (stopping); wait for the scoring calls and the
        # generation streams in flight only (health Watch streams would hold the whole
        # grace), then stop the server once, cancelling what is left.
        deadline = time.monotonic() + grace
        while ((self.service.in_flight > 0 or self.generation.open_calls > 0)
               and time.monotonic() < deadline):
            await asyncio.sleep(0.02)
        await self._server.stop(0)
        self.generation.cancel_all()  # (the handlers' own cancels, in case one was missed)

    def _close_loop(self) -> None:
        self._loop = None  # the shared loop lives on, for other servers of this process


_LOOP_LOCK = threading.Lock()
_LOOP: asyncio.AbstractEventLoop | None = None


def server_loop() -> asyncio.AbstractEventLoop:
    """The event loop every gRPC server (ScoringServer, RouterServer) and every
    ``grpc.aio`` channel of this process runs on (one thread, started on first use):
    gRPC's asyncio layer expects one loop per process."""
    global _LOOP
    with _LOOP_LOCK:
        if _LOOP is None:
            _LOOP = asyncio.new_event_loop()
            _LOOP.set_exception_handler(quiet_poller_shutdown)
            thread = threading.Thread(target=_LOOP.run_forever, name="moejax-grpc-loop",
                                      daemon=True)
            thread.start()
            atexit.register(_stop_loop, _LOOP, thread)
        return _LOOP


def quiet_poller_shutdown(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
    """The loop's exception handler: gRPC's asyncio poller can fire once more after a
    server's completion queue closed (OSError EBADF from
    ``PollerCompletionQueue._handle_events``), which asyncio would print as an error
    with a traceback under a clean shutdown; that one is logged at debug level.
    Everything else goes to asyncio's default handler."""
    exc = context.get("exception")
    if isinstance(exc, OSError) and exc.errno == errno.EBADF:
        log.debug("gRPC poller event after its queue closed: %s", exc)
        return
    loop.default_exception_handler(context)


def _stop_loop(loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
    """At exit: stop the loop between callbacks, so gRPC is not torn down under it."""
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
