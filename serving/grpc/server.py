"""The gRPC server: the Scoring service, standard health and reflection, auth, TLS, and a
graceful shutdown.

Lifecycle (what ``moejax serve`` does)::

    server = ScoringServer(ServerOptions(port=0))
    port = server.start()        # listening; health NOT_SERVING, scoring calls UNAVAILABLE
    server.attach(Scorer(...))   # model loaded and calibrated: health SERVING
    ...
    server.stop()                # health NOT_SERVING, (drain delay), refuse new calls,
                                 # finish in-flight ones within the grace period

Health (``grpc.health.v1.Health``) answers for the overall server ("") and for
``moejax.v1.Scoring``. Threads: gRPC's pool runs the handlers (``workers``; at most
``max_concurrent_rpcs`` calls at once, more get RESOURCE_EXHAUSTED from gRPC), each
``ScoreStream`` has one reader thread, and one worker thread owns the Scorer
(:mod:`serving.grpc.batcher`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from serving.grpc import convert, decoding, scoring_pb2 as pb
from serving.grpc.auth import BearerTokenInterceptor
from serving.grpc.batcher import Batcher
from serving.grpc.service import SERVICE_NAME, ScoringService

log = logging.getLogger("moejax.grpc")


@dataclasses.dataclass
class ServerOptions:
    """Server settings (the ``moejax serve`` flags).

    ``port`` 0 picks a free port. ``max_queued_tokens``: admission bound (estimated tokens
    queued or being scored). ``batch_tokens``: estimated tokens per Scorer call (default
    4 x the Scorer's ``max_batch_tokens``). ``grace_seconds``: how long in-flight calls may
    run after a stop. ``drain_seconds``: time between health NOT_SERVING and refusing new
    calls (for load balancers to notice). ``token``: require ``authorization: Bearer
    <token>`` on Scoring calls. ``tls_cert`` / ``tls_key``: PEM files; TLS when both are set.
    ``max_message_mib``: largest request message accepted.
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
    workers: int = 64
    max_concurrent_rpcs: int = 256

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("TLS needs both a certificate (--tls-cert) and a key (--tls-key)")
        if min(self.max_queued_tokens, self.max_message_mib, self.workers,
               self.max_concurrent_rpcs, self.max_batch_requests) <= 0:
            raise ValueError("max_queued_tokens, max_message_mib, workers, max_concurrent_rpcs "
                             "and max_batch_requests must be positive")
        if self.grace_seconds < 0 or self.drain_seconds < 0:
            raise ValueError("grace_seconds and drain_seconds must be >= 0")

    @property
    def max_message_bytes(self) -> int:
        return int(self.max_message_mib * (1 << 20))

    @property
    def address(self) -> str:
        host = f"[{self.host}]" if ":" in self.host and not self.host.startswith("[") else self.host
        return f"{host}:{self.port}"


def _method_handlers(service: ScoringService) -> grpc.GenericRpcHandler:
    """The Scoring methods, with deserializers that name non-UTF-8 fields
    (:mod:`serving.grpc.decoding`) instead of failing the whole call."""
    handlers = {
        "Score": grpc.unary_unary_rpc_method_handler(
            service.Score, request_deserializer=lambda data: decoding.parse(pb.ScoreRequest, data),
            response_serializer=pb.ScoreResult.SerializeToString),
        "ScoreBatch": grpc.unary_unary_rpc_method_handler(
            service.ScoreBatch, request_deserializer=decoding.parse_batch,
            response_serializer=pb.ScoreBatchResponse.SerializeToString),
        "ScoreStream": grpc.stream_stream_rpc_method_handler(
            service.ScoreStream,
            request_deserializer=lambda data: decoding.parse(pb.StreamRequest, data),
            response_serializer=pb.StreamResult.SerializeToString),
        "ModelInfo": grpc.unary_unary_rpc_method_handler(
            service.ModelInfo, request_deserializer=pb.ModelInfoRequest.FromString,
            response_serializer=pb.ModelInfoResponse.SerializeToString),
    }
    return grpc.method_handlers_generic_handler(SERVICE_NAME, handlers)


class ScoringServer:
    """A gRPC server of one Scorer (see the module docstring)."""

    def __init__(self, options: ServerOptions | None = None):
        self.options = options or ServerOptions()
        self.service = ScoringService()
        self.health = health.HealthServicer()
        self.batcher: Batcher | None = None
        self.port: int | None = None
        self._server: grpc.Server | None = None

    def _set_health(self, status: int) -> None:
        for name in ("", SERVICE_NAME):
            self.health.set(name, status)

    def _credentials(self) -> grpc.ServerCredentials | None:
        opts = self.options
        if opts.tls_cert is None:
            return None
        with open(opts.tls_key, "rb") as key, open(opts.tls_cert, "rb") as cert:
            return grpc.ssl_server_credentials([(key.read(), cert.read())])

    def start(self) -> int:
        """Bind and start serving health and reflection; returns the bound port."""
        opts = self.options
        interceptors = ([BearerTokenInterceptor(opts.token, f"/{SERVICE_NAME}/")]
                        if opts.token else [])
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=opts.workers,
                                       thread_name_prefix="moejax-grpc"),
            interceptors=interceptors, maximum_concurrent_rpcs=opts.max_concurrent_rpcs,
            options=[("grpc.max_receive_message_length", opts.max_message_bytes),
                     ("grpc.so_reuseport", 0)])
        server.add_generic_rpc_handlers((_method_handlers(self.service),))
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME), server)
        self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        credentials = self._credentials()
        try:
            port = (server.add_secure_port(opts.address, credentials) if credentials
                    else server.add_insecure_port(opts.address))
        except RuntimeError as exc:
            raise OSError(f"cannot listen on {opts.address}: {exc}") from exc
        if port == 0:
            raise OSError(f"cannot listen on {opts.address}")
        server.start()
        self._server, self.port = server, port
        log.info("listening on %s:%d (%s, %s); health NOT_SERVING until the model is loaded",
                 opts.host, port, "TLS" if credentials else "plaintext",
                 "bearer-token auth" if opts.token else "no auth")
        return port

    def attach(self, scorer: Any) -> None:
        """Serve ``scorer`` (loaded and calibrated): start its worker; health SERVING."""
        opts = self.options
        scorer_info = scorer.info
        batch_tokens = opts.batch_tokens or 4 * int(scorer_info["max_batch_tokens"])
        self.batcher = Batcher(scorer, max_queued_tokens=opts.max_queued_tokens,
                               batch_tokens=batch_tokens,
                               max_batch_requests=opts.max_batch_requests)
        info = convert.info_to_proto(scorer_info, max_queued_tokens=opts.max_queued_tokens,
                                     max_message_bytes=opts.max_message_bytes)
        self.service.attach(self.batcher, info)
        self._set_health(health_pb2.HealthCheckResponse.SERVING)
        log.info("serving %s (%s, %s backend); health SERVING", info.architecture,
                 scorer_info.get("model_dir", "?"), info.backend)

    def stats(self) -> dict[str, int]:
        """The batcher's counters (batches, scored, dropped_expired, peak_queued_tokens, ...)."""
        return self.batcher.snapshot() if self.batcher is not None else {}

    def stop(self, grace: float | None = None) -> None:
        """Health NOT_SERVING, wait ``drain_seconds``, refuse new calls, let in-flight calls
        finish within ``grace`` seconds (default ``grace_seconds``), stop the worker."""
        if self._server is None:
            return
        grace = self.options.grace_seconds if grace is None else grace
        self.health.enter_graceful_shutdown()
        if self.options.drain_seconds > 0:
            time.sleep(self.options.drain_seconds)
        self.service.stopping.set()
        log.info("stopping: refusing new calls, %.1f s for %d in-flight ones", grace,
                 self.service.in_flight)
        done = self._server.stop(grace)  # refuses new calls at once
        # Wait for the scoring calls only: health Watch streams would hold the whole grace.
        deadline = time.monotonic() + grace
        while self.service.in_flight > 0 and time.monotonic() < deadline:
            time.sleep(0.02)
        self._server.stop(0)  # cancels what is left (watches, calls over the grace period)
        done.wait()
        if self.batcher is not None:
            self.batcher.stop(timeout=max(grace, 1.0))
        self._server = None
        log.info("stopped")
