"""The gRPC Generation service end to end on loopback, with in-process servers and the
demo model: streamed tokens equal the in-process Generator's, concurrent clients share the
continuous batch, a cancelled (or expired) stream frees its KV blocks, bad requests get
INVALID_ARGUMENT naming the field, admission control refuses with a retry hint, auth,
health and reflection, ``moejax client generate``.

Results are compared with ``Generator.generate`` on the same requests (computed before any
server runs its loop on the same Generator: a Generator runs one call at a time), never
with fixed tokens. Every server here is started and stopped by its test, so that the
Generator's loop is closed again before the next one starts.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from serving import Generator, Scorer
from serving.grpc import Client, decoding, generation, scoring_pb2 as pb, scoring_pb2_grpc
from serving.grpc.server import ScoringServer, ServerOptions

MODEL = os.environ.get("MOEJAX_GRPC_TEST_MODEL", "demo")
T = 60  # seconds: the timeout of every RPC and wait in these tests
pytestmark = pytest.mark.timeout(240)

REQUESTS = [
    {"id": "a", "prompt": "def add(a, b):", "max_new_tokens": 8},
    {"id": 7, "prompt_token_ids": [5, 6, 7, 8, 9], "max_new_tokens": 5, "stop_token_ids": []},
    {"prompt": "12 + 30 =", "max_new_tokens": 6},
    {"id": "sampled", "prompt": "The licence", "max_new_tokens": 6, "temperature": 0.8,
     "top_p": 0.9, "seed": 3},
    {"id": "bad", "prompt": "x", "temperature": -1},
    {"prompt": ""},
    {"prompt": "hi", "prompt_token_ids": [1]},
]
LONG = 60  # prompt tokens of the long-running streams (4 KV blocks of 16)


@pytest.fixture(scope="module")
def scorer() -> Scorer:
    return Scorer(MODEL, max_batch_tokens=32, calibrate=False)


@pytest.fixture(scope="module")
def generator() -> Generator:
    return Generator(MODEL, dtype="float32", compilation_cache="off")


@pytest.fixture(scope="module")
def reference(generator) -> list:
    """Generator.generate of REQUESTS, plus one request that ends on a stop token (its
    stop token: the third token the model generates greedily for REQUESTS[0])."""
    results = generator.generate(REQUESTS)
    stop = {"id": "stops", "prompt": REQUESTS[0]["prompt"], "max_new_tokens": 8,
            "stop_token_ids": [results[0].token_ids[2]]}
    return [*results, stop, generator.generate([stop])[0]]


@pytest.fixture(scope="module")
def medium(generator) -> tuple[dict, object]:
    """A request of 200 tokens and its in-process result."""
    request = {"id": "medium", "prompt_token_ids": [3, 1, 4, 1, 5, 9, 2, 6],
               "max_new_tokens": 200, "stop_token_ids": []}
    return request, generator.generate([request])[0]


def long_request(**fields) -> dict:
    """A request that runs until it is cancelled (it fills the model's context)."""
    return {"prompt_token_ids": list(range(1, LONG + 1)), "stop_token_ids": [],
            "max_new_tokens": 2048 - LONG, **fields}


@contextlib.contextmanager
def running(scorer, generator=None, **options):
    """A started server on a free loopback port, attached to ``scorer`` (and
    ``generator``), stopped at the end (which closes the generator's loop)."""
    server = ScoringServer(ServerOptions(port=0, grace_seconds=5, **options))
    port = server.start()
    try:
        if scorer is not None:
            server.attach(scorer, generator)
        yield server, f"127.0.0.1:{port}"
    finally:
        server.stop(2)


def stub(target: str) -> scoring_pb2_grpc.GenerationStub:
    return scoring_pb2_grpc.GenerationStub(grpc.insecure_channel(target))


def to_proto(request: dict) -> pb.GenerateRequest:
    from serving.grpc.convert import generation_request_to_proto

    return generation_request_to_proto(request)


def wait_until(predicate, timeout: float = T) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def the_sequence(server: ScoringServer):
    """The scheduler's state of the server's only generation stream (to tell, once it has
    ended, whether it was cancelled or ran to its end)."""
    assert wait_until(lambda: len(server.generation.active) == 1 and
                      next(iter(server.generation.active)).handle is not None)
    return next(iter(server.generation.active)).handle.sequence


def assert_cancelled(sequence) -> None:
    assert sequence.finished and sequence.output.finish_reason == "cancelled"
    assert len(sequence.output.token_ids) < sequence.spec.max_new_tokens


def health_status(target: str, service: str) -> str:
    response = health_pb2_grpc.HealthStub(grpc.insecure_channel(target)).Check(
        health_pb2.HealthCheckRequest(service=service), timeout=T)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


# =========================================================================== tokens
def test_streamed_tokens_equal_the_generator_for_concurrent_clients(scorer, generator,
                                                                   reference):
    requests, expected = REQUESTS + [reference[-2]], reference[:-2] + [reference[-1]]
    assert expected[-1].finish_reason == "stop" and expected[0].finish_reason == "length"
    outcomes: dict[int, list] = {}

    def client_thread(k: int) -> None:
        with Client(target) as client:
            outcomes[k] = client.generate(requests, timeout=T, max_concurrency=3 + k)

    with running(scorer, generator) as (server, target):
        threads = [threading.Thread(target=client_thread, args=(k,)) for k in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(T)
        assert sorted(outcomes) == [0, 1, 2, 3]
        for results in outcomes.values():
            assert results == expected
        assert expected[4].error == "request 'bad': temperature: must be >= 0 (0 = greedy), " \
                                    "got -1.0"
        assert expected[5].error == "request #5: prompt: is empty"  # named by its position
        # One stream: the tokens of its messages are the result's, in order.
        with Client(target) as client:
            events = list(client.generate_stream(requests[-1], timeout=T))
            assert events[-1].result == expected[-1]
            assert [t for e in events for t in e.token_ids] == expected[-1].token_ids
            assert all(e.result is None and e.token_ids for e in events[:-1])
            [bad] = list(client.generate_stream({"id": "bad", "prompt": "x",
                                                 "temperature": -1}, timeout=T))
            assert bad.result == expected[4]
        assert wait_until(lambda: server.stats()["generation_streams"] == 0)
        assert server.generation.loop.occupancy() == 0


def test_the_last_message_carries_finish_reason_text_and_id(scorer, generator, reference):
    stop_request, stopped = reference[-2], reference[-1]
    with running(scorer, generator) as (_, target):
        messages = list(stub(target).Generate(to_proto(stop_request), timeout=T))
        *firsts, last = messages
        for message in firsts:
            assert len(message.token_ids) >= 1 and not message.HasField("finish_reason")
            assert message.WhichOneof("id") is None and not message.HasField("text")
        assert (last.finish_reason, last.text, last.string_id, last.prompt_tokens) == (
            "stop", stopped.text, "stops", stopped.prompt_tokens)
        assert [t for m in messages for t in m.token_ids] == stopped.token_ids
        # The text leaves the stop token out; an int id comes back as an int.
        [*_, last] = stub(target).Generate(to_proto(REQUESTS[1]), timeout=T)
        assert (last.finish_reason, last.int_id, last.text) == ("length", 7, reference[1].text)


# =========================================================================== cancel, deadline
def test_a_cancelled_stream_frees_its_blocks(scorer, generator):
    with running(scorer, generator) as (server, target):
        loop = server.generation.loop
        before = loop.occupancy()
        call = stub(target).Generate(to_proto(long_request(id="long")), timeout=T)
        first = next(call)
        assert len(first.token_ids) >= 1
        sequence = the_sequence(server)
        assert loop.occupancy() > before  # its prompt's blocks, at least
        assert server.stats()["generation_streams"] == 1
        call.cancel()
        with pytest.raises(grpc.RpcError) as info:
            next(call)
        assert info.value.code() == grpc.StatusCode.CANCELLED
        assert wait_until(lambda: loop.occupancy() == before)
        assert wait_until(lambda: server.stats()["generation_streams"] == 0)
        assert_cancelled(sequence)
        # The client's stream: leaving it early cancels the call.
        with Client(target) as client:
            events = client.generate_stream(long_request(), timeout=T)
            assert next(events).token_ids
            sequence = the_sequence(server)
            assert loop.occupancy() > before
            events.close()
        assert wait_until(lambda: loop.occupancy() == before)
        assert_cancelled(sequence)
        # A client that goes away (its channel closed) mid-stream.
        channel = grpc.insecure_channel(target)
        call = scoring_pb2_grpc.GenerationStub(channel).Generate(to_proto(long_request()),
                                                                 timeout=T)
        assert next(call).token_ids
        sequence = the_sequence(server)
        channel.close()
        assert wait_until(lambda: loop.occupancy() == before)
        assert wait_until(lambda: server.stats()["generation_streams"] == 0)
        assert_cancelled(sequence)


def test_a_stream_past_its_deadline_ends_deadline_exceeded_and_frees_its_blocks(
        scorer, generator):
    with running(scorer, generator) as (server, target):
        loop = server.generation.loop
        before = loop.occupancy()
        received = []
        call = stub(target).Generate(to_proto(long_request()), timeout=2.0)
        sequence = the_sequence(server)
        with pytest.raises(grpc.RpcError) as info:
            for message in call:
                received.extend(message.token_ids)
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert len(received) < 2048 - LONG
        assert wait_until(lambda: loop.occupancy() == before)
        assert wait_until(lambda: server.stats()["generation_streams"] == 0)
        assert_cancelled(sequence)


# =========================================================================== bad input
BAD = [  # (request, the exact message)
    ({"id": "r1", "prompt": "x", "temperature": -1},
     "request 'r1': temperature: must be >= 0 (0 = greedy), got -1.0"),
    ({"prompt": ""}, "request #0: prompt: is empty"),
    ({"id": 5, "prompt": "hi", "prompt_token_ids": [1]},
     "request '5': prompt: give exactly one of prompt or prompt_token_ids (got both)"),
    ({"max_new_tokens": 4}, "request #0: prompt: give exactly one of prompt or "
                            "prompt_token_ids (got neither)"),
    ({"prompt_token_ids": []}, "request #0: prompt_token_ids: is empty"),
    ({"prompt": "x", "top_p": 1.5}, "request #0: top_p: must lie in (0, 1], got 1.5"),
    ({"prompt": "x", "max_new_tokens": 0}, "request #0: max_new_tokens: must be >= 1, got 0"),
]


def test_invalid_requests_get_invalid_argument_naming_the_field(scorer, generator):
    vocab = generator.config.vocab_size
    cases = BAD + [
        ({"prompt_token_ids": [1, vocab]},
         f"request #0: prompt_token_ids[1]: must be in [0, {vocab}), got {vocab}"),
        ({"prompt": "x", "stop_token_ids": [-1]},
         f"request #0: stop_token_ids[0]: must be in [0, {vocab}), got -1"),
        ({"prompt_token_ids": [1] * 10, "max_new_tokens": 2040},
         "request #0: max_new_tokens: prompt (10 tokens) + max_new_tokens (2040) = 2050, "
         "more than the model's context (2048)"),
    ]
    with running(scorer, generator) as (server, target):
        generate = stub(target).Generate
        for request, expected in cases:
            with pytest.raises(grpc.RpcError) as info:
                list(generate(to_proto(request), timeout=T))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert info.value.details() == expected
        # Size limits apply before tokenizing; text that is not UTF-8 is named too.
        limit = scorer.info["limits"]["max_text_bytes"]
        with pytest.raises(grpc.RpcError) as info:
            list(generate(to_proto({"id": "big", "prompt": "w" * (limit + 1)}), timeout=T))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details() == (f"request 'big': prompt: {limit + 1} UTF-8 bytes, over "
                                        f"the server's limit of {limit} (max_text_bytes)")
        lenient = decoding.lenient_class(pb.GenerateRequest)(prompt=b"caf\xe9", string_id=b"u")
        raw = grpc.insecure_channel(target).unary_stream(
            "/moejax.v1.Generation/Generate", request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=pb.GenerateResponse.FromString)
        with pytest.raises(grpc.RpcError) as info:
            list(raw(lenient, timeout=T))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert info.value.details() == "request 'u': prompt: is not valid UTF-8 (invalid at byte 3)"
        assert server.stats()["generation_streams"] == 0  # no slot kept by a refused call
    # What a proto cannot carry is refused by the client, naming the field, without a call.
    with Client("127.0.0.1:1") as client:  # nothing listens there
        results = client.generate([{"prompt": "x", "seed": -1}, {"prompt": "x", "seed": 1 << 64},
                                   {"prompt": "x", "temperature": "hot"},
                                   {"prompt": 3}, {"prompt": "x", "max_new_tokens": True},
                                   {"id": 1 << 64, "prompt": "x"}, {"prompt": "x", "colour": 1},
                                   "just text", {"prompt_token_ids": [1, 1 << 70]}], timeout=T)
    assert [r.error for r in results] == [
        "request #0: seed: must be in [0, 18446744073709551616), got -1",
        "request #1: seed: must be in [0, 18446744073709551616), got 18446744073709551616",
        "request #2: temperature: must be a number, got str",
        "request #3: prompt: must be a str, got int",
        "request #4: max_new_tokens: must be an integer, got bool",
        "request '18446744073709551616': id: integer ids must fit in 64 bits (gRPC int64)",
        "request #6: unknown field(s) 'colour' (accepted: id, prompt, prompt_token_ids, "
        "max_new_tokens, temperature, top_p, seed, stop_token_ids, add_special_tokens)",
        "request #7: expected an object (dict), got str",
        f"request #8: prompt_token_ids[1]: does not fit in 64 bits (gRPC int64), got "
        f"{1 << 70}",
    ]


# =========================================================================== admission
def test_admission_refuses_with_a_retry_hint_and_the_client_retries(monkeypatch, scorer,
                                                                    generator, reference):
    monkeypatch.setattr(generation, "MAX_RETRY_MS", 200)  # the client retries every 0.2 s
    with running(scorer, generator, max_generation_streams=1) as (server, target):
        blocker = stub(target).Generate(to_proto(long_request()), timeout=T)
        assert next(blocker).token_ids
        with pytest.raises(grpc.RpcError) as info:
            list(stub(target).Generate(to_proto(REQUESTS[0]), timeout=T))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        hint = dict(info.value.trailing_metadata())["retry-after-ms"]
        assert 0 < int(hint) <= 200 and f"retry after {hint} ms" in info.value.details()
        assert "1 generation streams" in info.value.details()
        outcome: list = []

        def patient_client() -> None:
            with Client(target) as client:
                outcome.append(client.generate(REQUESTS[:1], timeout=T))

        waiting = threading.Thread(target=patient_client)
        waiting.start()
        assert wait_until(lambda: server.stats()["generation_refused"] >= 2)  # it was refused
        blocker.cancel()
        waiting.join(T)
        assert outcome == [[reference[0]]]  # retried after the hint, then served
        with Client(target) as client:
            info = client.info()
        assert (info["generation"], info["max_generation_streams"]) == (True, 1)


# =========================================================================== lifecycle, auth
def test_health_reflection_and_unavailable_until_a_generator_is_attached(scorer, generator,
                                                                         reference):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import \
        ProtoReflectionDescriptorDatabase

    server = ScoringServer(ServerOptions(port=0))
    target = f"127.0.0.1:{server.start()}"
    try:
        assert health_status(target, "moejax.v1.Generation") == "NOT_SERVING"
        with pytest.raises(grpc.RpcError) as info:
            list(stub(target).Generate(to_proto(REQUESTS[0]), timeout=T))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        services = set(ProtoReflectionDescriptorDatabase(grpc.insecure_channel(target))
                       .get_services())
        assert {"moejax.v1.Scoring", "moejax.v1.Generation", "grpc.health.v1.Health"} <= services
        server.attach(scorer, generator)
        assert health_status(target, "moejax.v1.Generation") == "SERVING"
        assert health_status(target, "") == "SERVING"
        with Client(target) as client:
            assert client.generate(REQUESTS[:1], timeout=T) == reference[:1]
    finally:
        server.stop(1)
    # Scoring only: no Generation service at all.
    with running(scorer, generation=False) as (server, target):
        with pytest.raises(grpc.RpcError) as info:
            list(stub(target).Generate(to_proto(REQUESTS[0]), timeout=T))
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
        with Client(target) as client:
            assert client.info()["generation"] is False
            assert client.score([{"prompt": "x", "candidates": [" a"]}], timeout=T)[0].error \
                is None
        assert "moejax.v1.Generation" not in set(
            ProtoReflectionDescriptorDatabase(grpc.insecure_channel(target)).get_services())
        with pytest.raises(ValueError, match="generation=False"):
            server.attach(scorer, generator)


def test_bearer_token_auth_applies_to_generation(scorer, generator, reference):
    with running(scorer, generator, token="s3cret") as (_, target):
        for token in (None, "wrong"):
            with Client(target, token=token) as client:
                with pytest.raises(grpc.RpcError) as info:
                    client.generate(REQUESTS[:1], timeout=T)
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
                with pytest.raises(grpc.RpcError) as info:
                    list(client.generate_stream(REQUESTS[0], timeout=T))
                assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert client.health("moejax.v1.Generation") == "SERVING"  # health is open
        with Client(target, token="s3cret") as client:
            assert client.generate(REQUESTS[:1], timeout=T) == reference[:1]


def test_stop_lets_a_running_stream_finish_then_closes_the_loop(scorer, generator, reference,
                                                                medium):
    request, result = medium
    server = ScoringServer(ServerOptions(port=0, grace_seconds=T))
    target = f"127.0.0.1:{server.start()}"
    server.attach(scorer, generator)
    call = stub(target).Generate(to_proto(request), timeout=T)
    tokens = list(next(call).token_ids)
    stopper = threading.Thread(target=server.stop)
    stopper.start()
    try:
        assert wait_until(lambda: server.generation.stopping)
        with pytest.raises(grpc.RpcError) as info:  # new calls are refused
            list(stub(target).Generate(to_proto(REQUESTS[1]), timeout=T))
        assert info.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
        for message in call:
            tokens.extend(message.token_ids)
        assert tokens == result.token_ids  # finished within the grace period
    finally:
        stopper.join(T)
    assert not stopper.is_alive()
    # A stream still running when the grace period ends is cancelled, and the stop closes
    # the loop with its sequence dropped.
    server = ScoringServer(ServerOptions(port=0))
    target = f"127.0.0.1:{server.start()}"
    server.attach(scorer, generator)
    call = stub(target).Generate(to_proto(long_request()), timeout=T)
    assert next(call).token_ids
    sequence = the_sequence(server)
    server.stop(0.2)
    with pytest.raises(grpc.RpcError) as info:
        list(call)
    assert info.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
    assert_cancelled(sequence)
    assert generator.scheduler.occupancy() == 0 and not generator.scheduler.busy
    # The loop is closed: the Generator runs in process again.
    assert generator.generate(REQUESTS[:1]) == reference[:1]


def test_stop_waits_for_a_finished_sequence_s_last_message(scorer, generator, medium,
                                                           monkeypatch):
    """A stream's sequence leaves the scheduler (its admission slot is free) before its
    handler sends the last message. A stop must wait for the handler, not for the slot
    (before: the server stopped in that gap and the client got UNAVAILABLE "Cancelling all
    calls" instead of its last tokens). The gap is widened here to 1 s."""
    import asyncio

    request, result = medium
    sending = generation.GenerationStream.responses

    async def slow_last_message(self, context):
        async for response in sending(self, context):
            if self.done:                       # the slot is released already
                await asyncio.sleep(1.0)
            yield response

    monkeypatch.setattr(generation.GenerationStream, "responses", slow_last_message)
    server = ScoringServer(ServerOptions(port=0, grace_seconds=T))
    target = f"127.0.0.1:{server.start()}"
    server.attach(scorer, generator)
    call = stub(target).Generate(to_proto(request), timeout=T)
    tokens = list(next(call).token_ids)
    assert wait_until(lambda: server.generation.streams == 0)   # out of the scheduler
    assert server.generation.open_calls == 1
    stopper = threading.Thread(target=server.stop)
    stopper.start()
    try:
        for message in call:
            tokens.extend(message.token_ids)
        assert tokens == result.token_ids
    finally:
        stopper.join(T)
    assert not stopper.is_alive() and server.generation.open_calls == 0


# =========================================================================== CLI
def test_client_generate_cli_round_trip(scorer, generator, reference, tmp_path):
    from serving.cli import main

    lines = [json.dumps(r) for r in REQUESTS[:3]] + ["{not json", ""] + \
            [json.dumps(r) for r in REQUESTS[3:]]
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with running(scorer, generator) as (_, target):
        assert main(["client", "generate", str(source), "--target", target, "-o", str(out),
                     "--timeout", str(T), "--concurrency", "2", "--chunk-size", "3"]) == 0
    written = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    assert len(written) == len(REQUESTS) + 1
    assert written[3]["error"].startswith("line 4: invalid JSON")
    expected = [r.to_dict() for r in reference[:len(REQUESTS)]]
    # Id-less requests are named by their line (the library names them by position).
    expected[5]["error"] = "line 8: prompt: is empty"
    expected[6]["error"] = expected[6]["error"].replace("request #6:", "line 9:")
    assert expected[6]["error"].startswith("line 9: prompt: give exactly one")
    assert written[:3] + written[4:] == expected


def test_serve_generation_flags():
    from serving.cli import build_parser
    from serving.grpc.cli import _generator_options, _serves_generation

    parse = build_parser().parse_args
    assert _serves_generation(parse(["serve"]))
    assert not _serves_generation(parse(["serve", "--no-generation"]))
    assert not _serves_generation(parse(["serve", "--backend", "tp"]))  # with a warning
    with pytest.raises(ValueError, match="backend 'tp' cannot decode"):
        _serves_generation(parse(["serve", "--backend", "tp", "--generation"]))
    args = parse(["serve", "--generation-batch-size", "4", "--max-generation-streams", "9",
                  "--dtype", "float32"])
    assert (args.max_generation_streams, _generator_options(args)["max_batch_size"],
            _generator_options(args)["dtype"]) == (9, 4, "float32")
