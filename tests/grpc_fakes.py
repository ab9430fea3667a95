"""A fake ``moejax serve`` for tests: a real gRPC server speaking ``moejax.v1`` (Scoring,
Generation) and ``grpc.health.v1``, with no model behind it.

Why: tests of things that sit in front of servers (``moejax router``, resumable clients)
need upstreams that start in milliseconds, answer deterministically, and can be made to
misbehave on cue — a real server loads a model and cannot be told to fail the next call.

Results are a pure function of the request (:func:`fake_result`): log-probabilities from a
hash of the prompt and each candidate, so any two fakes give the same answer for the same
request and a test can compute the expected answer itself. Requests are validated with
``serving.requests.parse_request`` (what needs no tokenizer), so an invalid request gets the
error a real server gives for it (INVALID_ARGUMENT for ``Score``, an error result in
``ScoreBatch`` / ``ScoreStream``). ``prompt_tokens`` is the prompt's token-id count, or its
UTF-8 byte count for text (there is no tokenizer).

    fake = FakeUpstream(port=0)
    port = fake.start()            # listening and SERVING
    fake.requests                  # every ScoreRequest received, in arrival order
    fake.set_serving(False)        # health NOT_SERVING (calls are still answered)
    fake.fail_next(2)              # the next 2 calls end with UNAVAILABLE
    fake.fail_health_next(1, grpc.StatusCode.CANCELLED)  # the next health check fails
    fake.hang_next(1)              # the next call waits until release() or cancellation
    fake.stop(); fake.start()      # down, then up again on the same port (a client's
                                   # channel may take ~1 s of gRPC backoff to reconnect)
    fake.fail_next(1, grpc.StatusCode.RESOURCE_EXHAUSTED, retry_after_ms=250)  # with a hint
    fake.fail_next(1, after=3)     # a ScoreStream answers 3 requests, then fails
    fake.calls, fake.metadata      # method names and invocation metadata, per call
    fake.hanging                   # calls waiting in a hang now
    fake_result(message, index)    # the answer any fake gives (compare with comparable())

As a process (serves until SIGTERM/SIGINT, prints its port on stdout like ``moejax serve``)::

    python -m tests.grpc_fakes --port 0 [--token T] [--tls-cert C --tls-key K]

Info: ``ModelInfo`` describes the built-in demo model's shape (``moejax.demo.demo_config``)
unless ``info`` overrides fields; ``info_json`` carries ``prefix_cache_blocks``.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import dataclasses
import hashlib
import hmac
import json
import signal
import sys
import threading
import time
from typing import Any, Callable, Iterator, Mapping

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

if __package__ in (None, ""):  # run as a script: make the repository importable
    import os

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from serving.grpc import convert, scoring_pb2 as pb  # noqa: E402
from serving.requests import RequestError, parse_request, request_label  # noqa: E402

SCORING = "moejax.v1.Scoring"
GENERATION = "moejax.v1.Generation"
HEALTH_NAMES = ("", SCORING, GENERATION)


# ---------------------------------------------------------------------------- results
def _digest(*parts: bytes) -> int:
    h = hashlib.blake2b(digest_size=8)
    for part in parts:
        h.update(len(part).to_bytes(4, "little"))
        h.update(part)
    return int.from_bytes(h.digest(), "little")


def _prompt_bytes(message: pb.ScoreRequest) -> bytes:
    if message.HasField("prompt"):
        return b"t" + message.prompt.encode("utf-8", "surrogatepass")
    return b"i" + b",".join(str(t).encode() for t in message.prompt_token_ids)


def _candidate_bytes(message: pb.ScoreRequest) -> list[bytes]:
    if message.candidates:
        return [c.encode("utf-8", "surrogatepass") for c in message.candidates]
    return [b",".join(str(t).encode() for t in c.ids) for c in message.candidate_token_ids]


def request_error(message: pb.ScoreRequest, index: int | None) -> str | None:
    """The validation error a server gives this request (None: valid), as far as it can be
    told without a tokenizer."""
    try:
        parse_request(convert.request_from_proto(message), index)
    except RequestError as exc:
        return str(exc)
    return None


def fake_result(message: pb.ScoreRequest, index: int | None = 0) -> pb.ScoreResult:
    """The fake's deterministic answer to ``message`` (``index`` names an id-less invalid
    request in its error, as a server's position does). A scored result carries timings
    (engine 0, round 0) as a real server's does; compare answers with :func:`comparable`."""
    error = request_error(message, index)
    if error is not None:
        return convert.result_to_proto(convert.error_result(convert.get_id(message), error))
    prompt = _prompt_bytes(message)
    kind = message.kind or "classify"
    raw = [-((_digest(prompt, kind.encode(), c) % 10_000) / 1000.0) - 0.001
           for c in _candidate_bytes(message)]
    result = pb.ScoreResult(logprobs=raw, label=max(range(len(raw)), key=raw.__getitem__),
                            prompt_tokens=(len(message.prompt_token_ids)
                                           if not message.HasField("prompt")
                                           else len(message.prompt.encode("utf-8",
                                                                          "surrogatepass"))))
    which = message.WhichOneof("id")
    if which is not None:
        setattr(result, which, getattr(message, which))
    # As a real server: a scored result says which of its engines ran it (error ones don't).
    result.timings.engines.append(0)
    result.timings.rounds.append(0)
    if kind == "multi":
        result.selected.SetInParent()
        result.selected.indices.extend(k for k, v in enumerate(raw) if v > -5.0)
    return result


