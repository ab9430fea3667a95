"""``moejax router``: one gRPC server in front of many ``moejax serve`` upstreams, speaking
the same ``moejax.v1`` API (Scoring, Generation, grpc.health.v1).

Why: one ``moejax serve`` is one model replica; more throughput means more replicas, and a
prefix-aware choice of replica per request keeps each prompt's KV cache hits on the replica
that holds them. The choice is Algorithm 1 of :mod:`moejax.core.router` — the same Router
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

Modules (this one is the server; the others are its parts, each for one job):

* :mod:`serving.grpc.upstreams` — the upstreams: channels, health checks, which take work;
* :mod:`serving.grpc.router_core` — the Router, the op preparation and the shadow caches
  (:class:`~serving.grpc.router_core.RoutingCore`): which upstream gets a request;
* :mod:`serving.grpc.router_service` — the call handlers (:class:`RouterService`):
  forwarding and retrying;
* :mod:`serving.grpc.router_stream` — ``ScoreStream`` over upstream streams;
* :mod:`serving.grpc.router_calls` — the failure rules and types the handlers share;
* this module — :class:`RouterOptions` and :class:`RouterServer`: binding, auth and TLS
  toward clients, health, Θ, start and stop.

Cache contents: the router's own model of what it sent where, an LRU of block hashes per
upstream bounded by its real capacity; it can only cost cache hits, never correctness
(:mod:`serving.grpc.router_core`).

Failures: a call that fails with a transport-level code (UNAVAILABLE, DEADLINE_EXCEEDED of
``--upstream-timeout``, an upstream-side CANCELLED, ABORTED, UNKNOWN, INTERNAL) or with
RESOURCE_EXHAUSTED is retried once on another upstream that takes work (chosen by the same
Router without the failed one); each request is answered exactly once or refused with a
status. If the retry fails too (or no other upstream serves; with none serving a call is
refused at once, never after a wait): ``Score`` / ``Generate`` end with the last status (a
RESOURCE_EXHAUSTED keeps its ``retry-after-ms`` hint), a ``ScoreBatch`` call likewise
(a batch is answered whole, as by a server), and a ``ScoreStream`` call likewise once the
other upstream streams delivered what they owe (its unanswered requests get no result: the
client sends them again; UNAVAILABLE when no upstream serves). Other codes
(UNAUTHENTICATED, ...) are passed through at once, a stream's too. So an error result is
always a refusal of the request itself (by an upstream, or as undecodable), never a
transport failure. A ``Generate`` stream is retried only before its first token was
forwarded. In a stream, the upstream timeout is the longest wait for the next result while
results are owed.

Streams: each ``ScoreStream`` call forwards its requests on one upstream ``ScoreStream``
per upstream it uses, at most ``stream_window`` of them unanswered at once, results matched
back by index (:mod:`serving.grpc.router_stream`).

Threads: a ``grpc.aio`` server and ``grpc.aio`` upstream channels on the process's one gRPC
event loop (:func:`serving.grpc.server.server_loop`), routing state touched only there;
tokenizing runs on a small thread pool.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from typing import Any, Sequence

import grpc
from grpc_health.v1 import health_pb2

from moejax.config import ModelConfig
from serving.grpc import scoring_pb2 as pb
from serving.grpc.router_core import RoutingCore, load_model, model_mismatch
from serving.grpc.router_service import RouterService
# The server's handler tables take any object with the handler methods, and its one event
# loop per process is where every grpc.aio object of this process must live.
from moejax.core.router import PrefixAwareRouter
from serving.grpc.server import (add_health_and_reflection, generation_handlers,
                                 listen, listen_address, new_server, scoring_handlers,
                                 server_credentials, server_loop)
from serving.grpc.upstreams import (GENERATION_SERVICE, SCORING_SERVICE, UpstreamOptions,
                                    UpstreamPool)
from serving.requests import TokenizerAdapter
from serving.metrics import RouterMetrics

log = logging.getLogger("moejax.grpc.router")


@dataclasses.dataclass
class RouterOptions:
    """``moejax router`` settings. ``upstreams``: "HOST:PORT" targets. ``model``: the
    upstreams' model (dir or built-in name: config and tokenizer only). ``routing``: a
    ``moejax.core.router.ROUTER_NAMES`` name. ``theta``: Θ in FLOPs (default: the first
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
    metrics_port: int | None = None   # Prometheus metrics over HTTP (0: a free port)

    def __post_init__(self) -> None:
        from moejax.core.router import ROUTER_NAMES

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
        return listen_address(self.host, self.port)


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
        self._health_updates: set[asyncio.Future] = set()
        self.metrics = RouterMetrics(self)
        self.metrics_port: int | None = None

    def _run(self, coroutine: Any, timeout: float | None = None) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    def start(self) -> int:
        """Bind, serve health (NOT_SERVING until an upstream serves), watch the upstreams;
        returns the bound port."""
        opts = self.options
        credentials = server_credentials(opts.tls_cert, opts.tls_key)
        opts.upstream.credentials()     # an unreadable CA fails here, before binding
        if opts.metrics_port is not None:
            self.metrics_port = self.metrics.serve(opts.metrics_port, opts.host)
        self._loop = server_loop()
        try:
            self.port = self._run(self._start(credentials))
        except BaseException:
            self.metrics.close()
            raise
        log.info("router listening on %s:%d (%s, %s) over %d upstreams, %s routing",
                 opts.host, self.port, "TLS" if credentials else "plaintext",
                 "bearer-token auth" if opts.token else "no auth", len(opts.upstreams),
                 opts.routing)
        if self.metrics_port is not None:
            log.info("router metrics on http://%s:%d/metrics", opts.host, self.metrics_port)
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
        services = (SCORING_SERVICE, GENERATION_SERVICE)
        server = new_server(services, token=opts.token,
                            max_message_bytes=int(opts.max_message_mib * (1 << 20)))
        server.add_generic_rpc_handlers((scoring_handlers(self.service),
                                         generation_handlers(self.service)))
        self._health = add_health_and_reflection(server, services)
        await self._publish_health()
        port = listen(server, opts.address, credentials)
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
        # Kept until done: stop() awaits what is still running (a task the loop drops
        # unfinished is logged as "destroyed but pending").
        update = asyncio.ensure_future(self._publish_health())
        self._health_updates.add(update)
        update.add_done_callback(self._health_updates.discard)

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
        self.metrics.close()
        self._server = None
        log.info("router stopped")

    async def _stop(self, grace: float) -> None:
        await self._health.enter_graceful_shutdown()
        deadline = time.monotonic() + grace
        while self.service.in_flight > 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        await self._server.stop(0)
        await self.pool.close()
        await asyncio.gather(*self._health_updates, return_exceptions=True)
