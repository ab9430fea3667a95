"""``Client``: score and generate over gRPC with the same requests and results as
``Scorer.score`` and ``Generator.generate``.

    from serving.grpc import Client
    with Client("127.0.0.1:50051", token=None) as client:
        results = client.score([{"id": "r1", "prompt": "...", "candidates": [" yes", " no"]}])
        generated = client.generate([{"id": "g1", "prompt": "2+2=", "max_new_tokens": 8}])
        for event in client.generate_stream({"prompt": "Once", "max_new_tokens": 64}):
            print(event.token_ids, event.result)   # result: set on the last event

Requests are validated on the client first (``serving.requests.parse_request``, no
tokenizer needed), so an invalid request gets the same error result as in process without
a round trip; the rest stream through ``ScoreStream``. Invalid requests are results, not
exceptions (a request that passes validation but cannot be put in a proto message, say
text that is not UTF-8, gets its error result locally too: one bad request never fails
the call); what does raise is the transport: a ``grpc.RpcError`` for an unreachable
server, a wrong token (UNAUTHENTICATED), a deadline (DEADLINE_EXCEEDED), a server shutting
down (UNAVAILABLE). Results carry the server's ``timings`` plus ``queue_seconds``.

Generation: one ``Generation.Generate`` call per request (``generate`` runs up to
``max_concurrency`` of them at once, from threads: they share the server's continuous
batch), results in request order, as :class:`serving.generate.GenerationResult`. The
server validates generation requests (the client has no tokenizer); an invalid one gets a
result whose ``error`` is the server's INVALID_ARGUMENT message, with an id-less request
named by its position in the list, as ``Generator.generate`` names it. A refusal for
overload (RESOURCE_EXHAUSTED with ``retry-after-ms``) is retried after the hint, within
the timeout. Leaving ``generate_stream`` early (``break``, ``close()``) cancels the call:
the server frees the sequence at its next step.

The channel helpers (:func:`channel_credentials`, :func:`open_channel`,
:func:`bearer_metadata`) and :func:`retry_hint_seconds` are public: the router's upstream
channels (:mod:`serving.grpc.upstreams`) and ``moejax score --target``
(:mod:`serving.remote_score`) set up TLS and auth toward a server the same way.
"""

from __future__ import annotations

import collections
import concurrent.futures
import sys
import threading
import time
from typing import Any, Iterable, Iterator, Mapping, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from serving.grpc import convert, scoring_pb2 as pb, scoring_pb2_grpc
from serving.requests import (RequestError, ScoreRequest, ScoreResult, parse_request,
                              renamed, request_id_of, request_label)

PROGRESS_MIN_REQUESTS = 64  # as the Scorer's default progress_min_requests
GENERATE_CONCURRENCY = 32   # Generate calls one ``generate`` runs at once (default)


def _raw_id(obj: Any) -> Any:
    if isinstance(obj, ScoreRequest):
        return obj.id
    return obj.get("id") if isinstance(obj, Mapping) else None


def _printable(text: str) -> str:
    """``text`` with what is not Unicode text (lone surrogates) escaped, for messages."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def to_message(obj: Any, index: int) -> pb.StreamRequest | ScoreResult:
    """The stream message of one request, or its error result when it is invalid or the
    proto refuses it (the error is the request's, never the whole call's)."""
    try:
        request = parse_request(obj, index)
        return pb.StreamRequest(request=convert.request_to_proto(request, index), index=index)
    except RequestError as exc:
        return convert.error_result(_raw_id(obj), str(exc))
    except Exception as exc:  # noqa: BLE001 - raised in gRPC's request thread, it would
        # end the whole stream with UNKNOWN "Exception iterating requests!"
        request_id = _raw_id(obj)
        return convert.error_result(request_id, f"{request_label(request_id, index)}: cannot "
                                                f"be sent: {_printable(str(exc))}")


def retry_hint_seconds(error: grpc.RpcError) -> float | None:
    """The server's ``retry-after-ms`` of an overload refusal (None: no hint)."""
    try:
        value = dict(error.trailing_metadata() or ()).get("retry-after-ms")
        return None if value is None else max(0.0, int(value) / 1000)
    except (TypeError, ValueError):
        return None


