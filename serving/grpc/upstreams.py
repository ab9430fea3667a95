"""The upstream ``moejax serve`` servers of ``moejax router``: addresses, channels, health,
and what the router knows and decides about them (its Router and shadow caches).

Why a module of its own: which upstreams may take work now is a question of the network
(health checks, failed calls, a server that restarted), and which one gets a request is a
question of routing state; both are apart from forwarding calls and retrying them
(:mod:`serving.grpc.upstream_router`).

* :func:`parse_upstreams` — the ``--upstream HOST:PORT,...`` list, each value checked
  (a bad one is named in the error);
* :class:`UpstreamOptions` — auth and TLS toward the upstreams (bearer token, CA, name);
* :class:`Upstream` — one server: its ``grpc.aio`` channel and stubs, its last health
  status, its ``ModelInfo`` and whether that matches the router's model;
* :class:`UpstreamPool` — all of them, with one health task per upstream that calls
  ``grpc.health.v1.Health/Check`` for ``moejax.v1.Scoring`` every ``health_interval``
  seconds.

An upstream takes new work iff its last health check said SERVING, its ``ModelInfo``
matched the router's model, and no call failed on it with a connection-level error since
that check (:meth:`UpstreamPool.suspect`: it is out until the next check says SERVING
again). A check that could not reach the server at all marks the upstream *lost*: when it
comes back it may be a restarted process, with an empty prefix cache and possibly another
model, so its ``ModelInfo`` is fetched and checked again and ``on_reset`` tells the router
to forget what it believed was cached there.

Periodic ``Check`` rather than ``Watch``: a Watch stream says nothing while the status stays
the same, so it cannot re-admit an upstream that a failed call made suspect; one Check per
upstream per interval is cheap, and an interval is also how fast a dead upstream is noticed
when no call is running on it.

Routing (:class:`RoutingCore`): the requests' ops (``serving.requests`` with the model's
tokenizer), a ``serving.router`` Router with one engine per upstream that never chooses an
upstream that takes no work (:func:`make_upstream_router`), and per upstream an LRU model
of its prefix cache (:class:`ShadowCache`) that turns answers into the Router's
``BlocksStored`` / ``BlocksEvicted`` events.

Everything here runs on the router's event loop (one thread): no locks (only
:meth:`RoutingCore.prepare` and :meth:`RoutingCore.prepare_generation`, which touch no
state, run on worker threads).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import ipaddress
import json
import logging
import math
import os
from typing import Any, Callable, Iterable, Sequence

import grpc
import numpy as np
from grpc_health.v1 import health_pb2, health_pb2_grpc

from moejax.config import ModelConfig
from moejax.ops import PrefillOp
from serving.grpc import convert, scoring_pb2 as pb, scoring_pb2_grpc
from serving.limits import RequestLimits
from serving.requests import RequestError, TokenizerAdapter, normalize_requests
from serving.router import (Assignment, BlocksEvicted, BlocksStored, FlopsExecuted,
                            LeastTokensRouter, PrefixAwareRouter, Router, make_router)

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


def read_pem(value: str | bytes | None) -> bytes | None:
    """PEM bytes of a path (or the bytes themselves); ValueError naming an unreadable file."""
    if value is None or isinstance(value, bytes):
        return value
    try:
        with open(value, "rb") as fh:
            return fh.read()
    except OSError as exc:
        raise ValueError(f"TLS CA {value}: cannot be read ({exc.strerror})") from exc


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
        return (("authorization", f"Bearer {self.token}"),) if self.token else ()

    def credentials(self) -> grpc.ChannelCredentials | None:
        """Channel credentials (None: plaintext); reads the CA file now."""
        if not (self.tls or self.tls_ca is not None):
            return None
        return grpc.ssl_channel_credentials(root_certificates=read_pem(self.tls_ca))

    def channel_options(self) -> list[tuple[str, Any]]:
        options: list[tuple[str, Any]] = [
            ("grpc.max_receive_message_length", RECEIVE_MIB << 20),
            ("grpc.max_send_message_length", -1), *CHANNEL_BACKOFF]
        if self.tls_server_name:
            options.append(("grpc.ssl_target_name_override", self.tls_server_name))
        return options


class Upstream:
    """One upstream server (see the module docstring)."""

    def __init__(self, index: int, target: str, options: UpstreamOptions,
                 credentials: grpc.ChannelCredentials | None):
        self.index, self.target = index, target
        self.metadata = options.metadata
        self.channel = (grpc.aio.secure_channel(target, credentials, options.channel_options())
                        if credentials is not None
                        else grpc.aio.insecure_channel(target, options.channel_options()))
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
        """Whether it takes new work now."""
        return (self.healthy and not self.suspect and self.info is not None
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
        self.changed = asyncio.Event()   # set (and replaced) on every availability change
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

    async def wait_available(self, timeout: float, *, generation: bool = False) -> bool:
        """Wait up to ``timeout`` seconds until some upstream takes work."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not self.available(generation=generation):
            remaining = deadline - loop.time()
            if remaining <= 0:
                return False
            try:
                await asyncio.wait_for(self.changed.wait(), remaining)
            except asyncio.TimeoutError:
                return bool(self.available(generation=generation))
        return True

    async def wait_checked(self, timeout: float) -> list[Upstream]:
        """Wait up to ``timeout`` seconds until every upstream's ModelInfo was checked;
        returns those that were not (unreachable or still loading)."""
        pending = [u for u in self.upstreams if not u.checked.is_set()]
        if pending:
            await asyncio.wait([asyncio.ensure_future(u.checked.wait()) for u in pending],
                               timeout=timeout)
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
            self._changed()

    def _changed(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()
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
                self._changed()
            await asyncio.sleep(interval)

    async def _check(self, upstream: Upstream, timeout: float) -> None:
        try:
            response = await upstream.health.Check(
                health_pb2.HealthCheckRequest(service=SCORING_SERVICE), timeout=timeout)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                upstream.lost = True   # down or unreachable: may come back as a new process
            elif exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                log.warning("%s does not serve grpc.health.v1: never used",
                            upstream.describe())
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
        upstream.info, upstream.mismatch, upstream.lost = info, mismatch, False
        upstream.checked.set()
        if was_seen:
            self.on_reset(upstream.index)


# What must agree between the router's model and an upstream's (ModelInfo field, config).
MODEL_FIELDS = (("architecture", "model_type"), ("vocab_size", "vocab_size"),
                ("max_context", "max_context"), ("num_layers", "num_layers"),
                ("num_experts", "num_experts"), ("experts_per_token", "num_experts_per_tok"))


# ---------------------------------------------------------------------------- the model
def load_model(model: str) -> tuple[ModelConfig, TokenizerAdapter, str]:
    """(config, tokenizer, name) of a model directory or built-in name; no weights."""
    from moejax.checkpoint import load_model_config, load_tokenizer, resolve_model_dir

    model_dir, is_demo = resolve_model_dir(model)
    name = os.fspath(model) if is_demo else os.path.basename(os.path.normpath(model_dir))
    return (load_model_config(model_dir), TokenizerAdapter(load_tokenizer(model_dir)), name)


def model_mismatch(cfg: ModelConfig, info: pb.ModelInfoResponse) -> str | None:
    """Why an upstream's ModelInfo is not of the model ``cfg`` (None: it is)."""
    for field, attr in MODEL_FIELDS:
        theirs, ours = getattr(info, field), getattr(cfg, attr)
        if theirs != ours:
            return f"{field} is {theirs!r} there, {ours!r} here"
    return None


# ---------------------------------------------------------------------------- routing
def _with_availability(base: type[Router]) -> type[Router]:
    """``base`` with a set ``down`` of engines (upstreams that take no work now) that are
    never chosen. Algorithm 1 sees them as absent from its open set; a baseline's own rule
    is asked again (rotation, random draw) or sees them as infinitely loaded (least
    tokens). With ``down`` empty every decision is the plain Router's."""

    class WithAvailability(base):  # type: ignore[valid-type, misc]
        down: frozenset[int] = frozenset()

        def _set_open(self, engines: Iterable[int]) -> None:   # PrefixAwareRouter only
            super()._set_open([g for g in engines if g not in self.down])

        def _choose(self, op: PrefillOp, hashes: tuple[bytes, ...],
                    limit: int) -> tuple[int, int]:
            choose = super()._choose
            if not self.down or isinstance(self, PrefixAwareRouter):
                return choose(op, hashes, limit)
            if isinstance(self, LeastTokensRouter):
                saved = list(self._tokens)
                for g in self.down:
                    self._tokens[g] = math.inf
                try:
                    return choose(op, hashes, limit)
                finally:
                    self._tokens[:] = saved
            for _ in range(64 * self.num_engines):
                engine, matched = choose(op, hashes, limit)
                if engine not in self.down:
                    return engine, matched
            raise RuntimeError("no engine is available")

    WithAvailability.__name__ = WithAvailability.__qualname__ = f"Upstream{base.__name__}"
    WithAvailability.__doc__ = base.__doc__
    return WithAvailability


_WITH_AVAILABILITY: dict[type, type] = {}


def make_upstream_router(name: str, cfg: ModelConfig, num_upstreams: int,
                         theta: float = math.inf, seed: int = 0) -> Router:
    """``serving.router.make_router(name, ...)`` that never chooses an engine in its
    ``down`` set. (The instance is made by ``make_router`` — the one place that maps a name
    to its class and arguments — and then given the subclass, which adds no state.)"""
    router = make_router(name, cfg, num_upstreams, theta=theta, seed=seed)
    base = type(router)
    if base not in _WITH_AVAILABILITY:
        _WITH_AVAILABILITY[base] = _with_availability(base)
    router.__class__ = _WITH_AVAILABILITY[base]
    return router


class ShadowCache:
    """The router's LRU model of one upstream's prefix cache (block hashes)."""

    def __init__(self, capacity: int = 0):
        self.capacity = capacity
        self._blocks: collections.OrderedDict[bytes, None] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block: bytes) -> bool:
        return block in self._blocks

    def store(self, hashes: Sequence[bytes]) -> tuple[list[bytes], list[bytes]]:
        """Use (or add) ``hashes`` -> (those now held, those evicted to make room)."""
        blocks = self._blocks
        for h in hashes:
            if h in blocks:
                blocks.move_to_end(h)
            else:
                blocks[h] = None
        evicted = self._shrink()
        gone = set(evicted)
        return [h for h in hashes if h not in gone], evicted

    def resize(self, capacity: int) -> list[bytes]:
        self.capacity = capacity
        return self._shrink()

    def clear(self) -> list[bytes]:
        evicted = list(self._blocks)
        self._blocks.clear()
        return evicted

    def _shrink(self) -> list[bytes]:
        evicted = []
        while len(self._blocks) > self.capacity:
            evicted.append(self._blocks.popitem(last=False)[0])
        return evicted


