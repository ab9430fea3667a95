"""The gRPC server end to end on loopback, with an in-process server and the demo model.

Every RPC's results equal the in-process Scorer's; bad input gets statuses or error results
naming the field; admission control, deadlines, cancellation, graceful stop, message-size
limit, auth, TLS, and a load test. Results are compared with the in-process Scorer on the
same requests (never with fixed numbers: the demo model changes). Set
``MOEJAX_GRPC_TEST_MODEL`` to a model directory to run these on another model.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import shutil
import subprocess
import threading
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from serving import Scorer, ScoreRequest
from serving.grpc import Client, decoding, scoring_pb2 as pb, scoring_pb2_grpc
from serving.grpc.server import ScoringServer, ServerOptions

MODEL = os.environ.get("MOEJAX_GRPC_TEST_MODEL", "demo")
T = 60  # seconds: the timeout of every RPC in these tests
pytestmark = pytest.mark.timeout(240)

REQUESTS = [
    {"id": "a", "prompt": "Review: lovely food and kind staff.\nSentiment:",
     "candidates": [" positive", " negative"]},
    {"id": 7, "prompt": "Claim: 2 + 2 = 5. True or false?", "candidates": [" true", " false"],
     "normalize": "vocab"},
    {"id": "c", "kind": "choice", "prompt": "Which is a colour?",
     "candidates": ["red", "table", "seven"]},
    {"id": -(1 << 63), "kind": "multi", "prompt": "Article: the team won the final.",
     "candidates": ["sports", "music", "politics"]},
    {"prompt": "The capital of France is", "candidates": [" Paris", " the city of Lyon"]},
    {"id": (1 << 63) - 1, "prompt_token_ids": [5, 6, 7, 8, 9],
     "candidate_token_ids": [[10], [11, 12]], "normalize": "vocab"},
    {"id": "bad-kind", "prompt": "x", "candidates": [" a"], "kind": "sideways"},
    {"prompt": "", "candidates": [" a", " b"]},
]


class SharedScorer:
    """The module's Scorer behind a lock (test servers share it) with a gate that holds
    scoring calls, to fill the queue or let deadlines pass."""

    def __init__(self, scorer: Scorer):
        self.scorer = scorer
        self.lock = threading.Lock()
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()

    def __getattr__(self, name):
        return getattr(self.scorer, name)   # prepare, combine, info, limits, ...

    def run_ops(self, ops, on_batch_done=None):
        self.entered.set()
        assert self.gate.wait(T), "the test left the gate closed"
        with self.lock:
            return self.scorer.run_ops(ops, on_batch_done)

    def score(self, requests, progress=None):
        with self.lock:
            return self.scorer.score(requests, progress=progress)


@pytest.fixture(scope="module")
def scorer() -> SharedScorer:
    return SharedScorer(Scorer(MODEL, max_batch_tokens=32, calibrate=False))


@contextlib.contextmanager
def running(scorer: SharedScorer | None, **options):
    """A started server on a free loopback port (attached to ``scorer`` unless None)."""
    server = ScoringServer(ServerOptions(port=0, grace_seconds=5, **options))
    port = server.start()
    if scorer is not None:
        server.attach(scorer)
    try:
        yield server, f"127.0.0.1:{port}"
    finally:
        if scorer is not None:
            scorer.gate.set()
        server.stop(2)


@pytest.fixture(scope="module")
def served(scorer):
    with running(scorer) as (server, target):
        yield server, target


@pytest.fixture(scope="module")
def reference(scorer):
    return scorer.score(REQUESTS)


def stub(target: str) -> scoring_pb2_grpc.ScoringStub:
    return scoring_pb2_grpc.ScoringStub(grpc.insecure_channel(target))


def to_proto(request: dict) -> pb.ScoreRequest:
    message = pb.ScoreRequest(kind=request.get("kind", ""), normalize=request.get("normalize", ""))
    if isinstance(request.get("id"), str):
        message.string_id = request["id"]
    elif request.get("id") is not None:
        message.int_id = request["id"]
    if "prompt" in request:
        message.prompt = request["prompt"]
    message.prompt_token_ids.extend(request.get("prompt_token_ids", ()))
    message.candidates.extend(request.get("candidates", ()))
    for ids in request.get("candidate_token_ids", ()):
        message.candidate_token_ids.add().ids.extend(ids)
    return message


def assert_same(served_result, local) -> None:
    """Equal results; log-probs to 1e-5 relative (the packed-vs-alone tolerance of
    tests/test_scoring.py: the server packs requests into other batches)."""
    assert (served_result.id, served_result.error, served_result.label, served_result.selected,
            served_result.prompt_tokens) == (local.id, local.error, local.label, local.selected,
                                             local.prompt_tokens)
    if local.logprobs is None:
        assert served_result.logprobs is None
    else:
        a, b = np.asarray(served_result.logprobs), np.asarray(local.logprobs)
        assert a.shape == b.shape and np.all(np.abs(a - b) / np.maximum(1.0, np.abs(b)) <= 1e-5)


def health_status(target: str, service: str = "") -> str:
    channel = grpc.insecure_channel(target)
    response = health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service=service), timeout=T)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


def wait_until(predicate, timeout: float = T) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


# =========================================================================== every RPC
def test_client_score_equals_the_in_process_scorer(served, reference):
    _, target = served
    with Client(target) as client:
        results = client.score(REQUESTS, timeout=T)
        assert len(results) == len(REQUESTS)
        for result, local in zip(results, reference):
            assert_same(result, local)
        assert results[6].error.startswith("request 'bad-kind': kind: 'sideways'")
        assert results[7].error == "request #7: prompt: is empty"
        assert results[0].timings["queue_seconds"] >= 0
        assert client.health() == "SERVING"
        as_objects = client.score([ScoreRequest(**r) for r in REQUESTS[:2]], timeout=T)
        for result, local in zip(as_objects, reference):
            assert_same(result, local)
        with pytest.raises(TypeError):
            client.score(REQUESTS[0])  # a single request, not a list: as Scorer.score


def test_score_batch_and_stream_rpcs_equal_the_in_process_scorer(served, reference):
    _, target = served
    scoring = stub(target)
    batch = scoring.ScoreBatch(pb.ScoreBatchRequest(requests=[to_proto(r) for r in REQUESTS]),
                               timeout=T)
    from serving.grpc.convert import result_from_proto

    for message, local in zip(batch.results, reference, strict=True):
        assert_same(result_from_proto(message), local)
    stream = scoring.ScoreStream(iter([pb.StreamRequest(request=to_proto(r)) for r in REQUESTS]),
                                 timeout=T)
    by_index = {m.index: result_from_proto(m.result) for m in stream}
    assert sorted(by_index) == list(range(len(REQUESTS)))
    for i, local in enumerate(reference):
        assert_same(by_index[i], local)


def test_score_rpc_one_request_at_a_time(served, reference):
    _, target = served
    scoring = stub(target)
    from serving.grpc.convert import result_from_proto

    for request, local in zip(REQUESTS[:6], reference):
        assert_same(result_from_proto(scoring.Score(to_proto(request), timeout=T)), local)


def test_model_info_reports_the_scorer(served, scorer):
    server, target = served
    with Client(target) as client:
        info = client.info()
    response = stub(target).ModelInfo(pb.ModelInfoRequest(), timeout=T)
    local = scorer.info
    assert response.architecture == local["model_type"]
    assert (response.vocab_size, response.max_context) == (local["vocab_size"],
                                                           local["max_context"])
    assert response.backend == local["backend"] and response.devices == local["devices"]
    assert response.theta_flops == pytest.approx(local["theta_flops"])
    assert response.max_queued_tokens == server.options.max_queued_tokens
    assert info["theta_source"] == local["theta_source"]
    assert info["max_message_bytes"] == server.options.max_message_bytes


def test_ids_round_trip_and_ids_too_big_for_int64_are_refused_by_the_client(served):
    _, target = served
    requests = [{"id": i, "prompt": "hello", "candidates": [" yes", " no"]}
                for i in ("text-id", 0, -5, (1 << 63) - 1, None)]
    requests.append({"id": 1 << 64, "prompt": "hello", "candidates": [" yes", " no"]})
    with Client(target) as client:
        results = client.score(requests, timeout=T)
    assert [r.id for r in results] == [r["id"] for r in requests]
    assert all(r.error is None for r in results[:-1])
    assert results[-1].error == f"request {str(1 << 64)!r}: id: integer ids must fit in 64 bits " \
                                f"(gRPC int64)"


# =========================================================================== bad input
BAD = [  # (request, the field and problem the message must name)
    ({"prompt": "", "candidates": [" a"]}, "prompt: is empty"),
    ({"prompt_token_ids": [1] * 40_000, "candidates": [" a"]}, "prompt: has 40000 tokens, "
                                                                "more than max_context"),
    ({"prompt": "hello"}, "candidates: no candidates"),
    ({"prompt": "hello", "candidates": [" a", ""]}, "candidates[1]: '' tokenizes to no tokens"),
    ({"prompt": "hello", "candidates": [" a"], "kind": "sideways"}, "kind: 'sideways' is not one"),
    ({"prompt": "hi", "prompt_token_ids": [1], "candidates": [" a"]},
     "prompt: give exactly one of prompt or prompt_token_ids (got both)"),
    ({"prompt_token_ids": [1, 10 ** 9], "candidates": [" a"]},
     "prompt_token_ids: token id 1000000000 (position 1) is outside the vocabulary"),
]


def lenient_request(prompt: bytes, candidates: list[bytes], request_id: bytes | None = None):
    """A ScoreRequest whose text need not be UTF-8 (same wire format)."""
    message = decoding.lenient_class(pb.ScoreRequest)(prompt=prompt, candidates=candidates)
    if request_id is not None:
        message.string_id = request_id
    return message


def raw_call(target: str, method: str, streaming: bool = False):
    channel = grpc.insecure_channel(target)
    make = channel.stream_stream if streaming else channel.unary_unary
    return make(f"/moejax.v1.Scoring/{method}", request_serializer=lambda m: m.SerializeToString(),
                response_deserializer={"Score": pb.ScoreResult, "ScoreBatch": pb.ScoreBatchResponse,
                                       "ScoreStream": pb.StreamResult}[method].FromString)


def test_invalid_requests_get_invalid_argument_naming_the_field(served):
    _, target = served
    scoring = stub(target)
    for request, expected in BAD:
        with pytest.raises(grpc.RpcError) as info:
            scoring.Score(to_proto({"id": "r1", **request}), timeout=T)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details().startswith("request 'r1': ")
        assert expected in info.value.details(), (expected, info.value.details())
    # Text that is not UTF-8 cannot even be parsed as proto3 strings: still a clean status.
    cases = [(lenient_request(b"caf\xe9", [b" a"], b"r2"),
              "request 'r2': prompt: is not valid UTF-8 (invalid at byte 3)"),
             (lenient_request(b"ok", [b" a", b"\xff"]),
              "request #0: candidates[1]: is not valid UTF-8 (invalid at byte 0)")]
    for message, expected in cases:
        with pytest.raises(grpc.RpcError) as info:
            raw_call(target, "Score")(message, timeout=T)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details() == expected


def test_bad_items_of_a_batch_or_stream_get_error_results_and_the_rest_is_scored(served, scorer):
    _, target = served
    good = {"id": "good", "prompt": "hello there", "candidates": [" yes", " no"]}
    expected = scorer.score([good])[0]
    items = [to_proto(good)] + [to_proto(request) for request, _ in BAD] + [to_proto(good)]
    response = stub(target).ScoreBatch(pb.ScoreBatchRequest(requests=items), timeout=T)
    from serving.grpc.convert import result_from_proto

    results = [result_from_proto(m) for m in response.results]
    assert_same(results[0], expected)
    assert_same(results[-1], expected)
    for i, (_, problem) in enumerate(BAD, start=1):
        assert results[i].error.startswith(f"request #{i}: ") and problem in results[i].error
        assert results[i].logprobs is None and results[i].label is None
    # Non-UTF-8 items: the batch as a whole does not parse as proto3; only they fail.
    lenient = decoding.lenient_class(pb.ScoreBatchRequest)()
    lenient.requests.add().CopyFrom(lenient_request(b"hello there", [b" yes", b" no"], b"good"))
    lenient.requests.add().CopyFrom(lenient_request(b"\xc3(", [b" a"]))
    response = raw_call(target, "ScoreBatch")(lenient, timeout=T)
    assert_same(result_from_proto(response.results[0]), expected)
    assert response.results[1].error == "request #1: prompt: is not valid UTF-8 (invalid at byte 0)"
    # The same in a stream, with explicit indices.
    stream_class = decoding.lenient_class(pb.StreamRequest)
    messages = [stream_class(index=10), stream_class(index=11), stream_class(index=12)]
    messages[0].request.CopyFrom(lenient_request(b"hello there", [b" yes", b" no"], b"good"))
    messages[1].request.CopyFrom(lenient_request(b"bad \xff text", [b" a"]))
    messages[2].request.CopyFrom(lenient_request(b"", [b" a"]))
    answers = {m.index: result_from_proto(m.result)
               for m in raw_call(target, "ScoreStream", streaming=True)(iter(messages), timeout=T)}
    assert sorted(answers) == [10, 11, 12]
    assert_same(answers[10], expected)
    assert answers[11].error == "request #11: prompt: is not valid UTF-8 (invalid at byte 4)"
    assert answers[12].error == "request #12: prompt: is empty"


def test_oversized_messages_are_refused_by_the_size_limit(scorer):
    with running(scorer, max_message_mib=0.05) as (server, target):
        scoring = stub(target)
        with pytest.raises(grpc.RpcError) as info:
            scoring.Score(to_proto({"prompt": "x" * 100_000, "candidates": [" a"]}), timeout=T)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert scoring.Score(to_proto({"prompt": "hello", "candidates": [" a", " b"]}),
                             timeout=T).label in (0, 1)
        assert server.stats()["requests"] == 1  # the big one never reached the queue


# =========================================================================== admission, deadlines
def test_admission_control_refuses_with_a_retry_hint_and_streams_wait(scorer):
    bound = 64
    with running(scorer, max_queued_tokens=bound) as (server, target):
        scoring = stub(target)
        scorer.gate.clear()
        scorer.entered.clear()
        first = scoring.Score.future(to_proto({"prompt": "a" * 30, "candidates": [" a", " b"]}),
                                     timeout=T)
        assert scorer.entered.wait(T)  # the worker holds the first request (30 tokens)
        with pytest.raises(grpc.RpcError) as info:
            scoring.Score(to_proto({"prompt": "b" * 40, "candidates": [" a", " b"]}), timeout=T)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        hint = dict(info.value.trailing_metadata())["retry-after-ms"]
        assert int(hint) > 0 and f"retry after {hint} ms" in info.value.details()
        with pytest.raises(grpc.RpcError) as info:
            scoring.ScoreBatch(pb.ScoreBatchRequest(requests=[
                to_proto({"prompt": "c" * 100, "candidates": [" a"]})] * 3), timeout=T)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "split them" in info.value.details()
        scorer.gate.set()
        assert first.result(timeout=T).label in (0, 1)
        assert scoring.Score(to_proto({"prompt": "b" * 40, "candidates": [" a", " b"]}),
                             timeout=T).label in (0, 1)
        # A stream of 20 x 22 tokens, far over the bound, is throttled, not refused.
        requests = [{"id": i, "prompt": f"{i:02d}" + "z" * 18, "candidates": [" a", " b"]}
                    for i in range(20)]
        with Client(target) as client:
            results = client.score(requests, timeout=T)
        assert [r.id for r in results] == list(range(20)) and all(r.error is None for r in results)
        stats = server.stats()
        assert stats["peak_queued_tokens"] <= bound and stats["rejected"] == 2  # Score, ScoreBatch
        assert wait_until(lambda: server.stats()["queued_tokens"] == 0)


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """Every sample of a real GET /metrics, parsed by prometheus_client's own parser."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=T) as response:
        text = response.read().decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}