class _Calls:
    """The Generate calls of one ``generate``: cancelled all at once when one fails."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: set[Any] = set()
        self.stopped = threading.Event()

    def add(self, call: Any) -> None:
        with self._lock:
            if self.stopped.is_set():
                call.cancel()
            self._calls.add(call)

    def discard(self, call: Any) -> None:
        with self._lock:
            self._calls.discard(call)

    def stop(self) -> None:
        with self._lock:
            self.stopped.set()
            for call in self._calls:
                call.cancel()


# ---------------------------------------------------------------------------- channels
def read_pem(value: str | bytes | None, *, where: str | None = None) -> bytes | None:
    """PEM bytes of a path (or the bytes themselves), checked to hold at least one
    certificate; ValueError naming a file that cannot be read or holds none (as ``where``
    when given, e.g. the flag it came from).

    Why check here: gRPC takes any bytes as root certificates and only fails each TLS
    handshake later, so a wrong file would show as an upstream (or server) that never
    answers instead of as the bad file it is."""
    if value is None:
        return None
    where = where or ("the TLS CA given as bytes" if isinstance(value, bytes)
                      else f"TLS CA {value}")
    if isinstance(value, bytes):
        data = value
    else:
        try:
            with open(value, "rb") as fh:
                data = fh.read()
        except OSError as exc:
            raise ValueError(f"{where}: cannot be read ({exc.strerror})") from exc
    problem = pem_problem(data)
    if problem is not None:
        raise ValueError(f"{where}: {problem}")
    return data


def pem_problem(data: bytes) -> str | None:
    """Why ``data`` is not PEM text with at least one X.509 certificate (None: it is)."""
    import ssl

    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        return "not a PEM file (it is not text; a DER certificate must be converted to PEM)"
    if "-----BEGIN CERTIFICATE-----" not in text:
        return "not a PEM certificate (no '-----BEGIN CERTIFICATE-----' line)"
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cadata=text)
    except (ssl.SSLError, ValueError) as exc:
        return f"not a valid PEM certificate ({exc})"
    return None


def channel_credentials(tls: bool = False, tls_ca: str | bytes | None = None
                        ) -> grpc.ChannelCredentials | None:
    """TLS credentials of a channel, None for plaintext: TLS with ``tls_ca`` (PEM path or
    bytes of the CA, or of a self-signed server certificate) or, with ``tls`` alone, the
    system's root CAs. The CA file is read and checked now (ValueError naming it if it
    cannot be read or holds no certificate)."""
    if not (tls or tls_ca is not None):
        return None
    return grpc.ssl_channel_credentials(root_certificates=read_pem(tls_ca))


def open_channel(target: str, credentials: grpc.ChannelCredentials | None, *,
                 max_receive_bytes: int, tls_server_name: str | None = None,
                 options: Sequence[tuple[str, Any]] = (), aio: bool = False) -> Any:
    """A channel to ``target`` ("host:port"): TLS with ``credentials``
    (:func:`channel_credentials`), else plaintext. ``max_receive_bytes`` bounds a received
    message; ``tls_server_name`` overrides the name checked against the server's
    certificate; ``options`` are more channel options; ``aio``: a ``grpc.aio`` channel
    (for the event loop of :func:`serving.grpc.server.server_loop`)."""
    channel_options = [("grpc.max_receive_message_length", max_receive_bytes), *options]
    if tls_server_name:
        channel_options.append(("grpc.ssl_target_name_override", tls_server_name))
    module = grpc.aio if aio else grpc
    if credentials is not None:
        return module.secure_channel(target, credentials, options=channel_options)
    return module.insecure_channel(target, options=channel_options)


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """The call metadata that carries ``token`` (none without one)."""
    return (("authorization", f"Bearer {token}"),) if token else ()


class Client:
    """A connection to a ``moejax serve`` server.

    ``target``: "host:port". ``token``: bearer token (sent as ``authorization`` metadata).
    TLS: ``tls=True`` (system roots) or ``tls_ca`` (PEM path or bytes of the CA / the
    server's self-signed certificate); ``tls_server_name`` overrides the name checked
    against the certificate. ``max_message_mib`` bounds a received message.
    """

    def __init__(self, target: str, token: str | None = None, *, tls: bool = False,
                 tls_ca: str | bytes | None = None, tls_server_name: str | None = None,
                 max_message_mib: float = 256.0, options: Sequence[tuple[str, Any]] = ()):
        self._channel = open_channel(target, channel_credentials(tls, tls_ca),
                                     max_receive_bytes=int(max_message_mib * (1 << 20)),
                                     tls_server_name=tls_server_name, options=options)
        self.target = target
        self._metadata = bearer_metadata(token)
        self._stub = scoring_pb2_grpc.ScoringStub(self._channel)
        self._generation = scoring_pb2_grpc.GenerationStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    @property
    def stub(self) -> scoring_pb2_grpc.ScoringStub:
        """The ``moejax.v1.Scoring`` stub of this connection, for calls the methods below
        do not make (send :attr:`metadata` with them)."""
        return self._stub

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        """The metadata every call sends (the bearer token, if any)."""
        return self._metadata

    # ------------------------------------------------------------------ scoring
    def score(self, requests: Sequence[Any], *, progress: bool | None = None,
              timeout: float | None = None) -> list[ScoreResult]:
        """One result per request, in order, as :meth:`serving.Scorer.score` returns them.

        ``progress``: a progress bar on stderr (default: for 64 requests or more, when
        stderr is a terminal). ``timeout``: seconds for the whole call (DEADLINE_EXCEEDED
        after it)."""
        if isinstance(requests, (str, bytes, Mapping, ScoreRequest)):
            raise TypeError("score() takes a list of requests; wrap a single request in a list")
        requests = list(requests)
        if progress is None:
            progress = len(requests) >= PROGRESS_MIN_REQUESTS and sys.stderr.isatty()
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(requests), unit="req", desc="scoring", file=sys.stderr)
        results: list[ScoreResult | None] = [None] * len(requests)
        try:
            for index, result in self.stream(enumerate(requests), timeout=timeout):
                results[index] = result
                if bar is not None:
                    bar.update(1)
        finally:
            if bar is not None:
                bar.close()
        missing = [i for i, r in enumerate(results) if r is None]
        if missing:
            raise RuntimeError(f"the server sent no result for requests {missing[:10]}")
        return results  # type: ignore[return-value]

    def stream(self, items: Iterable[tuple[int, Any]], *, timeout: float | None = None
               ) -> Iterator[tuple[int, ScoreResult]]:
        """(index, result) pairs as results arrive (not in order) for (index, request)
        pairs; the index names an id-less request in error messages. A ScoreResult given
        in place of a request is passed through as its own answer (e.g. a line of a file
        that was not JSON). Requests are read lazily, as the server admits them."""
        local: collections.deque[tuple[int, ScoreResult]] = collections.deque()
        reading = threading.Event()

        def messages() -> Iterator[pb.StreamRequest]:
            for index, obj in items:
                message = obj if isinstance(obj, ScoreResult) else to_message(obj, index)
                if isinstance(message, ScoreResult):
                    local.append((index, message))
                    continue
                yield message
            reading.set()

        responses = self._stub.ScoreStream(messages(), timeout=timeout, metadata=self._metadata)
        try:
            for response in responses:
                while local:
                    yield local.popleft()
                yield response.index, convert.result_from_proto(response.result)
        except BaseException:
            responses.cancel()
            raise
        if not reading.wait(30):  # the server ends a stream after reading all of it
            raise RuntimeError("the server ended the stream before reading every request")
        while local:
            yield local.popleft()

    # ------------------------------------------------------------------ generation
    def generate(self, requests: Sequence[Any], *, timeout: float | None = None,
                 max_concurrency: int = GENERATE_CONCURRENCY) -> list[Any]:
        """One :class:`serving.generate.GenerationResult` per request, in order, as
        :meth:`serving.Generator.generate` returns them (bad requests: ``error`` set).

        ``timeout``: seconds for the whole call (every Generate call's deadline is its
        end). Raises ``grpc.RpcError`` for a transport failure (the other calls are then
        cancelled)."""
        from serving.generate import GenerationRequest

        if isinstance(requests, (str, bytes, Mapping, GenerationRequest)):
            raise TypeError("generate() takes a list of requests; wrap a single request in "
                            "a list")
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        requests = list(requests)
        if not requests:
            return []
        deadline = None if timeout is None else time.monotonic() + timeout
        calls = _Calls()

        def one(index: int, obj: Any) -> Any:
            for event in self._events(obj, index, deadline, calls):
                if event.result is not None:
                    return event.result
            raise RuntimeError(f"no result for request {index}")

        with concurrent.futures.ThreadPoolExecutor(
                max_workers=min(max_concurrency, len(requests)),
                thread_name_prefix="moejax-client-generate") as pool:
            futures = [pool.submit(one, i, obj) for i, obj in enumerate(requests)]
            try:
                return [future.result() for future in futures]
            except BaseException:
                calls.stop()
                for future in futures:
                    future.cancel()
                raise

    def generate_stream(self, request: Any, *, timeout: float | None = None
                        ) -> Iterator[Any]:
        """:class:`serving.generate.GenerationEvent` s of one request as its tokens arrive
        (``token_ids``: the new ones); the last has ``result`` set (a bad request: only
        that one, with ``error``). Stopping the iteration early cancels the call."""
        deadline = None if timeout is None else time.monotonic() + timeout
        yield from self._events(request, 0, deadline, None)

    def _events(self, obj: Any, index: int, deadline: float | None,
                calls: _Calls | None) -> Iterator[Any]:
        """The events of one request (see :meth:`generate_stream`); an overload refusal
        before any token is retried after the server's hint, within the deadline."""
        from serving.generate import GenerationEvent, GenerationResult

        def failed(error: str) -> GenerationEvent:
            return GenerationEvent(index, [], GenerationResult(id=request_id_of(obj),
                                                               error=error))

        try:
            message = convert.generation_request_to_proto(obj, index)
        except RequestError as exc:
            yield failed(str(exc))
            return
        except Exception as exc:  # noqa: BLE001  (the proto refuses a value: this request's)
            request_id = request_id_of(obj)
            yield failed(f"{request_label(request_id, index)}: cannot be sent: "
                         f"{_printable(str(exc))}")
            return
        tokens: list[int] = []
        while True:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            call = self._generation.Generate(message, timeout=remaining,
                                             metadata=self._metadata)
            if calls is not None:
                calls.add(call)
            try:
                for response in call:
                    tokens.extend(response.token_ids)
                    if not response.HasField("finish_reason"):
                        yield GenerationEvent(index, list(response.token_ids))
                        continue
                    yield GenerationEvent(index, list(response.token_ids), GenerationResult(
                        id=convert.get_id(response), token_ids=tokens,
                        text=response.text if response.HasField("text") else None,
                        finish_reason=response.finish_reason,
                        prompt_tokens=response.prompt_tokens))
                    return
                raise RuntimeError("the server ended the stream without a finish_reason")
            except grpc.RpcError as exc:
                if tokens:
                    raise
                code = exc.code()
                if code == grpc.StatusCode.INVALID_ARGUMENT:
                    # The server names an id-less request "request #0" (one per call).
                    yield failed(renamed(exc.details(), 0, request_label(None, index)))
                    return
                wait = retry_hint_seconds(exc)
                if (code != grpc.StatusCode.RESOURCE_EXHAUSTED or wait is None
                        or (deadline is not None and time.monotonic() + wait >= deadline)):
                    raise
                if calls is None:
                    time.sleep(wait)
                elif calls.stopped.wait(wait):  # another call of the batch failed
                    raise
            finally:
                call.cancel()  # a no-op once it ended; else (left early) frees the sequence
                if calls is not None:
                    calls.discard(call)

    # ------------------------------------------------------------------ service info
    def info(self, *, timeout: float | None = 10.0) -> dict[str, Any]:
        """What the server serves: ``Scorer.info`` plus ``max_queued_tokens`` and
        ``max_message_bytes``."""
        response = self._stub.ModelInfo(pb.ModelInfoRequest(), timeout=timeout,
                                        metadata=self._metadata)
        return convert.info_from_proto(response)

    def health(self, service: str = "", *, timeout: float | None = 10.0) -> str:
        """The standard health status of ``service`` ("" = the server): "SERVING",
        "NOT_SERVING", ..."""
        response = self._health.Check(health_pb2.HealthCheckRequest(service=service),
                                      timeout=timeout)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
