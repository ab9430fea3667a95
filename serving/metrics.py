"""Prometheus metrics of a scoring server (``prometheus_client``).

Two kinds, on one registry per server (so that servers in one process do not collide):

* **Events**, observed as they happen: requests by endpoint, kind and status; their end-to-end
  seconds and their seconds in the queue; each model call's request count,
  token-equivalents and seconds.
* **State**, read from the live objects at scrape time (:class:`StateCollector`, nothing is
  counted twice and the hot path does no extra work): the queue (length, queued
  token-equivalents against the admission bound, refusals), and per engine the compiles,
  the FLOPs executed and Θ, the prefix tokens read from the cache, and the model calls.

Names follow the Prometheus convention: ``moejax_..._total`` for counters, units in the
name (``_seconds``, ``_flops``), ``token_equivalents`` for the admission's cost unit (FLOPs
over one token's linear FLOPs). README "Metrics" lists them.

A request's ``status``: ``ok``; ``error`` (answered with an error result: an invalid
request in a batch or stream, or one the model could not score); ``invalid`` (a unary
call refused as invalid); ``refused`` (overload: retry later); ``expired`` (its deadline
passed in the queue); ``cancelled`` (its caller went away); ``failed`` (the model failed on
its batch).
"""

from __future__ import annotations

from typing import Any, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from serving.requests import KINDS

STATUSES = ("ok", "error", "invalid", "refused", "expired", "cancelled", "failed")
# Seconds: from a cached short request (~1 ms) to a long queue (minutes).
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
                   10.0, 30.0, 60.0, 120.0, 300.0)
COUNT_BUCKETS = tuple(float(2 ** i) for i in range(13))          # 1 … 4,096 requests
TOKEN_BUCKETS = tuple(float(2 ** i) for i in range(4, 21))       # 16 … 1M token-equivalents


class MetricsEndpoint:
    """A registry of one server's metrics, and its HTTP endpoint when served."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry if registry is not None else CollectorRegistry()
        self._http: Any = None

    def serve(self, port: int, host: str = "127.0.0.1") -> int:
        """Expose the registry on ``http://host:port/metrics`` (its own thread); returns
        the bound port (``port`` 0 picks a free one)."""
        server, thread = start_http_server(port, addr=host, registry=self.registry)
        self._http = (server, thread)
        return int(server.server_address[1])

    def close(self) -> None:
        """Stop the metrics endpoint of :meth:`serve` (if any)."""
        if self._http is not None:
            server, thread = self._http
            server.shutdown()
            server.server_close()
            thread.join(5)
            self._http = None


class ServingMetrics(MetricsEndpoint):
    """The metrics of one scoring server (module docstring); ``registry`` is what to
    expose."""

    def __init__(self, registry: CollectorRegistry | None = None):
        super().__init__(registry)
        r = self.registry
        self.requests = Counter("moejax_requests", "Scoring requests answered, by endpoint, "
                                "request kind and status", ["endpoint", "kind", "status"],
                                registry=r)
        self.request_seconds = Histogram(
            "moejax_request_duration_seconds", "Seconds from a request's admission to its "
            "answer (queue and model), by endpoint", ["endpoint"], buckets=LATENCY_BUCKETS,
            registry=r)
        self.queue_seconds = Histogram(
            "moejax_queue_wait_seconds", "Seconds a request waited in the queue before its "
            "first model call", buckets=LATENCY_BUCKETS, registry=r)
        self.batch_requests = Histogram(
            "moejax_model_call_requests", "Requests (or parts of one) per model call",
            buckets=COUNT_BUCKETS, registry=r)
        self.batch_tokens = Histogram(
            "moejax_model_call_token_equivalents", "Token-equivalents computed per model call",
            buckets=TOKEN_BUCKETS, registry=r)
        self.batch_seconds = Histogram(
            "moejax_model_call_seconds", "Seconds per model call", buckets=LATENCY_BUCKETS,
            registry=r)
        self.ttft_seconds = Histogram(
            "moejax_generation_time_to_first_token_seconds", "Seconds from a generation "
            "call's admission to its first token", buckets=LATENCY_BUCKETS, registry=r)
        self.tpot_seconds = Histogram(
            "moejax_generation_time_per_output_token_seconds", "Seconds per output token "
            "after the first", buckets=LATENCY_BUCKETS, registry=r)
        self.generated = Counter("moejax_generation_tokens", "Tokens generated", registry=r)
        self._state: StateCollector | None = None

    # ------------------------------------------------------------------ events
    def request_done(self, endpoint: str, kind: str, status: str,
                     seconds: float | None = None, count: int = 1) -> None:
        """``count`` requests answered (``seconds``: one's since its admission, when it was
        admitted).
        A kind that is not one of the request kinds counts as ``unknown`` (a label value
        never comes from what a client wrote: the series stay few;
        ``serving.requests.request_kind``)."""
        if status not in STATUSES:
            raise ValueError(f"unknown request status {status!r}; known: {STATUSES}")
        self.requests.labels(endpoint, kind if kind in KINDS else "unknown", status).inc(count)
        if seconds is not None:
            self.request_seconds.labels(endpoint).observe(seconds)

    def queue_wait(self, seconds: float) -> None:
        self.queue_seconds.observe(seconds)

    def model_call(self, requests: int, token_equivalents: int, seconds: float) -> None:
        self.batch_requests.observe(requests)
        self.batch_tokens.observe(token_equivalents)
        self.batch_seconds.observe(seconds)

    def first_token(self, seconds: float, tokens: int) -> None:
        """A generation's first token(s) arrived ``seconds`` after its admission."""
        self.ttft_seconds.observe(seconds)
        self.generated.inc(tokens)

    def output_tokens(self, tokens: int, seconds_per_token: float) -> None:
        """``tokens`` more tokens of a generation, ``seconds_per_token`` apart."""
        for _ in range(tokens):
            self.tpot_seconds.observe(seconds_per_token)
        self.generated.inc(tokens)

    # ------------------------------------------------------------------ state
    def watch(self, scorer: Any = None, batcher: Any = None, generation: Any = None) -> None:
        """Report ``scorer``'s engines, ``batcher``'s queue and the ``generation``
        service's streams and KV blocks at every scrape."""
        if self._state is None:
            self._state = StateCollector()
            self.registry.register(self._state)
        state = self._state
        state.scorer, state.batcher, state.generation = scorer, batcher, generation

