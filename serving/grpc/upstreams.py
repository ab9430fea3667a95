"""The upstream ``moejax serve`` servers of ``moejax router``: addresses, channels, health,
and which of them take work now.

Why a module of its own: which upstreams may take work now is a question of the network
(health checks, failed calls, a server that restarted), apart from which one gets a
request (:mod:`serving.grpc.router_core`) and from forwarding calls and retrying them
(:mod:`serving.grpc.router_service`, :mod:`serving.grpc.router_stream`).

* :func:`parse_upstreams` — the ``--upstream HOST:PORT,...`` list, each value checked
  (a bad one is named in the error);
* :class:`UpstreamOptions` — auth and TLS toward the upstreams (bearer token, CA, name);
* :class:`Upstream` — one server: its ``grpc.aio`` channel and stubs, its last health
  status, its ``ModelInfo`` and whether that matches the router's model;
* :class:`UpstreamPool` — all of them, with one health task per upstream that calls
  ``grpc.health.v1.Health/Check`` for ``moejax.v1.Scoring`` every ``health_interval``
  seconds.

Channels are made as :class:`serving.grpc.client.Client` makes its own
(:func:`serving.grpc.client.channel_credentials`, :func:`serving.grpc.client.open_channel`),
as ``grpc.aio`` channels on the router's event loop.

An upstream takes new work iff its last health check said SERVING, its ``ModelInfo``
matched the router's model, and no call failed on it with a connection-level error since
that check (:meth:`UpstreamPool.suspect`: it is out until the next check says SERVING
again). A check that got no answer (any gRPC error but UNIMPLEMENTED: unreachable, timed
out, or cancelled by a server shutting down) marks the upstream *lost*: when it comes back
it may be a restarted process, with an empty prefix cache and possibly another model, so
its ``ModelInfo`` is fetched and checked again and ``on_reset`` tells the router to forget
what it believed was cached there. Presuming a restart costs one ModelInfo and a colder
shadow; presuming none when there was one routes by a cache that is gone.

Periodic ``Check`` rather than ``Watch``: a Watch stream says nothing while the status stays
the same, so it cannot re-admit an upstream that a failed call made suspect; one Check per
upstream per interval is cheap, and an interval is also how fast a dead upstream is noticed
when no call is running on it.

What the router decides about the upstreams (:class:`RoutingCore`, :class:`ShadowCache`,
:func:`load_model`, :func:`cache_capacity`) is :mod:`serving.grpc.router_core`; those four
names are importable from here too.

Everything here runs on the router's event loop (one thread): no locks.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import logging
from typing import Callable, Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from serving.grpc import scoring_pb2 as pb, scoring_pb2_grpc
from serving.grpc.client import bearer_metadata, channel_credentials, open_channel

log = logging.getLogger("moejax.grpc.router")

SCORING_SERVICE = pb.DESCRIPTOR.services_by_name["Scoring"].full_name
GENERATION_SERVICE = pb.DESCRIPTOR.services_by_name["Generation"].full_name
RECEIVE_MIB = 256     # largest message accepted from an upstream (a big ScoreBatch answer)
# Reconnect quickly after an upstream restarts: gRPC's default backoff grows to 120 s.
CHANNEL_BACKOFF = (("grpc.initial_reconnect_backoff_ms", 200),
                   ("grpc.min_reconnect_backoff_ms", 200),
                   ("grpc.max_reconnect_backoff_ms", 1000))


def parse_upstreams(text: str) -> list[str]:
    """``"HOST:PORT,HOST:PORT,..."`` -> the targets, in order. HOST is a name, an IPv4
    address or a bracketed IPv6 address (``[::1]:50051``); PORT is 1-65535. Raises
    ValueError naming the first bad value (empty items, a missing or bad port, a
    duplicate)."""
    if not text or not text.strip():
        raise ValueError("--upstream: give at least one HOST:PORT")
    targets: list[str] = []
    for raw in text.split(","):
        value = raw.strip()
        if not value:
            raise ValueError(f"--upstream {text!r}: empty value between commas")
        host, sep, port = value.rpartition(":")
        if not sep or not host:
            raise ValueError(f"--upstream value {value!r}: expected HOST:PORT")
        if not port.isdigit() or not 1 <= int(port) <= 65535:
            raise ValueError(f"--upstream value {value!r}: port {port!r} is not a number "
                             f"in 1-65535")
        if host.startswith("["):
            if not host.endswith("]"):
                raise ValueError(f"--upstream value {value!r}: unclosed '[' in the host")
            try:
                ipaddress.IPv6Address(host[1:-1])
            except ValueError:
                raise ValueError(f"--upstream value {value!r}: {host} is not an IPv6 "
                                 f"address") from None
        elif ":" in host:
            raise ValueError(f"--upstream value {value!r}: write an IPv6 host in brackets, "
                             f"e.g. [::1]:{port}")
        elif any(c.isspace() or c in "/@?#" for c in host):
            raise ValueError(f"--upstream value {value!r}: {host!r} is not a host name")
        target = f"{host}:{int(port)}"
        if target in targets:
            raise ValueError(f"--upstream value {value!r}: listed twice")
        targets.append(target)
    return targets


@dataclasses.dataclass(frozen=True)
class UpstreamOptions:
    """How the router talks to its upstreams.

    ``token``: bearer token sent to them. TLS: ``tls_ca`` (PEM path or bytes of the CA, or
    of a self-signed server certificate) or ``tls`` (the system's root CAs);
    ``tls_server_name``: the name checked against their certificates. ``timeout``: seconds
    an upstream call may take (a stream: seconds without any result while it owes some)
    before it counts as failed. ``health_interval``: seconds between health checks."""

    token: str | None = None
    tls: bool = False
    tls_ca: str | bytes | None = None
    tls_server_name: str | None = None
    timeout: float = 120.0
    health_interval: float = 0.5

    def __post_init__(self) -> None:
        if not self.timeout > 0:
            raise ValueError(f"the upstream timeout must be > 0 seconds, got {self.timeout}")
        if not self.health_interval > 0:
            raise ValueError(f"the health interval must be > 0 seconds, got "
                             f"{self.health_interval}")
        if self.token is not None and not self.token:
            raise ValueError("the upstream token must not be empty")

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return bearer_metadata(self.token)

    def credentials(self) -> grpc.ChannelCredentials | None:
        """Channel credentials (None: plaintext); reads the CA file now."""
        return channel_credentials(self.tls, self.tls_ca)


class Upstream:
    """One upstream server (see the module docstring)."""

    def __init__(self, index: int, target: str, options: UpstreamOptions,
                 credentials: grpc.ChannelCredentials | None):
        self.index, self.target = index, target
        self.metadata = options.metadata
        self.channel = open_channel(target, credentials, max_receive_bytes=RECEIVE_MIB << 20,
                                    tls_server_name=options.tls_server_name,
                                    options=(("grpc.max_send_message_length", -1),
                                             *CHANNEL_BACKOFF), aio=True)
        self.scoring = scoring_pb2_grpc.ScoringStub(self.channel)
        self.generation = scoring_pb2_grpc.GenerationStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)
        self.healthy = False            # the last health check said SERVING
        self.suspect = False            # a call failed since that check
        self.lost = True                # unreachable since its info was checked
        self.info: pb.ModelInfoResponse | None = None
        self.mismatch: str | None = None   # why its model is not the router's
        self.checked = asyncio.Event()  # set once its ModelInfo was checked (or refused)

    @property
    def serving(self) -> bool:
        """Whether it takes new work now. One that was lost takes none until its ModelInfo
        is checked again: it may be a new process (another model, an empty cache)."""
        return (self.healthy and not self.suspect and not self.lost and self.info is not None
                and self.mismatch is None)

    @property
    def generates(self) -> bool:
        return self.serving and bool(self.info.generation)

    def describe(self) -> str:
        return f"upstream {self.index} ({self.target})"


class UpstreamPool:
    """The upstreams and their health tasks. ``check_model``: a ModelInfo -> None when it
    serves the router's model, else why not. ``on_change``: called after any upstream's
    availability changed. ``on_reset(index)``: called when an upstream that was lost is
    back (its cache is presumably empty)."""

    def __init__(self, targets: Sequence[str], options: UpstreamOptions, *,
                 check_model: Callable[[pb.ModelInfoResponse], str | None],
                 on_change: Callable[[], None] = lambda: None,
                 on_reset: Callable[[int], None] = lambda index: None):
        if not targets:
            raise ValueError("the router needs at least one upstream")
        self.targets = list(targets)
        self.options = options
        self.check_model, self.on_change, self.on_reset = check_model, on_change, on_reset
        self.upstreams: list[Upstream] = []
        self._tasks: list[asyncio.Task] = []

    def __len__(self) -> int:
        return len(self.targets)

    def __getitem__(self, index: int) -> Upstream:
        return self.upstreams[index]

    async def open(self) -> None:
        """Create the channels (on the running loop) and start the health tasks."""
        credentials = self.options.credentials()
        self.upstreams = [Upstream(i, t, self.options, credentials)
                          for i, t in enumerate(self.targets)]
        self._tasks = [asyncio.create_task(self._watch(u), name=f"health-{u.target}")
                       for u in self.upstreams]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for upstream in self.upstreams:
            await upstream.channel.close()

    # ------------------------------------------------------------------ queries
    def available(self, *, generation: bool = False, exclude: Sequence[int] = ()) -> list[int]:
        """Indices of the upstreams that take new work (``generation``: Generate calls)."""
        return [u.index for u in self.upstreams
                if (u.generates if generation else u.serving) and u.index not in exclude]

    async def wait_checked(self, timeout: float) -> list[Upstream]:
        """Wait up to ``timeout`` seconds until every upstream's ModelInfo was checked;
        returns those that were not (unreachable or still loading)."""
        waiters = [asyncio.ensure_future(u.checked.wait()) for u in self.upstreams
                   if not u.checked.is_set()]
        try:
            if waiters:
                await asyncio.wait(waiters, timeout=timeout)
        finally:
            # A waiter left pending would be destroyed pending when the loop stops (asyncio
            # logs "Task was destroyed but it is pending!").
            for waiter in waiters:
                waiter.cancel()
            await asyncio.gather(*waiters, return_exceptions=True)
        return [u for u in self.upstreams if not u.checked.is_set()]

    # ------------------------------------------------------------------ events
    def suspect(self, index: int, reason: str, *, lost: bool = False) -> None:
        """A call on upstream ``index`` failed at the connection level: no new work for it
        until a health check says SERVING again. ``lost``: the connection itself failed (the
        process may come back as a new one: its ModelInfo is checked again, its cache
        presumed empty)."""
        upstream = self.upstreams[index]
        upstream.lost = upstream.lost or lost
        if not upstream.suspect:
            log.warning("%s: %s; no new work until its health check passes",
                        upstream.describe(), reason)
            upstream.suspect = True
            self.on_change()

    # ------------------------------------------------------------------ health task
    async def _watch(self, upstream: Upstream) -> None:
        interval = self.options.health_interval
        while True:
            before = upstream.serving
            await self._check(upstream, timeout=max(1.0, 2 * interval))
            if upstream.serving != before:
                log.info("%s is %s", upstream.describe(),
                         "serving" if upstream.serving else "not serving")
                self.on_change()
            await asyncio.sleep(interval)

    async def _check(self, upstream: Upstream, timeout: float) -> None:
        try:
            response = await upstream.health.Check(
                health_pb2.HealthCheckRequest(service=SCORING_SERVICE), timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                log.warning("%s does not serve grpc.health.v1: never used",
                            upstream.describe())
            else:
                # No answer: down, unreachable, or a check cancelled by a server that is
                # shutting down (CANCELLED, not UNAVAILABLE). Any of them may come back
                # as a new process with an empty cache, so its ModelInfo is checked again.
                upstream.lost = True
            upstream.healthy = False
            return
        upstream.healthy = response.status == health_pb2.HealthCheckResponse.SERVING
        if upstream.healthy:
            upstream.suspect = False
            if upstream.lost:
                await self._check_info(upstream, timeout)

    async def _check_info(self, upstream: Upstream, timeout: float) -> None:
        """Fetch and check the ModelInfo of an upstream that was lost (or never seen)."""
        try:
            info = await upstream.scoring.ModelInfo(pb.ModelInfoRequest(), timeout=timeout,
                                                    metadata=upstream.metadata)
        except grpc.aio.AioRpcError as exc:
            upstream.healthy = False
            if exc.code() in (grpc.StatusCode.UNAUTHENTICATED,
                              grpc.StatusCode.PERMISSION_DENIED):
                mismatch = f"refused the router's credentials: {exc.details()}"
                if mismatch != upstream.mismatch:
                    log.error("%s %s; never used", upstream.describe(), mismatch)
                upstream.mismatch = mismatch
                upstream.checked.set()
            return
        mismatch = self.check_model(info)
        if mismatch is not None and mismatch != upstream.mismatch:
            log.error("%s serves another model: %s; never used", upstream.describe(),
                      mismatch)
        was_seen = upstream.info is not None
        upstream.info, upstream.mismatch = info, mismatch
        if was_seen:   # before it serves again: no request may be routed by the old cache
            self.on_reset(upstream.index)
        upstream.lost = False
        upstream.checked.set()
