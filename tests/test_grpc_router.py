"""``moejax router`` (serving.grpc.upstream_router) over fake upstreams (tests/grpc_fakes.py)
and, once, over two real ``moejax serve`` processes.

Routing is compared decision by decision with the in-process Router of moejax.core.router fed
the same ops and events; failover, health, auth/TLS both ways, the bounded shadow of the
upstreams' caches and the CLI are checked on fakes that can be told to fail, hang, stop
or turn NOT_SERVING. Waits poll a condition with a generous bound; nothing asserts how long
anything took.
"""

from __future__ import annotations

import contextlib
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Iterator

import grpc
import numpy as np
import pytest

from serving.grpc import Client, convert, scoring_pb2 as pb, scoring_pb2_grpc
from serving.grpc.upstream_router import RouterOptions, RouterServer
from serving.grpc.router_core import load_model
from serving.grpc.upstreams import UpstreamOptions, parse_upstreams
from serving.requests import normalize_requests, parse_request
from moejax.core.router import BlocksStored, FlopsExecuted, make_router
from tests.grpc_fakes import FakeUpstream, comparable, fake_result

T = 30  # seconds: bound on every wait and RPC
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.timeout(180)


# ---------------------------------------------------------------------------- helpers
@pytest.fixture(scope="module")
def model() -> Any:
    return load_model("demo")   # config and tokenizer only


@pytest.fixture
def fakes() -> Iterator[list[FakeUpstream]]:
    """Three running fake upstreams (stopped after the test)."""
    made = [FakeUpstream() for _ in range(3)]
    for fake in made:
        fake.start()
    yield made
    for fake in made:
        fake.stop()


def wait_until(condition: Callable[[], Any], what: str, timeout: float = T) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def upstream_options(**kw: Any) -> UpstreamOptions:
    return UpstreamOptions(**{"health_interval": 0.1, "timeout": 10.0, **kw})


@contextlib.contextmanager
def router(model: Any, targets: list[str], *, serving: bool = True,
           upstream: UpstreamOptions | None = None, check_seconds: float = T,
           **options: Any) -> Iterator[tuple[RouterServer, str]]:
    """A running in-process router over ``targets`` -> (server, "127.0.0.1:PORT"), after
    waiting up to ``check_seconds`` for every upstream's ModelInfo (a router over dead
    upstreams gives a short one: it waits that long for nothing)."""
    server = RouterServer(RouterOptions(upstreams=targets, port=0, grace_seconds=1.0,
                                        upstream=upstream or upstream_options(), **options),
                          model=model)
    port = server.start()
    try:
        server.check_upstreams(check_seconds)
        if serving:
            wait_until(lambda: all(s["serving"] for s in server.upstream_states()),
                       "every upstream to serve")
        yield server, f"127.0.0.1:{port}"
    finally:
        server.stop(1.0)


def targets_of(fakes: list[FakeUpstream]) -> list[str]:
    return [fake.target for fake in fakes]


def stub(target: str) -> scoring_pb2_grpc.ScoringStub:
    return scoring_pb2_grpc.ScoringStub(grpc.insecure_channel(target))


def proto(request: dict[str, Any], index: int = 0) -> pb.ScoreRequest:
    return convert.request_to_proto(parse_request(request, index), index)


def expected(request: dict[str, Any], index: int = 0) -> Any:
    """The fakes' answer to ``request`` (without timings)."""
    return comparable(convert.result_from_proto(fake_result(proto(request, index), index)))


def stream_all(target: str, requests: list[dict[str, Any]], **kw: Any
               ) -> list[pb.StreamResult]:
    """Every StreamResult of one ScoreStream call (not deduplicated: exactly-once checks)."""
    messages = [pb.StreamRequest(request=proto(r, i), index=i) for i, r in enumerate(requests)]
    return list(stub(target).ScoreStream(iter(messages), timeout=T, **kw))


