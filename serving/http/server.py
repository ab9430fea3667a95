"""The HTTP door of ``moejax serve`` (``--http-port``): uvicorn serving the FastAPI app of
:mod:`serving.http.app` in a thread of its own, on the gRPC server's engine
(:class:`serving.grpc.server.ScoringServer`: one Scorer, one batcher, one admission bound,
one metrics registry).

It binds before the model loads: ``/health`` answers at once and ``/ready`` says 503
until the Scorer is attached to the gRPC server, and again from the moment a stop begins
(``ScoringServer.draining``), so a load balancer stops sending before calls are refused.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any

import uvicorn

from serving.http.app import make_app
from serving.http.scoring import HttpScoring

log = logging.getLogger("moejax.http")


@dataclasses.dataclass(frozen=True)
class HttpOptions:
    """``host``/``port`` (0: a free port), bearer ``token``, ``tls_cert``/``tls_key`` (PEM
    files; TLS when both are set), the largest body (``max_body_mib``) and batch
    (``max_batch_requests``) of one call, and the threads that prepare requests."""

    host: str = "127.0.0.1"
    port: int = 8000
    token: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    max_body_mib: float = 16.0
    max_batch_requests: int = 256
    workers: int = 2

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("TLS needs both a certificate (--tls-cert) and a key (--tls-key)")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"http port must be a TCP port (0 picks a free one), got {self.port}")
        if min(self.max_body_mib, self.max_batch_requests, self.workers) <= 0:
            raise ValueError("max_body_mib, max_batch_requests and workers must be positive")


class HttpServer:
    """uvicorn in a thread over ``grpc_server``'s engine (module docstring)."""

    def __init__(self, grpc_server: Any, options: HttpOptions | None = None):
        self.options = options or HttpOptions()
        self.grpc_server = grpc_server
        self.scoring = HttpScoring(grpc_server, prepare_threads=self.options.workers)
        self.port: int | None = None
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def start(self, timeout: float = 30.0) -> int:
        """Bind and serve; returns the bound port. Raises OSError when it cannot bind."""
        opts = self.options
        app = make_app(self.scoring, token=opts.token,
                       max_body_bytes=int(opts.max_body_mib * (1 << 20)),
                       max_batch_requests=opts.max_batch_requests)
        config = uvicorn.Config(app, host=opts.host, port=opts.port, log_level="warning",
                                access_log=False, lifespan="off", ssl_certfile=opts.tls_cert,
                                ssl_keyfile=opts.tls_key, timeout_graceful_shutdown=5)
        server = uvicorn.Server(config)
        failure: list[BaseException] = []

        def run() -> None:
            try:
                server.run()
            except BaseException as exc:  # noqa: BLE001  (reported by start)
                failure.append(exc)

        thread = threading.Thread(target=run, name="moejax-http", daemon=True)
        thread.start()
        deadline = time.monotonic() + timeout
        while not server.started:
            if failure or not thread.is_alive():
                raise OSError(f"HTTP server could not start on {opts.host}:{opts.port}"
                              + (f": {failure[0]}" if failure else ""))
            if time.monotonic() > deadline:
                server.should_exit = True
                raise OSError(f"HTTP server did not start within {timeout} s")
            time.sleep(0.01)
        self._server, self._thread = server, thread
        self.port = int(server.servers[0].sockets[0].getsockname()[1])
        log.info("HTTP on %s://%s:%d (%s)", "https" if opts.tls_cert else "http", opts.host,
                 self.port, "bearer-token auth" if opts.token else "no auth")
        return self.port

    def stop(self, timeout: float = 10.0) -> None:
        """Stop accepting, let calls in flight end (uvicorn's graceful shutdown), join."""
        if self._server is None:
            return
        self._server.should_exit = True
        self._thread.join(timeout)
        self.scoring.close()
        self._server = self._thread = None


__all__ = ("HttpOptions", "HttpServer")