def moved(before: dict, after: dict, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    return after.get(key, 0.0) - before.get(key, 0.0)


def test_metrics_move_by_what_was_served(scorer):
    """--metrics-port: Prometheus text over a real socket, scraped before and after a few
    calls; the request counters (by endpoint, kind, status), the latency and model-call
    histograms and the engines' counters move by exactly what was served."""
    with running(scorer, metrics_port=0, max_queued_tokens=64) as (server, target):
        port = server.metrics_port
        before = scrape(port)
        assert before[("moejax_max_queued_token_equivalents", ())] == 64
        scoring = stub(target)
        ok = [{"prompt": "Is it red?", "candidates": [" yes", " no"]},
              {"kind": "choice", "prompt": "Which is a number?", "candidates": ["seven", "table"]}]
        for request in ok:
            scoring.Score(to_proto(request), timeout=T)
        with pytest.raises(grpc.RpcError):
            scoring.Score(to_proto({"prompt": "x", "candidates": [" a"], "kind": "sideways"}),
                          timeout=T)
        scoring.ScoreBatch(pb.ScoreBatchRequest(requests=[
            to_proto(ok[0]), to_proto({"prompt": "", "candidates": [" a"]})]), timeout=T)
        with pytest.raises(grpc.RpcError) as refused:          # more than the whole bound
            scoring.Score(to_proto({"prompt": "z" * 300, "candidates": [" a"]}), timeout=T)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        after = scrape(port)
    count = "moejax_requests_total"
    assert moved(before, after, count, endpoint="Score", kind="classify", status="ok") == 1
    assert moved(before, after, count, endpoint="Score", kind="choice", status="ok") == 1
    assert moved(before, after, count, endpoint="Score", kind="unknown", status="invalid") == 1
    assert moved(before, after, count, endpoint="ScoreBatch", kind="classify", status="ok") == 1
    assert moved(before, after, count, endpoint="ScoreBatch", kind="classify",
                 status="error") == 1
    assert moved(before, after, count, endpoint="Score", kind="unknown", status="refused") == 1
    # Three requests reached the model: their latency, queue wait and model calls.
    assert moved(before, after, "moejax_request_duration_seconds_count", endpoint="Score") == 2
    assert moved(before, after, "moejax_request_duration_seconds_count",
                 endpoint="ScoreBatch") == 1
    assert moved(before, after, "moejax_queue_wait_seconds_count") == 3
    calls = moved(before, after, "moejax_model_call_requests_count")  # the batcher's calls
    assert 1 <= calls <= moved(before, after, "moejax_engine_model_calls_total", engine="0")
    assert moved(before, after, "moejax_model_call_requests_sum") == 3
    assert moved(before, after, "moejax_engine_tokens_total", engine="0") > 0
    assert after[("moejax_queued_token_equivalents", ())] == 0


def test_a_request_whose_deadline_passes_in_the_queue_is_not_computed(scorer):
    with running(scorer) as (server, target):
        scoring = stub(target)
        scorer.gate.clear()
        scorer.entered.clear()
        blocker = scoring.Score.future(to_proto({"prompt": "first", "candidates": [" a", " b"]}),
                                       timeout=T)
        assert scorer.entered.wait(T)
        with pytest.raises(grpc.RpcError) as info:
            scoring.Score(to_proto({"prompt": "late", "candidates": [" a", " b"]}), timeout=0.3)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        scorer.gate.set()
        assert blocker.result(timeout=T).label in (0, 1)
        assert wait_until(lambda: server.stats()["dropped_expired"] == 1)
        assert server.stats()["scored"] == 1  # only the blocker was computed


# =========================================================================== faults, load
def test_a_cancelled_stream_and_an_expired_call_do_not_disturb_the_others(served, scorer,
                                                                          reference):
    server, target = served
    before = server.stats()
    release = threading.Event()

    def endless():
        for i in range(1000):
            if i == 5:
                release.wait(T)
            yield pb.StreamRequest(request=to_proto({"id": i, "prompt": f"stream {i}",
                                                     "candidates": [" a", " b"]}))

    errors: queue.Queue = queue.Queue()

    def cancelling_client():
        responses = stub(target).ScoreStream(endless(), timeout=T)
        try:
            next(responses)
            responses.cancel()
            next(responses)
        except grpc.RpcError as exc:
            errors.put(("cancel", exc.code()))
        finally:
            release.set()

    def impatient_client():
        try:
            stub(target).Score(to_proto({"prompt": "hurry " * 50, "candidates": [" a", " b"]}),
                               timeout=0.001)
        except grpc.RpcError as exc:
            errors.put(("timeout", exc.code()))

    outcomes: queue.Queue = queue.Queue()

    def good_client():
        with Client(target) as client:
            outcomes.put(client.score(REQUESTS, timeout=T))

    threads = [threading.Thread(target=f) for f in
               (cancelling_client, impatient_client, good_client, good_client, good_client)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(T)
    assert sorted(errors.queue) == [("cancel", grpc.StatusCode.CANCELLED),
                                    ("timeout", grpc.StatusCode.DEADLINE_EXCEEDED)]
    assert outcomes.qsize() == 3
    for results in outcomes.queue:
        for result, local in zip(results, reference, strict=True):
            assert_same(result, local)
    assert health_status(target) == "SERVING"
    assert wait_until(lambda: server.stats()["queued_tokens"] == 0)
    with Client(target) as client:
        assert_same(client.score(REQUESTS[:1], timeout=T)[0], reference[0])
    assert server.stats()["failed"] == before["failed"]


def test_load_16_clients_2000_requests_each_answered_exactly_once(scorer):
    psutil = pytest.importorskip("psutil")
    valid = [{"prompt": f"w{k} w{k % 7}", "candidates": [" yes", " no"]} for k in range(20)]
    invalid = [{"prompt": "", "candidates": [" yes"]}, {"prompt": "x", "kind": "sideways",
                                                         "candidates": [" a"]},
               {"prompt": "x"}, {"prompt": "x", "candidates": [" a", ""]}]
    expected = {json.dumps(r, sort_keys=True): res for r, res in zip(valid, scorer.score(valid))}
    threads, per_thread, bound = 16, 128, 2048
    answers: dict[str, list] = {}
    lock = threading.Lock()

    def record(request_id, answer):
        with lock:
            answers.setdefault(request_id, []).append(answer)

    def work(t: int) -> None:
        rng = np.random.default_rng(t)
        scoring = stub(target)
        with Client(target) as client:
            i = 0
            while i < per_thread:
                chunk = []
                for _ in range(min(8, per_thread - i)):
                    pool = valid if rng.random() < 0.8 else invalid
                    chunk.append({"id": f"{t}-{i}", **pool[int(rng.integers(len(pool)))]})
                    i += 1
                mode = int(rng.integers(3))
                if mode == 0:    # unary, one call per request
                    for request in chunk:
                        try:
                            result = scoring.Score(to_proto(request), timeout=T)
                            record(request["id"], ("result", request, result.logprobs[:]))
                        except grpc.RpcError as exc:
                            record(request["id"], ("status", request, exc.code()))
                elif mode == 1:  # one batch
                    try:
                        response = scoring.ScoreBatch(pb.ScoreBatchRequest(
                            requests=[to_proto(r) for r in chunk]), timeout=T)
                        for request, result in zip(chunk, response.results, strict=True):
                            record(result.string_id, ("result", request, result.logprobs[:]
                                                      if not result.HasField("error") else None))
                    except grpc.RpcError as exc:
                        for request in chunk:
                            record(request["id"], ("status", request, exc.code()))
                else:            # the client, over a stream
                    for request, result in zip(chunk, client.score(chunk, timeout=T)):
                        record(result.id, ("result", request, result.logprobs))

    with running(scorer, max_queued_tokens=bound) as (server, target):
        process = psutil.Process()
        rss_before = process.memory_info().rss
        workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(180)
        assert not any(worker.is_alive() for worker in workers)
        rss_growth = process.memory_info().rss - rss_before
        stats = server.stats()
        assert health_status(target) == "SERVING"
    assert len(answers) == threads * per_thread
    duplicated = {k: v for k, v in answers.items() if len(v) != 1}
    assert not duplicated, list(duplicated.items())[:3]
    counts = {"result": 0, "error": 0, "invalid_status": 0, "busy": 0}
    for [(what, request, value)] in answers.values():
        key = json.dumps({k: v for k, v in request.items() if k != "id"}, sort_keys=True)
        if key in expected:
            if what == "status":
                assert value == grpc.StatusCode.RESOURCE_EXHAUSTED
                counts["busy"] += 1
                continue
            b = np.asarray(expected[key].logprobs)
            assert np.all(np.abs(np.asarray(value) - b) / np.maximum(1.0, np.abs(b)) <= 1e-5)
            counts["result"] += 1
        elif what == "status":
            assert value in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED)
            counts["invalid_status"] += 1
        else:
            assert value is None  # an error result
            counts["error"] += 1
    assert counts["result"] > 1000 and counts["error"] + counts["invalid_status"] > 100, counts
    assert stats["peak_queued_tokens"] <= bound
    assert stats["failed"] == 0 and stats["queued_tokens"] == 0
    assert rss_growth < 512 << 20, f"RSS grew by {rss_growth >> 20} MiB"


# =========================================================================== lifecycle, auth, TLS
def test_health_is_not_serving_until_loaded_and_reflection_lists_the_services(scorer):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import \
        ProtoReflectionDescriptorDatabase

    server = ScoringServer(ServerOptions(port=0))
    target = f"127.0.0.1:{server.start()}"
    try:
        assert health_status(target) == "NOT_SERVING"
        assert health_status(target, "moejax.v1.Scoring") == "NOT_SERVING"
        with pytest.raises(grpc.RpcError) as info:
            stub(target).Score(to_proto(REQUESTS[0]), timeout=T)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        server.attach(scorer)
        assert health_status(target) == "SERVING"
        assert health_status(target, "moejax.v1.Scoring") == "SERVING"
        database = ProtoReflectionDescriptorDatabase(grpc.insecure_channel(target))
        services = set(database.get_services())
        assert {"moejax.v1.Scoring", "grpc.health.v1.Health"} <= services
        assert database.FindFileContainingSymbol("moejax.v1.Scoring").package == "moejax.v1"
    finally:
        server.stop(1)


def test_stop_turns_health_not_serving_then_finishes_in_flight_calls(scorer):
    server = ScoringServer(ServerOptions(port=0, grace_seconds=20))
    target = f"127.0.0.1:{server.start()}"
    server.attach(scorer)
    watch = health_pb2_grpc.HealthStub(grpc.insecure_channel(target)).Watch(
        health_pb2.HealthCheckRequest(service=""), timeout=T)
    assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
    scorer.gate.clear()
    scorer.entered.clear()
    try:
        in_flight = stub(target).Score.future(to_proto(REQUESTS[0]), timeout=T)
        assert scorer.entered.wait(T)
        stopper = threading.Thread(target=server.stop)
        stopper.start()
        assert next(watch).status == health_pb2.HealthCheckResponse.NOT_SERVING
        assert wait_until(lambda: server.service.stopping.is_set())
        with pytest.raises(grpc.RpcError) as info:  # refused (how depends on the connection)
            stub(target).Score(to_proto(REQUESTS[0]), timeout=T)
        assert info.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
    finally:
        scorer.gate.set()
    assert in_flight.result(timeout=T).label in (0, 1)  # finished within the grace period
    stopper.join(T)
    assert not stopper.is_alive()


def test_bearer_token_auth(scorer):
    with running(scorer, token="s3cret") as (_, target):
        for token in (None, "wrong"):
            with Client(target, token=token) as client:
                with pytest.raises(grpc.RpcError) as info:
                    client.score(REQUESTS[:1], timeout=T)
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
                with pytest.raises(grpc.RpcError) as info:
                    client.info()
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert client.health() == "SERVING"  # health stays open for load balancers
        with pytest.raises(grpc.RpcError) as info:
            stub(target).Score(to_proto(REQUESTS[0]), timeout=T)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with Client(target, token="s3cret") as client:
            assert client.score(REQUESTS[:1], timeout=T)[0].error is None
            assert client.info()["vocab_size"] == scorer.info["vocab_size"]


def _self_signed(tmp_path):
    """A self-signed certificate for localhost / 127.0.0.1 (openssl, else cryptography)."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    if shutil.which("openssl"):
        subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt",
                        "ec_paramgen_curve:prime256v1", "-nodes", "-days", "1", "-subj",
                        "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
                        "-keyout", str(key), "-out", str(cert)], check=True,
                       capture_output=True, timeout=T)
        return cert, key
    x509 = pytest.importorskip("cryptography.x509", reason="neither openssl nor cryptography")
    import datetime
    import ipaddress

    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    private = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(x509.oid.NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    certificate = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
                   .public_key(private.public_key()).serial_number(1)
                   .not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.SubjectAlternativeName([
                       x509.DNSName("localhost"),
                       x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
                   .sign(private, hashes.SHA256()))
    cert.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    key.write_bytes(private.private_bytes(serialization.Encoding.PEM,
                                          serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    return cert, key


def test_tls(scorer, reference, tmp_path):
    cert, key = _self_signed(tmp_path)
    with running(scorer, tls_cert=str(cert), tls_key=str(key)) as (server, target):
        port = server.port
        with Client(f"localhost:{port}", tls_ca=str(cert)) as client:
            assert_same(client.score(REQUESTS[:1], timeout=T)[0], reference[0])
        with Client(f"127.0.0.1:{port}") as plaintext:
            with pytest.raises(grpc.RpcError) as info:
                plaintext.score(REQUESTS[:1], timeout=5)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE


# =========================================================================== client CLI
def test_client_cli_streams_a_jsonl_file_in_input_order(served, scorer, tmp_path):
    from serving.cli import main

    _, target = served
    lines = [json.dumps(r) for r in REQUESTS[:3]] + ["{not json", ""] + \
            [json.dumps(r) for r in REQUESTS[3:]]
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join(lines) + "\n", encoding="utf-8")
    assert main(["client", "score", str(source), "--target", target, "-o", str(out),
                 "--timeout", str(T), "--no-progress"]) == 0
    written = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert len(written) == len(REQUESTS) + 1
    assert written[3]["error"].startswith("line 4: invalid JSON")
    rest = written[:3] + written[4:]
    # Id-less requests are named by their line ordinal; the in-process call names them by
    # their position in the list, which differs by one after the bad line.
    local = scorer.score(REQUESTS)
    for got, want in zip(rest, local):
        assert (got["id"], got["label"], got.get("selected")) == (want.id, want.label,
                                                                 want.selected)
        if want.error is None:
            assert np.allclose(got["logprobs"], want.logprobs, rtol=1e-5, atol=1e-5)
        else:
            assert got["error"].split(": ", 1)[1] == want.error.split(": ", 1)[1]



def test_a_stream_reads_no_further_than_its_window_of_unsent_results(monkeypatch, scorer):
    """A client that sends without reading: gRPC stops taking the server's responses once
    its flow-control window is full, and the reader then stops reading requests."""
    import asyncio

    from serving.grpc import service
    from serving.grpc.batcher import Admission
    from serving.requests import ScoreResult

    monkeypatch.setattr(service, "STREAM_WINDOW", 4)

    class Context:
        def time_remaining(self):
            return None

    class InstantBatcher:
        admission = Admission(1000)

        def retry_after_ms(self, tokens):
            return 10

        def submit(self, items):
            for item in items:
                self.admission.release(item.cost)
                item.deliver(item, ScoreResult(id=item.request.id, logprobs=[0.0], label=0))

    pulled = []

    async def messages():
        for i in range(40):
            pulled.append(i)
            yield pb.StreamRequest(request=to_proto({"id": i, "prompt": "p",
                                                     "candidates": [" a"]}))

    async def scenario():
        scoring = service.ScoringService()
        scoring.scorer = scorer
        stream = service._Stream(scoring, InstantBatcher(), Context())
        reader = asyncio.ensure_future(stream.read(messages()))
        for _ in range(200):
            if len(pulled) == 4:
                break
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)  # the reader waits for a free slot
        assert len(pulled) == 4 and not reader.done()
        ids = [m.result.int_id async for m in stream.results()]
        await reader
        scoring.close()
        return ids

    assert sorted(asyncio.run(scenario())) == list(range(40))


def test_the_loop_handler_quiets_only_the_closed_poller(caplog):
    """gRPC's poller firing after its queue closed (EBADF) is not printed as an error;
    any other loop exception still reaches asyncio's default handler."""
    import asyncio
    import errno as errno_lib
    import logging

    from serving.grpc.server import quiet_poller_shutdown

    loop = asyncio.new_event_loop()
    try:
        with caplog.at_level(logging.DEBUG):
            quiet_poller_shutdown(loop, {"message": "Exception in callback",
                                         "exception": OSError(errno_lib.EBADF, "Bad file descriptor")})
            assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
            quiet_poller_shutdown(loop, {"message": "Exception in callback",
                                         "exception": RuntimeError("a real bug")})
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1 and "Exception in callback" in errors[0].getMessage()
    finally:
        loop.close()