def doc(k: int, words: int = 40) -> str:
    """A document of ~``words`` words: several 16-token blocks of a shared prefix."""
    vocab = ["code", "prose", "math", "data", "river", "stone", "light", "market", "garden"]
    return f"Document {k}: " + " ".join(vocab[(k * 7 + i * 3) % len(vocab)]
                                        for i in range(words)) + "\n"


def trace() -> list[dict[str, Any]]:
    """Requests with shared prefixes (four documents, several questions each), in an order
    that revisits documents, plus one standalone short prompt."""
    out = []
    for i, k in enumerate([0, 1, 0, 2, 1, 0, 3, 2, 2, 1, 3, 0, 0, 1, 2, 0]):
        out.append({"id": f"t{i}", "prompt": doc(k) + f"Question {i}: is it about code?",
                    "candidates": [" yes", " no"]})
    out.append({"id": "short", "prompt": "Sentiment of 'great':", "candidates": [" positive",
                                                                                 " negative"]})
    return out


def op_of(model: Any, request: dict[str, Any], index: int) -> Any:
    """The op that stands for a request in routing: its first prefill op (prefix = prompt)."""
    cfg, tokenizer, _ = model
    ops, errors, _ = normalize_requests([request], tokenizer, vocab_size=cfg.vocab_size,
                                        max_context=cfg.max_context, start=index)
    assert not errors
    return ops[0]