class NoUpstream(Exception):
    """No upstream takes work now."""


@dataclasses.dataclass(eq=False)
class Routed:
    """One request sent to one upstream; ``done`` once its events were fed back."""

    upstream: int
    op: PrefillOp | None
    assignment: Assignment | None
    done: bool = False


def cache_capacity(info: pb.ModelInfoResponse) -> int:
    """Blocks an upstream's prefix cache keeps across calls (0: none, or not reported)."""
    try:
        details = json.loads(info.info_json or "{}")
    except ValueError:
        return 0
    if details.get("kv_cache_free"):
        return 0
    blocks = details.get("prefix_cache_blocks")
    return int(blocks) if isinstance(blocks, (int, float)) and blocks > 0 else 0


class RoutingCore:
    """The Router with one engine per upstream, its shadow caches, and the request ->
    prefill-op preparation (see the module docstring). Not thread-safe: one event loop."""

    def __init__(self, cfg: ModelConfig, tokenizer: TokenizerAdapter, pool: UpstreamPool,
                 routing: str = "prefix", theta: float = math.inf, seed: int = 0):
        self.cfg, self.tokenizer, self.pool = cfg, tokenizer, pool
        self.router = make_upstream_router(routing, cfg, len(pool), theta, seed)
        self.shadows = [ShadowCache() for _ in range(len(pool))]
        self.limits = RequestLimits.resolve(cfg.max_context)

    # ------------------------------------------------------------------ preparing
    def prepare(self, message: pb.ScoreRequest, index: int) -> PrefillOp | None:
        """The op that stands for a scoring request (None: invalid; the upstream will say
        why). Pure: runs on any thread."""
        try:
            self.limits.check(convert.limit_view(message), index)
            ops, _, _ = normalize_requests([convert.request_from_proto(message)],
                                           self.tokenizer, vocab_size=self.cfg.vocab_size,
                                           max_context=self.cfg.max_context, start=index)
        except Exception:  # noqa: BLE001  (invalid: forwarded, the upstream answers it)
            return None
        return ops[0] if ops else None

    def prepare_generation(self, message: pb.GenerateRequest) -> PrefillOp | None:
        """The op of a generation request's prompt (its prefix), or None."""
        try:
            if message.HasField("prompt") == message.HasField("prompt_token_ids"):
                return None
            ids = (self.tokenizer.encode(message.prompt) if message.HasField("prompt")
                   else list(message.prompt_token_ids.ids))
            if not ids or len(ids) > self.cfg.max_context or \
                    not all(0 <= t < self.cfg.vocab_size for t in ids):
                return None
            return PrefillOp(key=("generate", 0), token_ids=np.asarray(ids, np.int32),
                             score_positions=[len(ids) - 1], score_token_ids=[()],
                             full_vocab=True, prefix_len=len(ids))
        except (RequestError, ValueError, TypeError):
            return None

    # ------------------------------------------------------------------ routing
    def route(self, ops: Sequence[PrefillOp | None], *, exclude: Sequence[int] = (),
              generation: bool = False) -> list[Routed]:
        """The upstream of each op, in order, in one Router call (None ops — invalid
        requests — go to the least loaded upstream, uncharged). Raises NoUpstream."""
        available = self.pool.available(generation=generation, exclude=exclude)
        if not available:
            raise NoUpstream()
        self.router.down = frozenset(range(len(self.pool))) - set(available)
        valid = [op for op in ops if op is not None]
        assignments = iter(self.router.assign(valid).assignments if valid else ())
        routed = []
        for op in ops:
            if op is None:
                routed.append(Routed(min(available, key=self.router.load), None, None))
            else:
                a = next(assignments)
                routed.append(Routed(a.engine, op, a))
        return routed

    def finish(self, routed: Routed, *, stored: bool = True) -> None:
        """The upstream answered: its cache holds the prompt's blocks now (``stored``;
        a generation stores none), and the work charged is done."""
        if routed.done:
            return
        routed.done = True
        if routed.op is None:
            return
        g, hashes = routed.upstream, self._prefix_hashes(routed.op)
        if stored:
            kept, evicted = self.shadows[g].store(hashes)
            if evicted:
                self.router.on_event(BlocksEvicted(g, evicted))
            if kept:
                self.router.on_event(BlocksStored(g, kept))
        else:
            self._release(g, hashes)
        self._executed(routed)

    def abandon(self, routed: Routed) -> None:
        """The call failed or was cancelled: nothing was stored, the charge is dropped."""
        if routed.done:
            return
        routed.done = True
        if routed.op is not None:
            self._release(routed.upstream, self._prefix_hashes(routed.op))
            self._executed(routed)

    def set_capacity(self, index: int, info: pb.ModelInfoResponse) -> None:
        """Bound upstream ``index``'s shadow by the capacity its ModelInfo reports."""
        evicted = self.shadows[index].resize(cache_capacity(info))
        if evicted:
            self.router.on_event(BlocksEvicted(index, evicted))

    def reset(self, index: int) -> None:
        """Forget every block believed cached (or promised) on upstream ``index``."""
        self.shadows[index].clear()
        held = self.router.committed_blocks(index) | self.router.pending_blocks(index)
        if held:
            self.router.on_event(BlocksEvicted(index, list(held)))

    def _prefix_hashes(self, op: PrefillOp) -> list[bytes]:
        size = self.router.block_size
        return list(op.block_hashes(size)[:op.prefix_len // size])

    def _release(self, g: int, hashes: Sequence[bytes]) -> None:
        # Promised blocks that never arrived (those the shadow holds are really there).
        missing = [h for h in hashes if h not in self.shadows[g]]
        if missing:
            self.router.on_event(BlocksEvicted(g, missing))

    def _executed(self, routed: Routed) -> None:
        self.router.on_event(FlopsExecuted(routed.upstream, routed.assignment.cost,
                                           tokens=len(routed.op.token_ids)))
