"""The gRPC server under hostile input and overload (issue 14, items 1-4): huge requests
are refused before tokenizing and leave no memory behind, health answers whatever the
load, every refusal under load carries a retry hint, a request's prompt is shared among
its candidates, and a long request never holds small ones for more than a batch.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from serving import Scorer
from serving.grpc import scoring_pb2 as pb
from serving.grpc.batcher import Batcher, WorkItem
from test_grpc_server import (T, SharedScorer, assert_same, running, stub, to_proto,
                              wait_until)

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def scorer() -> SharedScorer:
    return SharedScorer(Scorer("demo", max_batch_tokens=256, calibrate=False))


def rss_mib() -> float:
    """Resident memory of this process now (Linux /proc), MiB."""
    with open("/proc/self/statm") as fh:
        pages = int(fh.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def health_check(target: str, timeout: float) -> str:
    response = health_pb2_grpc.HealthStub(grpc.insecure_channel(target)).Check(
        health_pb2.HealthCheckRequest(service=""), timeout=timeout)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


# ============================================================================ item 1
def test_a_huge_prompt_is_refused_before_tokenizing_and_leaves_no_memory_behind(scorer):
    limits = scorer.info["limits"]
    with running(scorer) as (server, target):
        scoring = stub(target)
        huge = to_proto({"id": "big", "prompt": "word " * 3_000_000, "candidates": [" a"]})
        assert huge.ByteSize() > 14 * 2**20   # 15 MB: within the 16 MiB message limit
        scoring.Score(to_proto({"prompt": "warm up", "candidates": [" a", " b"]}), timeout=T)
        before = rss_mib()
        for _ in range(5):
            start = time.perf_counter()
            with pytest.raises(grpc.RpcError) as info:
                scoring.Score(huge, timeout=T)
            refused_after = time.perf_counter() - start
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert info.value.details() == (
                f"request 'big': prompt: the request's text (prompt and candidates) is over "
                f"the limit of {limits['max_text_bytes']} UTF-8 bytes (max_text_bytes)")
        # Nothing was tokenized: a 15 MB prompt takes tens of seconds to tokenize here.
        assert refused_after < 5.0
        del huge
        # Five 15 MB messages came and went (client and server in this process): what
        # stays is allocator slack, not the gigabytes a tokenized prompt took.
        assert rss_mib() - before < 160
        assert health_check(target, T) == "SERVING"
        assert server.stats()["requests"] == 1   # only the warm-up reached the queue
        info = pb.ModelInfoResponse()
        info.CopyFrom(scoring.ModelInfo(pb.ModelInfoRequest(), timeout=T))
        assert (info.max_text_bytes, info.max_token_ids, info.max_candidates) == (
            limits["max_text_bytes"], limits["max_token_ids"], limits["max_candidates"])
        assert info.model_name == "demo" and "model_dir" not in info.info_json
        assert scorer.info["model_dir"] not in info.info_json


def test_over_limit_items_of_a_batch_get_error_results_and_the_rest_is_scored(scorer):
    limits = scorer.info["limits"]
    many = [f" c{i}" for i in range(limits["max_candidates"] + 1)]
    with running(scorer) as (server, target):
        response = stub(target).ScoreBatch(pb.ScoreBatchRequest(requests=[
            to_proto({"id": "ok", "prompt": "Is it good?", "candidates": [" yes", " no"]}),
            to_proto({"id": "wide", "prompt": "Pick one", "candidates": many}),
            to_proto({"id": "long", "prompt_token_ids": [5] * (scorer.config.max_context + 1),
                      "candidate_token_ids": [[6]]}),
        ]), timeout=T)
    ok, wide, long = response.results
    assert not ok.HasField("error") and len(ok.logprobs) == 2
    assert wide.error == (f"request 'wide': candidates: {len(many)} candidates, over the limit "
                          f"of {limits['max_candidates']} (max_candidates)")
    assert long.error.startswith("request 'long': prompt: has ") and "max_context" in long.error


def test_limits_apply_to_the_python_api_too():
    scorer = Scorer("demo", calibrate=False, max_text_bytes=100, max_candidates=3)
    results = scorer.score([
        {"prompt": "x" * 101, "candidates": [" a"]},
        {"prompt": "short", "candidates": [" a", " b", " c", " d"]},
        {"prompt": "short", "candidates": [" a", " b"]},
    ])
    assert results[0].error == ("request #0: prompt: the request's text (prompt and "
                                "candidates) is over the limit of 100 UTF-8 bytes "
                                "(max_text_bytes)")
    assert results[1].error == ("request #1: candidates: 4 candidates, over the limit of 3 "
                                "(max_candidates)")
    assert results[2].error is None
    assert scorer.info["limits"] == {"max_text_bytes": 100, "max_token_ids": 32768,
                                     "max_candidates": 3}
    with pytest.raises(ValueError, match="max_candidates must be a positive integer"):
        Scorer("demo", calibrate=False, max_candidates=0)


# ============================================================================ item 2
def test_a_prompt_is_computed_once_for_all_its_candidates_by_default():
    shared = Scorer("demo", calibrate=False)
    alone = Scorer("demo", calibrate=False, share_prompts=False)
    assert shared.info["share_prompts"] and not alone.info["share_prompts"]
    prompt = "Review: the food was great and the staff were kind. " * 8 + "\nVerdict:"
    request = {"prompt": prompt, "candidate_token_ids": [[100 + i, 300 + i] for i in range(40)]}
    got, want = shared.score([request])[0], alone.score([request])[0]
    np.testing.assert_allclose(got.logprobs, want.logprobs, rtol=1e-5, atol=1e-5)
    assert got.label == want.label
    # The prompt ran once: 39 candidates read it instead of computing it.
    prompt_tokens = got.prompt_tokens
    assert shared.engine.stats.prefix_tokens_shared >= 39 * (prompt_tokens - 16)
    assert alone.engine.stats.prefix_tokens_shared == 0
    # Admission counts what runs: the shared request costs a fraction of the unshared one.
    cost_shared, cost_alone = shared.prepare(request).cost, alone.prepare(request).cost
    assert cost_shared < cost_alone / 10
    with pytest.raises(ValueError, match="share_prompts=true needs a backend"):
        Scorer("demo", calibrate=False, backend="tp", share_prompts=True)


class RecordingScorer:
    """A Scorer whose model calls are recorded (and can be held at a gate)."""

    def __init__(self, scorer: Scorer):
        self.scorer = scorer
        self.batches: list[set[int]] = []    # the request indices of each call
        self.gate = threading.Event()
        self.gate.set()
        self.running = threading.Event()

    def __getattr__(self, name):
        return getattr(self.scorer, name)

    def run_ops(self, ops, on_batch_done=None):
        self.batches.append({op.key.request_index for op in ops})
        self.running.set()
        assert self.gate.wait(T)
        return self.scorer.run_ops(ops, on_batch_done)


def test_a_long_request_is_split_and_never_holds_small_ones_for_more_than_a_batch():
    inner = Scorer("demo", calibrate=False, max_batch_tokens=256)
    recorder = RecordingScorer(inner)
    prompt = "Review: the food was great and the staff were kind. " * 4
    long = inner.prepare({"id": "long", "prompt": prompt,
                          "candidate_token_ids": [[100 + i, 300 + i] for i in range(120)]})
    smalls = [inner.prepare({"id": f"s{i}", "prompt": f"Is {i} even?",
                             "candidates": [" yes", " no"]}) for i in range(6)]
    batch_tokens = long.op_costs[0] + 40 * long.op_costs[1]   # the prompt and 40 candidates
    assert long.cost > 1.5 * batch_tokens        # more than a batch: it must be split
    batcher = Batcher(recorder, max_queued_tokens=10**9, batch_tokens=batch_tokens)
    done: dict[str, object] = {}
    finished = threading.Event()

    def deliver(item, outcome):
        done[item.request["id"]] = outcome
        if len(done) == 1 + len(smalls):
            finished.set()

    try:
        recorder.gate.clear()
        batcher.submit([WorkItem(prepared=long, deliver=deliver)])
        assert recorder.running.wait(T)          # the first chunk of the long one runs
        for prepared in smalls[:3]:
            batcher.submit([WorkItem(prepared=prepared, deliver=deliver)])
        recorder.running.clear()
        recorder.gate.set()
        assert recorder.running.wait(T)
        # Small requests that arrived during a batch are all in the very next one.
        later = [WorkItem(prepared=p, deliver=deliver) for p in smalls[3:]]
        batcher.submit(later)
        assert finished.wait(T)
    finally:
        recorder.gate.set()
        batcher.stop(T)
    first, second, third = recorder.batches[:3]
    # Position 0 of each call is the long request's chunk or the first small one; the
    # three small ones that came during the first chunk all ran in the second call.
    assert len(first) == 1 and len(second) >= 3
    assert len(recorder.batches) > 3 and batcher.stats["split"] == 1
    want = inner.score([p.request for p in [long, *smalls]])
    for result, reference in zip([done[p.request["id"]] for p in [long, *smalls]], want):
        assert_same(result, reference)


# ============================================================================ items 3, 4
def test_health_answers_with_300_calls_in_flight_and_every_refusal_has_a_retry_hint(scorer):
    with running(scorer, max_concurrent_rpcs=320) as (server, target):
        scoring = stub(target)
        scorer.gate.clear()
        calls = [scoring.Score.future(to_proto({"id": i, "prompt": f"Is {i} odd?",
                                                "candidates": [" yes", " no"]}), timeout=T)
                 for i in range(300)]
        assert wait_until(lambda: server.service.in_flight >= 300)
        for _ in range(5):
            assert health_check(target, timeout=1.0) == "SERVING"
        # Past max_concurrent_rpcs: the server's own refusal, with a hint.
        extra = [scoring.Score.future(to_proto({"id": 1000 + i, "prompt": "more",
                                                "candidates": [" a"]}), timeout=T)
                 for i in range(40)]
        assert wait_until(lambda: sum(call.done() for call in extra) >= 20)
        refused = [call.exception() for call in extra if call.done()]
        assert refused and all(e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED for e in refused)
        assert all(int(dict(e.trailing_metadata())["retry-after-ms"]) > 0 for e in refused)
        scorer.gate.set()
        results = [call.result(timeout=T) for call in calls]
        assert sorted(r.int_id for r in results) == list(range(300))


def test_a_burst_of_1000_calls_is_refused_only_by_admission_with_retry_hints(scorer):
    with running(scorer, max_queued_tokens=2000) as (server, target):
        scoring = stub(target)
        scorer.gate.clear()
        calls = [scoring.Score.future(to_proto({"id": i, "prompt": f"Claim {i}: it is true.",
                                                "candidates": [" yes", " no"]}), timeout=T)
                 for i in range(1000)]
        assert wait_until(lambda: server.stats()["rejected"] + server.stats()["queue_length"]
                          + server.stats()["refused_overload"] >= 900)
        scorer.gate.set()
        answered, refused = [], []
        for call in calls:
            try:
                answered.append(call.result(timeout=T).int_id)
            except grpc.RpcError as exc:
                refused.append(exc)
        assert answered and refused and len(answered) + len(refused) == 1000
        for exc in refused:
            assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
            assert int(dict(exc.trailing_metadata())["retry-after-ms"]) > 0
        assert len(set(answered)) == len(answered)
        assert server.stats()["peak_queued_tokens"] <= 2000


def test_a_key_that_does_not_match_its_certificate_is_named(tmp_path):
    from serving.grpc.server import ScoringServer, ServerOptions
    from test_grpc_server import _self_signed

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    cert_a, _ = _self_signed(tmp_path / "a")
    _, key_b = _self_signed(tmp_path / "b")
    with pytest.raises(ValueError) as info:
        ScoringServer(ServerOptions(port=0, tls_cert=str(cert_a), tls_key=str(key_b))).start()
    assert str(info.value) == f"TLS: the key {key_b} does not match the certificate {cert_a}"
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("not a certificate")
    with pytest.raises(ValueError, match="is not valid PEM"):
        ScoringServer(ServerOptions(port=0, tls_cert=str(garbage), tls_key=str(key_b))).start()