def answered_events(reference: Any, engine: int, op: Any, cost: int) -> None:
    """What the router feeds its Router when an upstream answered ``op``."""
    size = reference.block_size
    reference.on_event(BlocksStored(engine, op.block_hashes(size)[:op.prefix_len // size]))
    reference.on_event(FlopsExecuted(engine, cost, tokens=len(op.token_ids)))


def served_by(fakes: list[FakeUpstream], request_id: str) -> list[int]:
    return [g for g, fake in enumerate(fakes)
            if any(r.string_id == request_id for r in fake.requests)]


# ---------------------------------------------------------------------------- 1. routing
@pytest.mark.parametrize("routing", ["prefix", "round_robin", "least_tokens"])
def test_routing_equals_the_in_process_router(model, fakes, routing):
    cfg = model[0]
    requests = trace()
    ops = [op_of(model, r, i) for i, r in enumerate(requests)]
    # Θ below one request's cost: in the batch below each upstream saturates at once, the
    # batch runs in rounds and a shared prefix spills.
    theta = 0.3 * float(np.mean([op.flops(cfg) for op in ops]))
    reference = make_router(routing, cfg, len(fakes), theta=theta)
    chosen, want = [], []
    with router(model, targets_of(fakes), routing=routing, theta=theta) as (server, target):
        scoring = stub(target)
        with Client(target) as client:
            # One at a time, three ways in: the stream (Client.score), Score, the stream.
            for i in range(8):
                request = requests[i]
                if i % 2:
                    result = scoring.Score(proto(request, i), timeout=T)
                    engine = result.timings.engines[0]
                    got = comparable(convert.result_from_proto(result))
                else:
                    (res,) = client.score([request], timeout=T)
                    engine, got = res.timings["engines"][0], comparable(res)
                assert got == expected(request, i)
                report = reference.assign([ops[i]])
                want.append(report.engines[0])
                chosen.append(engine)
                answered_events(reference, report.engines[0], ops[i],
                                report.assignments[0].cost)
            # The rest in one ScoreBatch: one Router call, rounds of Θ.
            batch = requests[8:]
            response = scoring.ScoreBatch(pb.ScoreBatchRequest(
                requests=[proto(r, i) for i, r in enumerate(batch)]), timeout=T)
            report = reference.assign(ops[8:])
            want += report.engines
            for op, assignment in zip(ops[8:], report.assignments):
                answered_events(reference, assignment.engine, op, assignment.cost)
            chosen += [r.timings.engines[0] for r in response.results]
            assert [r.timings.rounds[0] for r in response.results] == [
                a.round for a in report.assignments]
            for i, result in enumerate(response.results):
                assert comparable(result) == comparable(fake_result(proto(batch[i], i), i))
        assert chosen == want, f"{routing}: router {chosen}, in-process {want}"
        for i, request in enumerate(requests):   # the fakes saw each request where it went
            assert served_by(fakes, request["id"]) == [chosen[i]]
        if routing == "prefix":
            # The trace exercises affinity (a revisited document stays) and spill.
            assert chosen[2] == chosen[0] and chosen[5] == chosen[0]
            assert report.num_rounds > 1 and len(set(report.engines)) > 1
        mine = server.core.router        # the same state after the same events
        assert mine.loads() == reference.loads()
        assert all(mine.committed_blocks(g) == reference.committed_blocks(g)
                   and not mine.pending_blocks(g) for g in range(len(fakes)))


def test_invalid_requests_get_the_upstreams_own_errors(model, fakes):
    """The router forwards what it cannot route; answers name requests as the caller did
    (an id-less request by its place in the caller's batch, not in an upstream's part)."""
    good = {"prompt": "Fine?", "candidates": [" yes", " no"]}
    bad = pb.ScoreRequest(candidates=[" yes"])           # no prompt
    with router(model, targets_of(fakes[:2]), routing="round_robin") as (server, target):
        scoring = stub(target)
        with pytest.raises(grpc.RpcError) as refused:
            scoring.Score(bad, timeout=T)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details() == fake_result(bad, 0).error
        batch = [proto(good, 0), proto(good, 1), bad, proto(good, 3), bad]
        response = scoring.ScoreBatch(pb.ScoreBatchRequest(requests=batch), timeout=T)
        assert [comparable(r) for r in response.results] == [
            comparable(fake_result(m, i)) for i, m in enumerate(batch)]
        assert response.results[4].error.startswith("request #4: prompt")
        answers = stream_all(target, [good, good])
        assert sorted(a.index for a in answers) == [0, 1]


def test_generate_is_routed_and_retried_before_its_first_token(model, fakes):
    from tests.grpc_fakes import fake_generation

    requests = [{"id": f"g{i}", "prompt": doc(i), "max_new_tokens": 5} for i in range(4)]
    with router(model, targets_of(fakes[:2]), routing="round_robin") as (server, target):
        fakes[0].fail_next(1)
        with Client(target) as client:
            results = client.generate(requests, timeout=T, max_concurrency=1)
    for request, result in zip(requests, results):
        message = convert.generation_request_to_proto(request)
        assert result.error is None and result.token_ids == fake_generation(message)
    # Each generated once; the first went to 0, failed there and was retried on 1.
    assert len(fakes[0].generate_requests) + len(fakes[1].generate_requests) == 4
    assert fakes[0].calls.count("Generate") == len(fakes[0].generate_requests) + 1
    assert fakes[1].generate_requests[0].string_id == "g0"


# ---------------------------------------------------------------------------- 2. failover
def test_a_failed_call_is_retried_once_elsewhere(model, fakes):
    request = {"id": "r", "prompt": "Is water wet?", "candidates": [" yes", " no"]}
    with router(model, targets_of(fakes[:2]), routing="round_robin") as (server, target):
        scoring = stub(target)
        fakes[0].fail_next(1)                    # round robin: the first call goes to 0
        result = scoring.Score(proto(request), timeout=T)
        assert comparable(result) == comparable(fake_result(proto(request)))
        assert result.timings.engines == [1]
        assert served_by(fakes, "r") == [1] and fakes[0].calls == ["ModelInfo", "Score"]
        # Upstream 0 is out until its next health check, then back in turn.
        wait_until(lambda: server.upstream_states()[0]["serving"], "upstream 0 back")
        batch = [dict(request, id=f"b{i}") for i in range(4)]
        fakes[1].fail_next(1, grpc.StatusCode.INTERNAL)
        response = scoring.ScoreBatch(pb.ScoreBatchRequest(
            requests=[proto(r, i) for i, r in enumerate(batch)]), timeout=T)
        assert [comparable(r) for r in response.results] == [
            comparable(fake_result(proto(r, i), i)) for i, r in enumerate(batch)]
        assert {r.timings.engines[0] for r in response.results} == {0}


def test_killed_upstream_mid_stream_every_request_answered_exactly_once(model, fakes):
    requests = [{"id": f"s{i}", "prompt": f"Item {i} is", "candidates": [" good", " bad"]}
                for i in range(20)]
    with router(model, targets_of(fakes[:2]), routing="round_robin") as (server, target):
        fakes[0].hang_next(1)     # the stream to upstream 0 takes its requests, answers none
        results: queue.Queue = queue.Queue()
        worker = threading.Thread(target=lambda: results.put(stream_all(target, requests)))
        worker.start()
        wait_until(lambda: fakes[0].hanging == 1 and len(fakes[1].requests) == 10,
                   "half answered, half stuck")
        fakes[0].stop()           # killed with 10 requests owed
        answers = results.get(timeout=T)
        worker.join(T)
    assert sorted(a.index for a in answers) == list(range(20))   # each once, none lost
    for answer in answers:
        assert comparable(answer.result) == expected(requests[answer.index], answer.index)
        assert answer.result.timings.engines == [1]
    assert sorted(r.string_id for r in fakes[1].requests) == sorted(r["id"] for r in requests)
    assert fakes[0].requests == []


def test_when_the_retry_fails_too_the_call_fails_retryably(model, fakes):
    """Unary and stream alike: when every upstream failed the request, the call ends
    UNAVAILABLE naming each failure (the client resends); no error result is made up for
    a request that is not at fault."""
    request = {"id": "x", "prompt": "Is fire cold?", "candidates": [" yes", " no"]}
    with router(model, targets_of(fakes[:2])) as (server, target):
        for fake in fakes[:2]:
            fake.fail_next(1, details="disk on fire")
        with pytest.raises(grpc.RpcError) as failed:
            stub(target).Score(proto(request), timeout=T)
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "disk on fire" in failed.value.details()
        wait_until(lambda: all(s["serving"] for s in server.upstream_states()), "both back")
        for fake in fakes[:2]:
            fake.fail_next(1, details="disk on fire")
        with pytest.raises(grpc.RpcError) as ended:   # a stream ends, with no result
            stream_all(target, [request])
        assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
        details = ended.value.details()
        assert "upstream 0" in details and "upstream 1" in details
        assert "disk on fire" in details


def test_overload_is_retried_elsewhere_or_passed_on_with_its_hint(model, fakes):
    request = {"id": "o", "prompt": "Busy?", "candidates": [" yes", " no"]}
    with router(model, targets_of(fakes[:2]), routing="round_robin") as (server, target):
        scoring = stub(target)
        for fake in fakes[:2]:
            fake.fail_next(1, grpc.StatusCode.RESOURCE_EXHAUSTED, retry_after_ms=250)
        with pytest.raises(grpc.RpcError) as refused:
            scoring.Score(proto(request), timeout=T)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert dict(refused.value.trailing_metadata())["retry-after-ms"] == "250"
        # Overload does not take an upstream out; one refusal is retried on the other.
        assert all(s["serving"] for s in server.upstream_states())
        fakes[0].fail_next(1, grpc.StatusCode.RESOURCE_EXHAUSTED, retry_after_ms=250)
        result = scoring.Score(proto(request), timeout=T)   # round robin: to 0, then 1
        assert comparable(result) == comparable(fake_result(proto(request)))
        assert result.timings.engines == [1]


def test_an_upstream_that_hangs_past_the_timeout_is_retried(model, fakes):
    request = {"id": "h", "prompt": "Slow?", "candidates": [" yes", " no"]}
    with router(model, targets_of(fakes[:2]), routing="round_robin",
                upstream=upstream_options(timeout=1.0)) as (server, target):
        fakes[0].hang_next(1)
        result = stub(target).Score(proto(request), timeout=T)
        assert result.timings.engines == [1]
        assert comparable(result) == comparable(fake_result(proto(request)))
        wait_until(lambda: server.upstream_states()[0]["serving"], "upstream 0 back")
        fakes[0].hang_next(1)     # a stream: no result for 1 s while owed -> retried
        answers = stream_all(target, [dict(request, id=f"h{i}") for i in range(4)])
        assert sorted(a.index for a in answers) == [0, 1, 2, 3]
        assert {a.result.timings.engines[0] for a in answers} == {1}
        assert all(a.result.error == "" for a in answers)


# ---------------------------------------------------------------------------- 3. health
def _health(target: str) -> str:
    with Client(target) as client:
        return client.health(timeout=T)


def test_health_follows_the_upstreams(model, fakes):
    requests = [{"id": f"q{i}", "prompt": f"Q {i}?", "candidates": [" yes", " no"]}
                for i in range(6)]
    with router(model, targets_of(fakes[:2]), routing="round_robin") as (server, target):
        assert _health(target) == "SERVING"
        for fake in fakes[:2]:
            fake.set_serving(False)
        wait_until(lambda: _health(target) == "NOT_SERVING", "router NOT_SERVING")
        with pytest.raises(grpc.RpcError) as refused:
            stub(target).Score(proto(requests[0]), timeout=T)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        fakes[1].set_serving(True)
        wait_until(lambda: _health(target) == "SERVING", "router SERVING")
        with Client(target) as client:
            results = client.score(requests, timeout=T)
        assert all(r.timings["engines"] == [1] for r in results)
        assert fakes[0].requests == []            # NOT_SERVING: no requests at all
        fakes[0].set_serving(True)                # back: used again
        wait_until(lambda: server.upstream_states()[0]["serving"], "upstream 0 back")
        fakes[1].reset_records()
        with Client(target) as client:
            results = client.score(requests, timeout=T)
        assert {r.timings["engines"][0] for r in results} == {0, 1}
        # A stopped upstream is out; restarted on its port, it is used again.
        fakes[0].stop()
        wait_until(lambda: not server.upstream_states()[0]["serving"], "upstream 0 out")
        assert _health(target) == "SERVING"
        fakes[0].start()
        wait_until(lambda: server.upstream_states()[0]["serving"], "upstream 0 restarted")
        fakes[0].reset_records()
        with Client(target) as client:
            client.score(requests, timeout=T)
        assert len(fakes[0].requests) == 3


def test_a_cancelled_health_check_counts_as_a_restart(model):
    """A server shutting down cancels the health checks in flight (CANCELLED, not
    UNAVAILABLE); a new process may answer the next one on the same port. The router must
    presume that restart: check the ModelInfo again and forget the cache it believed there,
    before the upstream serves again."""
    upstream = FakeUpstream(info={"prefix_cache_blocks": 64})
    request = {"id": "d", "prompt": doc(3) + "Topic?", "candidates": [" code", " data"]}
    try:
        upstream.start()
        with router(model, [upstream.target]) as (server, target):
            with Client(target) as client:
                client.score([request], timeout=T)
            assert server.core.router.committed_blocks(0)
            infos = upstream.calls.count("ModelInfo")
            upstream.info_delay = 1.0
            upstream.fail_health_next(1, grpc.StatusCode.CANCELLED)
            wait_until(lambda: upstream.calls.count("ModelInfo") > infos, "checked again")
            assert not server.upstream_states()[0]["serving"]   # not before the check
            wait_until(lambda: server.upstream_states()[0]["serving"], "back")
            assert server.core.router.committed_blocks(0) == frozenset()
    finally:
        upstream.stop()


def test_router_metrics_count_routing_per_upstream(model, fakes):
    """--metrics-port: per upstream, whether it serves, the requests routed to it (summing
    to what was sent), its load and the blocks the router believes it caches; scraped over
    a real socket and parsed by prometheus_client."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    def scrape(port):
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=T) as answer:
            text = answer.read().decode()
        return {(s.name, s.labels.get("upstream")): s.value
                for f in text_string_to_metric_families(text) for s in f.samples}

    requests = [{"id": f"r{k}", "prompt": doc(k % 3) + "Topic?", "candidates": [" a", " b"]}
                for k in range(9)]
    with router(model, targets_of(fakes[:2]), metrics_port=0) as (server, target):
        with Client(target) as client:
            client.score(requests, timeout=T)
        samples = scrape(server.metrics_port)
        targets = targets_of(fakes[:2])
        routed = [samples[("moejax_router_routed_requests_total", t)] for t in targets]
        assert sum(routed) == len(requests)
        assert routed == [server.core.routed[0], server.core.routed[1]]
        assert all(samples[("moejax_router_upstream_serving", t)] == 1 for t in targets)
        assert sum(samples[("moejax_router_cached_blocks", t)] for t in targets) > 0
        fakes[1].stop()
        wait_until(lambda: scrape(server.metrics_port)[
            ("moejax_router_upstream_serving", targets[1])] == 0, "upstream 1 out")


# ---------------------------------------------------------------------------- 4. auth, TLS
def _self_signed(tmp_path) -> tuple[str, str]:
    """A self-signed certificate for localhost / 127.0.0.1 (openssl)."""
    if not shutil.which("openssl"):
        pytest.skip("openssl is not installed")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                    "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1", "-subj",
                    "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True,
                   timeout=T)
    return str(cert), str(key)


REQUEST = {"id": "a", "prompt": "Secure?", "candidates": [" yes", " no"]}


def test_auth_and_tls_toward_clients(model, fakes, tmp_path):
    cert, key = _self_signed(tmp_path)
    with router(model, targets_of(fakes[:1]), token="s3cret", tls_cert=cert,
                tls_key=key) as (server, target):
        port = target.rsplit(":", 1)[1]
        with Client(f"localhost:{port}", tls_ca=cert) as anonymous:
            assert anonymous.health(timeout=T) == "SERVING"       # health stays open
            with pytest.raises(grpc.RpcError) as denied:
                anonymous.score([REQUEST], timeout=T)
            assert denied.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with Client(f"localhost:{port}", token="s3cret", tls_ca=cert) as client:
            (result,) = client.score([REQUEST], timeout=T)
            assert comparable(result) == expected(REQUEST)
            assert client.info(timeout=T)["backend"] == "router"
        with Client(target, token="s3cret") as plaintext:         # TLS only
            with pytest.raises(grpc.RpcError):
                plaintext.score([REQUEST], timeout=5)


def test_auth_and_tls_toward_upstreams(model, tmp_path):
    cert, key = _self_signed(tmp_path)
    upstreams = [FakeUpstream(token="up", tls_cert=cert, tls_key=key) for _ in range(2)]
    try:
        for fake in upstreams:
            fake.start()
        for name in (None, "localhost"):    # the IP in the certificate, or a name override
            options = upstream_options(token="up", tls_ca=cert, tls_server_name=name)
            with router(model, targets_of(upstreams), upstream=options) as (server, target):
                with Client(target) as client:
                    results = client.score([REQUEST, dict(REQUEST, id="b")], timeout=T)
                assert [comparable(r) for r in results] == [
                    expected(REQUEST), expected(dict(REQUEST, id="b"))]
        assert all(m.get("authorization") == "Bearer up"
                   for fake in upstreams for m in fake.metadata)
        options = upstream_options(token="wrong", tls_ca=cert)
        with router(model, targets_of(upstreams), upstream=options,
                    serving=False) as (server, target):
            refused, silent = server.check_upstreams(T)
            assert len(refused) == 2 and "credentials" in refused[0] and not silent
            assert _health(target) == "NOT_SERVING"
    finally:
        for fake in upstreams:
            fake.stop()


# ---------------------------------------------------------------------------- 5. eviction
def test_the_shadow_is_bounded_and_stale_affinity_decays(model):
    capacity = 4
    upstreams = [FakeUpstream(info={"prefix_cache_blocks": capacity}) for _ in range(2)]
    requests = [{"id": f"e{k}", "prompt": doc(k) + "Topic?", "candidates": [" code", " data"]}
                for k in range(8)]
    try:
        for fake in upstreams:
            fake.start()
        with router(model, targets_of(upstreams)) as (server, target):
            core = server.core
            first = op_of(model, requests[0], 0)
            size = core.router.block_size
            first_blocks = set(first.block_hashes(size)[:first.prefix_len // size])
            assert len(first_blocks) >= 3
            with Client(target) as client:
                for i, request in enumerate(requests):
                    (result,) = client.score([request], timeout=T)
                    assert comparable(result) == expected(request)
                    for g in range(2):
                        assert len(core.shadows[g]) <= capacity
                        assert len(core.router.committed_blocks(g)) <= capacity
                    if i == 0:
                        home = result.timings["engines"][0]
                        assert first_blocks <= core.router.committed_blocks(home)
            # Later prefixes pushed the first one out of its upstream's shadow: no
            # affinity to blocks the upstream has evicted too.
            assert not first_blocks & core.router.committed_blocks(home)
            # An upstream that restarts (its cache gone behind the router's back) answers
            # the same; once seen lost and back, the router forgets its cache.
            upstreams[home].stop()
            wait_until(lambda: not server.upstream_states()[home]["serving"], "lost")
            # Healthy again, but not serving until its ModelInfo is checked (the new process
            # may hold another model, and holds an empty cache): the check is held 1 s here.
            # Before, it served in that gap, routed by the cache it had lost.
            infos = upstreams[home].calls.count("ModelInfo")
            upstreams[home].info_delay = 1.0
            upstreams[home].start()
            wait_until(lambda: upstreams[home].calls.count("ModelInfo") > infos, "checked")
            assert not server.upstream_states()[home]["serving"]
            wait_until(lambda: server.upstream_states()[home]["serving"], "back")
            assert core.router.committed_blocks(home) == frozenset()
            with Client(target) as client:
                results = client.score(requests, timeout=T)
            assert [comparable(r) for r in results] == [expected(r) for r in requests]
    finally:
        for fake in upstreams:
            fake.stop()


# ---------------------------------------------------------------------------- 6. end to end
def _serve(extra: list[str]) -> tuple[subprocess.Popen, int, list[str]]:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    process = subprocess.Popen(
        [sys.executable, "-m", "serving.cli", "serve", "--model", "demo", "--port", "0",
         "--max-batch-tokens", "64", "--grace-seconds", "5", *extra],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stderr: list[str] = []
    threading.Thread(target=lambda: stderr.extend(process.stderr), daemon=True).start()
    line = process.stdout.readline()
    assert line.strip().isdigit(), "".join(stderr)
    return process, int(line), stderr


@pytest.mark.slow
def test_two_real_servers_behind_the_router_answer_as_one(model):
    servers = [_serve(["--prefix-cache-blocks", "8"]) for _ in range(2)]
    try:
        targets = [f"127.0.0.1:{port}" for _, port, _ in servers]
        for (process, _, stderr), target in zip(servers, targets):
            wait_until(lambda: process.poll() is not None or _health(target) == "SERVING",
                       "serve to load", timeout=150)
            assert process.poll() is None, "".join(stderr)
        requests = trace() + [{"id": "bad", "prompt": "", "candidates": [" a"]},
                              {"kind": "choice", "prompt": "Which is a number?",
                               "candidates": ["seven", "table"]}]
        with Client(targets[0]) as direct:
            reference = direct.score(requests, timeout=120)
            generated = direct.generate([{"id": "g", "prompt": doc(1),
                                          "max_new_tokens": 4}], timeout=120)
        with router(model, targets) as (server, target):
            with Client(target) as client:
                for _ in range(2):   # twice: the second pass hits (and evicts) caches
                    results = client.score(requests, timeout=120)
                    for got, want in zip(results, reference):
                        assert (got.id, got.label, got.error, got.prompt_tokens) == (
                            want.id, want.label, want.error, want.prompt_tokens)
                        if want.error is None:
                            np.testing.assert_allclose(got.logprobs, want.logprobs,
                                                       rtol=1e-4, atol=1e-5)
                            assert got.timings["engines"][0] in (0, 1)
                assert client.generate([{"id": "g", "prompt": doc(1), "max_new_tokens": 4}],
                                       timeout=120)[0].token_ids == generated[0].token_ids
                info = client.info(timeout=T)
                assert (info["backend"], info["engines"]) == ("router", 2)
            assert {r.timings["engines"][0] for r in results if r.error is None} == {0, 1}
    finally:
        for process, _, _ in servers:
            process.send_signal(signal.SIGTERM)
        for process, _, _ in servers:
            try:
                process.wait(timeout=T)
            except subprocess.TimeoutExpired:
                process.kill()


# ---------------------------------------------------------------------------- 7. the CLI
@pytest.mark.parametrize("value, named", [
    ("localhost", "'localhost'"), ("localhost:99999", "99999"), ("a:1,,b:2", "empty value"),
    ("::1:50051", "brackets"), ("[::1:50051", "unclosed"), ("h:1,h:1", "listed twice"),
    ("host name:80", "'host name'"), ("h:port", "'port'")])
def test_bad_upstream_values_are_refused_by_name(value, named, capsys):
    from serving.cli import main

    with pytest.raises(ValueError, match="--upstream"):
        parse_upstreams(value)
    assert main(["router", "--upstream", value, "--port", "0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moejax router: error: ") and named in err


def test_parse_upstreams_accepts_names_ipv4_and_ipv6():
    assert parse_upstreams(" a.example:1, 10.0.0.2:50051,[::1]:7 ") == [
        "a.example:1", "10.0.0.2:50051", "[::1]:7"]


def _router_process(*args: str) -> tuple[subprocess.Popen, list[str]]:
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    process = subprocess.Popen([sys.executable, "-m", "serving.cli", "router", "--port", "0",
                                "--startup-timeout", "20", *args], cwd=ROOT, env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stderr: list[str] = []
    threading.Thread(target=lambda: stderr.extend(process.stderr), daemon=True).start()
    return process, stderr


def test_router_process_prints_its_port_serves_and_stops_on_sigterm(fakes):
    process, stderr = _router_process("--upstream", ",".join(targets_of(fakes[:2])),
                                      "--health-interval", "0.1")
    try:
        port = int(process.stdout.readline())
        target = f"127.0.0.1:{port}"
        wait_until(lambda: _health(target) == "SERVING", "the router to serve")
        with Client(target) as client:
            (result,) = client.score([REQUEST], timeout=T)
        assert comparable(result) == expected(REQUEST)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=T) == 0, "".join(stderr)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(T)


def test_router_refuses_an_upstream_of_another_model(fakes):
    other = FakeUpstream(info={"num_layers": 99})
    other.start()
    try:
        process, stderr = _router_process("--upstream",
                                          f"{fakes[0].target},{other.target}")
        assert process.wait(timeout=60) == 2
        message = "".join(stderr)
        assert f"upstream 1 ({other.target})" in message and "num_layers" in message
    finally:
        other.stop()