def comparable(result: pb.ScoreResult | Any) -> Any:
    """A result (proto or ``serving.ScoreResult``) as a ``serving.ScoreResult`` without its
    timings: equal for the same answer, whichever server (or router) gave it."""
    if isinstance(result, pb.ScoreResult):
        result = convert.result_from_proto(result)
    return dataclasses.replace(result, timings=None)


def fake_generation(message: pb.GenerateRequest) -> list[int]:
    """The token ids the fake generates for ``message`` (``max_new_tokens``, default 4)."""
    if message.HasField("prompt"):
        seed = message.prompt.encode("utf-8", "surrogatepass")
    else:
        seed = b",".join(str(t).encode() for t in message.prompt_token_ids.ids)
    count = message.max_new_tokens if message.HasField("max_new_tokens") else 4
    return [_digest(seed, k.to_bytes(4, "little")) % 1000 for k in range(count)]


def demo_info(**overrides: Any) -> dict[str, Any]:
    """A ``Scorer.info``-like dict of the demo model's shape (what the fake describes)."""
    from moejax.demo import demo_config

    cfg = demo_config("demo")
    info = {"model_name": "demo", "demo": True, "model_type": cfg.model_type,
            "vocab_size": cfg.vocab_size, "max_context": cfg.max_context,
            "num_layers": cfg.num_layers, "num_experts": cfg.num_experts,
            "experts_per_token": cfg.num_experts_per_tok, "dtype": "float32",
            "device": "fake", "backend": "fake", "devices": 1, "max_batch_tokens": 4096,
            "theta_flops": None, "theta_source": "fallback", "engines": 1,
            "prefix_cache_blocks": 1024, "kv_cache_free": False, "share_prompts": True,
            "limits": {"max_text_bytes": 1 << 20, "max_token_ids": 1 << 16,
                       "max_candidates": 1024}}
    info.update(overrides)
    return info


# ---------------------------------------------------------------------------- misbehaviour
@dataclasses.dataclass
class _Fault:
    kind: str                          # "fail" | "hang"
    code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE
    details: str = "fake upstream: injected failure"
    after: int = 0                     # streams: results sent before failing
    retry_after_ms: int | None = None  # trailing metadata of an overload refusal
    seconds: float | None = None       # hang: at most this long (None: until released)
    drain: bool = False                # streams: read every request (to half-close) first