class RouterMetrics(MetricsEndpoint):
    """The metrics of ``moejax router`` (:class:`RouterCollector`, read at scrape time)."""

    def __init__(self, server: Any, registry: CollectorRegistry | None = None):
        super().__init__(registry)
        self.registry.register(RouterCollector(server))


class RouterCollector(Collector):
    """Per upstream of a :class:`serving.grpc.upstream_router.RouterServer`: whether it
    takes work, the requests routed to it, its queued load and Θ in FLOPs, and the blocks
    the router believes it caches."""

    def __init__(self, server: Any):
        self.server = server

    def collect(self) -> Iterator[Any]:
        core, pool = self.server.core, self.server.pool
        if core is None or pool is None:
            return
        labels = ["upstream"]
        serving = GaugeMetricFamily("moejax_router_upstream_serving", "1 when the upstream "
                                    "takes work (health SERVING, same model)", labels=labels)
        routed = CounterMetricFamily("moejax_router_routed_requests", "Requests routed to the "
                                     "upstream", labels=labels)
        load = GaugeMetricFamily("moejax_router_upstream_load_flops", "FLOPs routed to the "
                                 "upstream and not yet answered (W_g)", labels=labels)
        cached = GaugeMetricFamily("moejax_router_cached_blocks", "Prefix blocks the router "
                                   "believes the upstream caches", labels=labels)
        theta = GaugeMetricFamily("moejax_router_theta_flops", "The saturation threshold Θ "
                                  "of the upstream", labels=labels)
        thetas = getattr(core.router, "thetas", None)
        for upstream in pool.upstreams:
            g, label = upstream.index, [upstream.target]
            serving.add_metric(label, 1.0 if upstream.serving else 0.0)
            routed.add_metric(label, core.routed[g])
            load.add_metric(label, float(core.router.load(g)))
            cached.add_metric(label, len(core.shadows[g]))
            if thetas is not None:
                theta.add_metric(label, float(thetas[g]))
        yield from (serving, routed, load, cached, theta)


class StateCollector(Collector):
    """What the server's objects hold now, read at scrape time (module docstring)."""

    def __init__(self) -> None:
        self.scorer: Any = None
        self.batcher: Any = None
        self.generation: Any = None

    def collect(self) -> Iterator[Any]:
        if self.batcher is not None:
            yield from _queue_metrics(self.batcher.snapshot())
        loads: dict[str, Any] = {}
        if self.scorer is not None:
            yield from _engine_metrics(self.scorer)
            counted = [e.stats.expert_tokens for e in self.scorer.engines
                       if e.stats.expert_tokens is not None]
            if counted:
                loads["prefill"] = sum(counted[1:], counted[0])
        if self.generation is not None and self.generation.loop is not None:
            yield _gauge("moejax_generation_streams", "Generation calls admitted and not "
                         "yet out of the scheduler", self.generation.streams)
            yield _gauge("moejax_kv_blocks_in_use", "KV blocks held by running sequences",
                         self.generation.loop.occupancy())
            decode = self.generation.loop.decode_expert_tokens()
            if decode is not None:
                loads["decode"] = decode
        if loads:
            yield _expert_load(loads)


