"""One oversized call must not starve the others (issue 37, defect 3), and a malformed
``ModelInfo`` request is INVALID_ARGUMENT (issue 37, item 9c).

A ``ScoreBatch`` of more requests than the server prepares at once (``max_preparing``), or
whose least possible cost is over the whole queue bound (``max_queued_tokens``), is refused
before any of it is tokenized, so the other clients' calls and health are served as usual.
"Tokenized" is observed directly: the Scorer behind the server records every request it is
asked to prepare, and can hold the oversized batch's requests there, so that on a server
that did prepare them the other clients' calls run while it does.
"""

from __future__ import annotations

import logging
import threading

import grpc
import pytest

from serving import Scorer
from serving.grpc import scoring_pb2 as pb
from serving.grpc.convert import result_from_proto
from serving.grpc.server import batch_deserializer
from serving.grpc.service import OversizedBatch
from test_grpc_server import (T, SharedScorer, assert_same, health_status, running, stub,
                              to_proto, wait_until)

pytestmark = pytest.mark.timeout(120)

BIG = "big-"   # the id prefix of the oversized call's requests


class PrepareWatcher(SharedScorer):
    """The module's Scorer, recording the id of every request it prepares (tokenizes);
    while ``hold`` is clear, a request of the oversized call (id prefix ``BIG``) waits
    there (``held`` tells that one does), as a long tokenization would."""

    def __init__(self, scorer: Scorer):
        super().__init__(scorer)
        self.prepared: list[object] = []
        self.hold = threading.Event()
        self.hold.set()
        self.held = threading.Event()

    def prepare(self, request, index=0):
        self.prepared.append(request.id)
        if str(request.id).startswith(BIG) and not self.hold.is_set():
            self.held.set()
            self.hold.wait(T)
        return self.scorer.prepare(request, index)

    def prepared_of_big(self) -> list[object]:
        return [i for i in self.prepared if str(i).startswith(BIG)]


@pytest.fixture(scope="module")
def scorer() -> PrepareWatcher:
    return PrepareWatcher(Scorer("demo", max_batch_tokens=32, calibrate=False))


SMALL = [{"id": f"small-{i}", "prompt": f"Is {i} even?", "candidates": [" yes", " no"]}
         for i in range(4)]


def call_outcome(future: grpc.Future) -> object:
    """The result of a finished call, or its RpcError."""
    try:
        return future.result(timeout=T)
    except grpc.RpcError as exc:
        return exc


def assert_refused_without_hint(outcome: object, details: str) -> None:
    assert isinstance(outcome, grpc.RpcError), outcome
    assert outcome.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert outcome.details() == details
    assert "retry-after-ms" not in dict(outcome.trailing_metadata() or ())


# ============================================================================ defect 3
def test_an_oversized_batch_is_refused_untokenized_while_others_are_served(scorer):
    local = scorer.score(SMALL)
    big = pb.ScoreBatchRequest(requests=[
        to_proto({"id": f"{BIG}{i}", "prompt": f"w{i}", "candidates": [" a", " b"]})
        for i in range(600)])
    with running(scorer) as (server, target):
        assert server.options.max_preparing == 256     # the default: 600 requests is over it
        scorer.prepared.clear()
        scorer.hold.clear()
        try:
            big_call = stub(target).ScoreBatch.future(big, timeout=T)
            # Refused, or (a server that prepares it) held at its first tokenization.
            assert wait_until(lambda: big_call.done() or scorer.held.is_set())
            # Meanwhile: other clients, each on a channel of its own, and health.
            others = [stub(target).Score.future(to_proto(r), timeout=T) for r in SMALL]
            outcomes = [call_outcome(call) for call in others]
            health = health_status(target)
        finally:
            scorer.hold.set()
        big_outcome = call_outcome(big_call)
        stats = server.stats()
    for outcome, want in zip(outcomes, local):
        assert isinstance(outcome, pb.ScoreResult), outcome
        assert_same(result_from_proto(outcome), want)
    assert health == "SERVING"
    assert_refused_without_hint(big_outcome, (
        "the batch holds 600 requests, more than the server prepares for one call (256, "
        "max_preparing): split it into batches of at most 256 requests, or send them over "
        "ScoreStream"))
    assert scorer.prepared_of_big() == []   # not one of its requests was tokenized
    assert stats["refused_oversized"] == 1 and stats["refused_overload"] == 0
    # Nor made into Python objects: the server's deserializer only counted them.
    assert batch_deserializer(256)(big.SerializeToString()) == OversizedBatch(600)
    assert len(batch_deserializer(600)(big.SerializeToString())) == 600


def test_requests_whose_least_cost_is_over_the_bound_are_refused_untokenized(scorer):
    # 20 requests of 40 prompt token ids: at least 40 token-equivalents each, 800 in all.
    over = pb.ScoreBatchRequest(requests=[
        to_proto({"id": f"{BIG}{i}", "prompt_token_ids": [10 + i] * 40,
                  "candidate_token_ids": [[5], [6]]}) for i in range(20)])
    one_over = to_proto({"id": f"{BIG}one", "prompt_token_ids": [7] * 150,
                         "candidate_token_ids": [[5], [6]]})
    fits = [{"id": f"fits-{i}", "prompt_token_ids": [10 + i] * 40,
             "candidate_token_ids": [[5], [6]]} for i in range(2)]
    local = scorer.score(fits)
    with running(scorer, max_queued_tokens=100) as (server, target):
        scorer.prepared.clear()
        scoring = stub(target)
        with pytest.raises(grpc.RpcError) as batch_refused:
            scoring.ScoreBatch(over, timeout=T)
        with pytest.raises(grpc.RpcError) as one_refused:
            scoring.Score(one_over, timeout=T)
        # Within the bound by the estimate: prepared, admitted and scored as before.
        served = scoring.ScoreBatch(pb.ScoreBatchRequest(
            requests=[to_proto(r) for r in fits]), timeout=T)
        stats = server.stats()
    assert_refused_without_hint(batch_refused.value, (
        "the request(s) need at least 800 token-equivalents of compute, more than the "
        "server's bound of 100 (max_queued_tokens): split them, or use ScoreStream"))
    assert_refused_without_hint(one_refused.value, (
        "the request(s) need at least 150 token-equivalents of compute, more than the "
        "server's bound of 100 (max_queued_tokens): split them, or use ScoreStream"))
    assert scorer.prepared_of_big() == []
    assert stats["refused_oversized"] == 2
    for message, want in zip(served.results, local):
        assert_same(result_from_proto(message), want)


# ============================================================================ item 9c
def test_a_malformed_model_info_request_is_invalid_argument_without_a_traceback(scorer, caplog):
    with running(scorer) as (_, target):
        channel = grpc.insecure_channel(target)
        model_info = channel.unary_unary("/moejax.v1.Scoring/ModelInfo",
                                         request_serializer=None, response_deserializer=None)
        with caplog.at_level(logging.WARNING):
            codes = []
            for _ in range(3):
                with pytest.raises(grpc.RpcError) as refused:
                    model_info(b"\xff\xff\xff", timeout=T)   # not protobuf: a corrupt tag
                codes.append((refused.value.code(), refused.value.details()))
        info = pb.ModelInfoResponse.FromString(model_info(b"", timeout=T))
    assert codes == [(grpc.StatusCode.INVALID_ARGUMENT,
                      "not a valid moejax.v1.ModelInfoRequest message")] * 3
    logged = [(r.name, r.getMessage()) for r in caplog.records
              if r.levelno >= logging.ERROR or r.exc_info]
    assert logged == []
    assert info.model_name == "demo"