class _TokenCheck(grpc.ServerInterceptor):
    """Bearer-token check of the moejax services (health stays open, as on a real server)."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    def intercept_service(self, continuation: Callable[[Any], Any],
                          details: grpc.HandlerCallDetails) -> Any:
        handler = continuation(details)
        if handler is None or not details.method.startswith(("/moejax.v1.",)):
            return handler
        given = dict(details.invocation_metadata or ()).get("authorization", "")
        if hmac.compare_digest(given.encode(), self._expected):
            return handler

        def deny(request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "invalid bearer token")

        if handler.response_streaming and handler.request_streaming:
            return grpc.stream_stream_rpc_method_handler(deny)
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(deny)
        return grpc.unary_unary_rpc_method_handler(deny)


class _FailingHealth(health.HealthServicer):
    """The official health servicer, except that the next queued codes end ``Check`` calls
    (as a server shutting down cancels the checks in flight)."""

    def __init__(self) -> None:
        super().__init__()
        self.failures: collections.deque[grpc.StatusCode] = collections.deque()

    def Check(self, request: Any, context: grpc.ServicerContext) -> Any:
        try:
            code = self.failures.popleft()
        except IndexError:
            return super().Check(request, context)
        context.abort(code, "fake upstream: injected health failure")


# ---------------------------------------------------------------------------- the fake
class FakeUpstream:
    """A fake ``moejax serve`` (see the module docstring). Thread-safe; ``start`` and
    ``stop`` may be called any number of times (a restart keeps the port).

    ``token``: require ``authorization: Bearer <token>`` on moejax calls. ``tls_cert`` /
    ``tls_key``: PEM paths (TLS). ``info``: ``Scorer.info`` fields to override in
    :func:`demo_info`. ``delay``: seconds every scoring item takes (to keep calls in
    flight)."""

    def __init__(self, port: int = 0, *, host: str = "127.0.0.1", token: str | None = None,
                 tls_cert: str | None = None, tls_key: str | None = None,
                 info: Mapping[str, Any] | None = None, delay: float = 0.0,
                 generation: bool = True):
        self.host, self.port = host, port
        self.token, self.tls_cert, self.tls_key = token, tls_cert, tls_key
        self.info = demo_info(**dict(info or {}))
        self.delay = delay
        self.info_delay = 0.0      # seconds a ModelInfo call takes (a restarted server's gap)
        self.generation = generation
        self.requests: list[pb.ScoreRequest] = []          # every scoring item received
        self.calls: list[str] = []                         # method names, in arrival order
        self.generate_requests: list[pb.GenerateRequest] = []
        self.metadata: list[dict[str, str]] = []           # each call's invocation metadata
        self._lock = threading.Lock()
        self._faults: list[_Fault] = []
        self._health_failures: collections.deque[grpc.StatusCode] = collections.deque()
        self._release = threading.Event()
        self._serving = True
        self._server: grpc.Server | None = None
        self._health: Any = None
        self.hanging = 0                                   # calls waiting in a hang now

    # ------------------------------------------------------------------ control
    @property
    def target(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> int:
        """Listen (on the same port as before, after a stop) and serve; returns the port."""
        if self._server is not None:
            return self.port
        server = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=64),
                             interceptors=[_TokenCheck(self.token)] if self.token else [],
                             options=[("grpc.so_reuseport", 0)])
        server.add_generic_rpc_handlers((self._handlers(),))
        if self.generation:
            server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(GENERATION, {
                "Generate": grpc.unary_stream_rpc_method_handler(
                    self._generate, request_deserializer=pb.GenerateRequest.FromString,
                    response_serializer=pb.GenerateResponse.SerializeToString)}),))
        self._health = _FailingHealth()
        self._health.failures = self._health_failures
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        address = f"{self.host}:{self.port}"
        if self.tls_cert:
            with open(self.tls_key, "rb") as k, open(self.tls_cert, "rb") as c:
                credentials = grpc.ssl_server_credentials([(k.read(), c.read())])
            port = server.add_secure_port(address, credentials)
        else:
            port = server.add_insecure_port(address)
        if port == 0:
            raise OSError(f"fake upstream: cannot listen on {address}")
        self.port = port
        self._release.clear()
        self._publish_health()
        server.start()
        self._server = server
        return port

    def stop(self, grace: float | None = 0) -> None:
        """Stop serving (calls in flight are cancelled after ``grace`` seconds)."""
        server, self._server = self._server, None
        if server is None:
            return
        # Stop first, then release: a hung call must end with the stop (its client sees
        # the server go away), not be answered in the gap.
        server.stop(grace).wait()
        self._release.set()

    def set_serving(self, serving: bool) -> None:
        """Health SERVING or NOT_SERVING ("", Scoring, Generation); calls are answered
        either way (a test can see whether anything still sent some)."""
        self._serving = serving
        self._publish_health()

    def fail_next(self, n: int = 1, code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE,
                  details: str = "fake upstream: injected failure", *, after: int = 0,
                  retry_after_ms: int | None = None, drain: bool = False) -> None:
        """The next ``n`` moejax calls end with ``code``; a ``ScoreStream`` first sends
        ``after`` results (of the requests it read first). ``retry_after_ms``: sent as the
        trailing metadata ``retry-after-ms``, as a real server's overload refusal does.

        ``drain``: a ``ScoreStream`` refused at once first reads every request, until the
        caller half-closes. Only then does the refusal reach an asyncio caller (the
        router) with its code and details for sure: one that crosses a write of the
        caller's is reported to it as INTERNAL "Internal error from Core" (grpc/grpc#36066),
        which the router retries as a transport failure. Only for short streams: the
        caller must end its stream without waiting for results."""
        with self._lock:
            self._faults.extend(_Fault("fail", code, details, after, retry_after_ms,
                                       drain=drain) for _ in range(n))

    def fail_health_next(self, n: int = 1,
                         code: grpc.StatusCode = grpc.StatusCode.CANCELLED) -> None:
        """The next ``n`` health checks end with ``code`` (moejax calls are unaffected)."""
        self._health_failures.extend([code] * n)

    def hang_next(self, n: int = 1, seconds: float | None = None) -> None:
        """The next ``n`` moejax calls wait (before answering anything) until
        :meth:`release`, :meth:`stop`, their cancellation or deadline, or ``seconds``."""
        with self._lock:
            self._faults.extend(_Fault("hang", seconds=seconds) for _ in range(n))

    def release(self) -> None:
        """Let every hung call go on (and answer normally)."""
        self._release.set()

    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()

    def reset_records(self) -> None:
        with self._lock:
            self.requests.clear()
            self.calls.clear()
            self.generate_requests.clear()
            self.metadata.clear()

    def __enter__(self) -> "FakeUpstream":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ------------------------------------------------------------------ internals
    def _publish_health(self) -> None:
        if self._health is None:
            return
        status = (health_pb2.HealthCheckResponse.SERVING if self._serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for name in HEALTH_NAMES:
            self._health.set(name, status)

    def _handlers(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(SCORING, {
            "Score": grpc.unary_unary_rpc_method_handler(
                self._score, request_deserializer=pb.ScoreRequest.FromString,
                response_serializer=pb.ScoreResult.SerializeToString),
            "ScoreBatch": grpc.unary_unary_rpc_method_handler(
                self._score_batch, request_deserializer=pb.ScoreBatchRequest.FromString,
                response_serializer=pb.ScoreBatchResponse.SerializeToString),
            "ScoreStream": grpc.stream_stream_rpc_method_handler(
                self._score_stream, request_deserializer=pb.StreamRequest.FromString,
                response_serializer=pb.StreamResult.SerializeToString),
            "ModelInfo": grpc.unary_unary_rpc_method_handler(
                self._model_info, request_deserializer=pb.ModelInfoRequest.FromString,
                response_serializer=pb.ModelInfoResponse.SerializeToString)})

    def _enter(self, method: str, context: grpc.ServicerContext) -> _Fault | None:
        """Record the call; apply a hang now; return a failure to apply (or None)."""
        with self._lock:
            self.calls.append(method)
            self.metadata.append({k: v for k, v in context.invocation_metadata()
                                  if isinstance(v, str)})
            fault = self._faults.pop(0) if self._faults else None
        if fault is not None and fault.kind == "hang":
            with self._lock:
                self.hanging += 1
            try:
                deadline = None if fault.seconds is None else time.monotonic() + fault.seconds
                while context.is_active() and not self._release.is_set():
                    if deadline is not None and time.monotonic() >= deadline:
                        break
                    self._release.wait(0.02)
            finally:
                with self._lock:
                    self.hanging -= 1
            if not context.is_active():
                context.abort(grpc.StatusCode.CANCELLED, "fake upstream: call gone")
            return None
        return fault

    @staticmethod
    def _fail(fault: _Fault, context: grpc.ServicerContext) -> None:
        if fault.retry_after_ms is not None:
            context.set_trailing_metadata((("retry-after-ms", str(fault.retry_after_ms)),))
        context.abort(fault.code, fault.details)

    def _record(self, message: pb.ScoreRequest) -> None:
        with self._lock:
            self.requests.append(message)
        if self.delay:
            time.sleep(self.delay)

    def _score(self, message: pb.ScoreRequest, context: grpc.ServicerContext) -> pb.ScoreResult:
        fault = self._enter("Score", context)
        if fault is not None:
            self._fail(fault, context)
        self._record(message)
        error = request_error(message, 0)
        if error is not None:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, error)
        return fake_result(message, 0)

    def _score_batch(self, batch: pb.ScoreBatchRequest, context: grpc.ServicerContext
                     ) -> pb.ScoreBatchResponse:
        fault = self._enter("ScoreBatch", context)
        if fault is not None:
            self._fail(fault, context)
        results = []
        for index, message in enumerate(batch.requests):
            self._record(message)
            results.append(fake_result(message, index))
        return pb.ScoreBatchResponse(results=results)

    def _score_stream(self, messages: Iterator[pb.StreamRequest],
                      context: grpc.ServicerContext) -> Iterator[pb.StreamResult]:
        fault = self._enter("ScoreStream", context)
        if fault is not None and fault.after <= 0:
            # Take the first request (or, drained, all) off the wire before failing:
            # aborting while the client is still writing races in gRPC, which then reports
            # a bare "Internal error from Core" instead of the fault's status and details.
            if fault.drain:
                collections.deque(messages, maxlen=0)
            else:
                next(messages, None)
            self._fail(fault, context)
        sent = 0
        for position, item in enumerate(messages):
            index = item.index if item.HasField("index") else position
            self._record(item.request)
            yield pb.StreamResult(index=index, result=fake_result(item.request, index))
            sent += 1
            if fault is not None and sent >= fault.after:
                self._fail(fault, context)
        if fault is not None:
            self._fail(fault, context)

    def _model_info(self, request: pb.ModelInfoRequest, context: grpc.ServicerContext
                    ) -> pb.ModelInfoResponse:
        with self._lock:
            self.calls.append("ModelInfo")
        time.sleep(self.info_delay)
        info = convert.info_to_proto(self.info, max_queued_tokens=262_144,
                                     max_message_bytes=16 << 20)
        info.generation = self.generation
        info.max_generation_streams = 32 if self.generation else 0
        return info

    def _generate(self, message: pb.GenerateRequest, context: grpc.ServicerContext
                  ) -> Iterator[pb.GenerateResponse]:
        fault = self._enter("Generate", context)
        if fault is not None:
            self._fail(fault, context)
        with self._lock:
            self.generate_requests.append(message)
        if not message.HasField("prompt") and not message.HasField("prompt_token_ids"):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"{request_label(convert.get_id(message), 0)}: prompt: is missing")
        tokens = fake_generation(message)
        half = len(tokens) // 2
        if half:
            yield pb.GenerateResponse(token_ids=tokens[:half])
        last = pb.GenerateResponse(token_ids=tokens[half:], finish_reason="length",
                                   text=" ".join(map(str, tokens)),
                                   prompt_tokens=(len(message.prompt_token_ids.ids)
                                                  if message.HasField("prompt_token_ids")
                                                  else len(message.prompt.encode())))
        which = message.WhichOneof("id")
        if which is not None:
            setattr(last, "string_id" if which == "string_id" else "int_id",
                    getattr(message, which))
        yield last


# ---------------------------------------------------------------------------- process
def main(argv: list[str] | None = None) -> int:
    """Serve a fake upstream until SIGTERM/SIGINT; print the bound port on stdout."""
    parser = argparse.ArgumentParser(prog="python -m tests.grpc_fakes",
                                     description="a fake moejax serve for tests")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--token", default=None)
    parser.add_argument("--tls-cert", default=None)
    parser.add_argument("--tls-key", default=None)
    parser.add_argument("--delay", type=float, default=0.0,
                        help="seconds each scoring request takes")
    parser.add_argument("--prefix-cache-blocks", type=int, default=1024)
    parser.add_argument("--not-serving", action="store_true",
                        help="start with health NOT_SERVING")
    args = parser.parse_args(argv)
    fake = FakeUpstream(args.port, host=args.host, token=args.token, tls_cert=args.tls_cert,
                        tls_key=args.tls_key, delay=args.delay,
                        info={"prefix_cache_blocks": args.prefix_cache_blocks})
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    port = fake.start()
    if args.not_serving:
        fake.set_serving(False)
    print(port, flush=True)
    while not stop.wait(0.5):
        pass
    fake.stop()
    print(json.dumps({"requests": len(fake.requests)}), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