def _expert_load(loads: dict[str, Any]) -> CounterMetricFamily:
    """Tokens routed to each expert at each layer, by phase: every scoring step's
    ("prefill", what EPLB balances) and one decode step in
    ``moejax.core.continuous.EXPERT_SAMPLE_EVERY`` ("decode", what METRO and ELDR act on).
    One series per (phase, layer, expert) that has routed a token."""
    family = CounterMetricFamily("moejax_expert_tokens", "Tokens routed to each expert at "
                                 "each layer (decode: sampled steps)",
                                 labels=["phase", "layer", "expert"])
    for phase, counts in loads.items():
        for layer, expert in zip(*counts.nonzero()):
            family.add_metric([phase, str(layer), str(expert)], float(counts[layer, expert]))
    return family


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _queue_metrics(snapshot: dict[str, int]) -> Iterator[Any]:
    yield _gauge("moejax_queue_length", "Requests queued for the model now",
                 snapshot["queue_length"])
    yield _gauge("moejax_queued_token_equivalents", "Token-equivalents admitted and not yet "
                 "answered", snapshot["queued_tokens"])
    yield _gauge("moejax_max_queued_token_equivalents", "The admission bound on queued "
                 "token-equivalents", snapshot["max_queued_tokens"])
    yield _counter("moejax_admission_refused", "Requests the admission bound refused "
                   "(overload)", snapshot["rejected"])


# Per engine: (metric, help, its value from the engine's EngineStats). Counters all.
_ENGINE_COUNTERS = (
    ("moejax_engine_model_calls", "Packed batches run", lambda s: s.batches),
    ("moejax_engine_compiles", "Programs compiled", lambda s: s.compiles),
    ("moejax_engine_compile_seconds", "Seconds spent compiling", lambda s: s.compile_seconds),
    ("moejax_engine_tokens", "Real (unpadded) tokens run", lambda s: s.real_tokens),
    ("moejax_engine_executed_flops", "Model FLOPs of the tokens run",
     lambda s: s.executed_flops),
    ("moejax_prefix_cache_hit_tokens", "Prompt tokens read from the prefix cache (earlier "
     "calls' blocks) instead of computed", lambda s: s.prefix_tokens_cached),
    ("moejax_prefix_shared_tokens", "Prompt tokens read from another sequence of the same "
     "call", lambda s: s.prefix_tokens_shared),
)
# Per engine with a prefix pool: (metric, help, the allocators' counter summed over ranks).
_POOL_COUNTERS = (
    ("moejax_prefix_cache_block_lookups", "Prompt blocks looked up in the prefix cache",
     "lookups"),
    ("moejax_prefix_cache_block_hits", "Prompt blocks found in the prefix cache", "hits"),
    ("moejax_prefix_cache_block_evictions", "Cached blocks evicted for room", "evictions"),
)


def _engine_metrics(scorer: Any) -> Iterator[Any]:
    engines = [(str(g), engine) for g, engine in enumerate(scorer.engines)]
    for name, doc, value in _ENGINE_COUNTERS:
        family = CounterMetricFamily(name, f"{doc}, per engine", labels=["engine"])
        for label, engine in engines:
            family.add_metric([label], value(engine.stats))
        yield family
    theta = _router_theta(scorer)
    if theta is not None:
        family = GaugeMetricFamily("moejax_engine_theta_flops", "The saturation threshold Θ "
                                   "the router admits to, per engine", labels=["engine"])
        for (label, _), value in zip(engines, theta):
            family.add_metric([label], value)
        yield family
    pooled = [(label, engine.kv_store.allocators) for label, engine in engines
              if engine.kv_store is not None]
    for name, doc, field in _POOL_COUNTERS:
        family = CounterMetricFamily(name, f"{doc}, per engine", labels=["engine"])
        for label, allocators in pooled:
            family.add_metric([label], sum(getattr(a, field) for a in allocators))
        yield family
    blocks = GaugeMetricFamily("moejax_prefix_pool_blocks", "KV blocks of the engine's pool, "
                               "by state (in_use, cached, free)", labels=["engine", "state"])
    for label, allocators in pooled:
        in_use = sum(a.num_in_use for a in allocators)
        cached = sum(a.num_cached for a in allocators)
        free = sum(a.num_blocks for a in allocators) - in_use - cached
        for state, count in (("in_use", in_use), ("cached", cached), ("free", free)):
            blocks.add_metric([label, state], count)
    yield blocks


def _router_theta(scorer: Any) -> list[float] | None:
    """Θ per engine of the Scorer's engine router, or its calibrated Θ for one engine."""
    pool = getattr(scorer, "pool", None)
    thetas = getattr(getattr(pool, "router", None), "thetas", None)
    if thetas is not None:
        return [float(t) for t in thetas]
    calibrated = getattr(getattr(scorer, "calibration", None), "theta", None)
    return None if calibrated is None else [float(calibrated)] * len(scorer.engines)


__all__ = ("STATUSES", "MetricsEndpoint", "RouterCollector", "RouterMetrics", "ServingMetrics",
           "StateCollector")
