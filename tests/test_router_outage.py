"""``moejax router`` when its upstreams go away, and ``moejax score --target`` /
``moejax client score`` behind it (issue 37): a request the router cannot get answered ends
the client's stream with a retryable status (never an error result), a router with no
upstream refuses at once (never after ``--upstream-timeout`` per request),
``--retry-seconds`` stops a run that gets no result, a bad ``--upstream-tls-ca`` is
refused at start, and SIGTERM stops the router without asyncio's "Task was destroyed but
it is pending!".

Upstreams are ``tests.grpc_fakes.FakeUpstream`` (in process, or as a process for the
``kill -9``), the router a real in-process ``RouterServer`` or a ``moejax router``
process; every port is the OS's choice. Waits poll a condition with a bound; nothing
asserts how long anything took.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import grpc
import pytest

from serving.cli import main
from serving.grpc import Client, scoring_pb2 as pb
from serving.grpc.router_core import load_model
from serving.score_progress import load_progress, progress_path
from tests.grpc_fakes import FakeUpstream, comparable, fake_result
from tests.test_grpc_router import proto, router, stub, upstream_options, wait_until
from tests.test_remote_score import expected, start_fake_process, write_input, written

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
T = 60  # seconds: bound on every wait
pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def model() -> Any:
    return load_model("demo")   # config and tokenizer only


def dead_target() -> str:
    """HOST:PORT of a port the OS gave out and nothing listens on now."""
    fake = FakeUpstream()
    fake.start()
    fake.stop()
    return fake.target


def requests_of(n: int) -> list[dict[str, Any]]:
    return [{"id": f"s{i}", "prompt": f"Item {i} is", "candidates": [" good", " bad"]}
            for i in range(n)]


def stream_messages(requests: list[dict[str, Any]]) -> list[pb.StreamRequest]:
    return [pb.StreamRequest(request=proto(r, i), index=i) for i, r in enumerate(requests)]


def run_score_in_thread(*argv: str) -> tuple[threading.Thread, queue.Queue]:
    """``moejax score ARGV`` in this process, on a thread; its exit status comes in the
    queue (signals are left alone off the main thread)."""
    status: queue.Queue = queue.Queue()
    thread = threading.Thread(target=lambda: status.put(main(["score", *argv])), daemon=True)
    thread.start()
    return thread, status


def router_process(*args: str) -> tuple[subprocess.Popen, list[str]]:
    """A ``moejax router`` process (port 0) and the lines of its stderr, as they come."""
    process = subprocess.Popen([sys.executable, "-m", "serving.cli", "router", "--port", "0",
                                *args], cwd=ROOT, env=ENV, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    stderr: list[str] = []
    threading.Thread(target=lambda: stderr.extend(process.stderr), daemon=True).start()
    return process, stderr


def ended(process: subprocess.Popen) -> int:
    try:
        return process.wait(timeout=T)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(T)


# ---------------------------------------------------------------------------- 1. outage
def test_a_lost_upstream_ends_the_stream_retryably_never_with_error_results(model):
    requests = requests_of(8)
    messages = stream_messages(requests)
    five_answered = threading.Event()
    with FakeUpstream() as fake, router(model, [fake.target]) as (server, target):

        def send() -> Any:
            yield from messages[:5]
            assert five_answered.wait(T)
            fake.stop()               # the only upstream goes away mid-stream
            yield from messages[5:]

        answers = []
        with pytest.raises(grpc.RpcError) as failed:
            for answer in stub(target).ScoreStream(send(), timeout=T):
                answers.append(answer)
                if len(answers) == 5:
                    five_answered.set()
    # The call ends with a status the client retries on, saying why ...
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    details = failed.value.details()
    assert (f"upstream 0 ({fake.target}) failed: " in details
            or "no upstream is serving" in details)      # (failed, or seen gone first)
    assert details.endswith("were not scored: send them again")
    # ... and what was answered before it stays answered: real results, each once; the
    # three requests after it got no result at all (no error result).
    assert sorted(a.index for a in answers) == [0, 1, 2, 3, 4]
    for answer in answers:
        assert answer.result.error == ""
        assert comparable(answer.result) == comparable(
            fake_result(proto(requests[answer.index], answer.index), answer.index))


def test_a_refused_stream_first_delivers_what_other_upstreams_owe(model):
    requests = requests_of(6)
    slow, refusing = FakeUpstream(delay=0.3), FakeUpstream()
    with slow, refusing, router(model, [slow.target, refusing.target],
                                routing="round_robin") as (server, target):
        # Request 0 goes to the slow upstream, request 1 to one that refuses the router's
        # stream (not worth a retry elsewhere): the call ends with that refusal, but only
        # after the slow upstream answered what it had been sent. The refusal comes after
        # the router's last write to it (drain): one crossing a write reaches the router as
        # INTERNAL (grpc/grpc#36066), which it retries elsewhere instead.
        refusing.fail_next(1, grpc.StatusCode.PERMISSION_DENIED, "fake: not allowed",
                           drain=True)
        answers = []
        with pytest.raises(grpc.RpcError) as failed:
            for answer in stub(target).ScoreStream(iter(stream_messages(requests)),
                                                   timeout=T):
                answers.append(answer)
    assert failed.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert f"upstream 1 ({refusing.target}) failed: PERMISSION_DENIED: fake: not allowed" \
        in failed.value.details()
    indices = [a.index for a in answers]
    assert 0 in indices and len(indices) == len(set(indices))
    for answer in answers:
        assert answer.result.error == "" and list(answer.result.timings.engines) == [0]
        assert comparable(answer.result) == comparable(
            fake_result(proto(requests[answer.index], answer.index), answer.index))


def test_upstream_killed_and_restarted_mid_job_every_line_scored_once(model, tmp_path,
                                                                      capsys):
    inp = write_input(tmp_path / "in.jsonl", 300)
    out, reference = str(tmp_path / "out.jsonl"), str(tmp_path / "reference.jsonl")
    process, upstream_target = start_fake_process("--delay", "0.01")  # ~3 s of scoring
    # The restarted upstream: a fake in this process on the same port (it starts at once,
    # where a process would take seconds to import on a busy machine).
    restarted = FakeUpstream(int(upstream_target.rsplit(":", 1)[1]), delay=0.001)
    try:
        with router(model, [upstream_target]) as (server, target):
            thread, status = run_score_in_thread(inp, "-o", out, "--target", target,
                                                 "--concurrency", "8", "--no-progress")
            record = wait_until(lambda: _progress(out), "the job to write some results")
            assert not record["complete"], "the job ended before the upstream was killed"
            process.send_signal(signal.SIGKILL)            # kill -9, requests in flight
            process.wait(T)
            wait_until(lambda: not server.upstream_states()[0]["serving"],
                       "the router to see its upstream gone")
            time.sleep(1.0)   # an outage: the job's streams are refused meanwhile
            restarted.start()
            assert status.get(timeout=T) == 0
            thread.join(T)
            err = capsys.readouterr().err
            # The same job, uninterrupted, through the same router.
            assert main(["score", inp, "-o", reference, "--target", target,
                         "--no-progress"]) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(T)
        restarted.stop()
    assert "not scored" not in err
    final = load_progress(progress_path(out))
    assert final["complete"] and final["lines_done"] == len(expected(inp))
    assert written(out) == written(reference) == expected(inp)   # each line once, scored


def _progress(out: str) -> dict[str, Any] | None:
    try:
        record = load_progress(progress_path(out))
    except Exception:  # noqa: BLE001  (not written yet, or read while being replaced)
        return None
    return record if record is not None and record["lines_done"] > 0 else None


# ---------------------------------------------------------------------------- 2. no upstream
@pytest.fixture
def router_without_upstreams(model):
    """A router whose one upstream is down, with an upstream timeout longer than any wait
    below: whatever waits for it instead of refusing shows as a timeout."""
    with router(model, [dead_target()], serving=False, check_seconds=0.5,
                upstream=upstream_options(timeout=100.0)) as (server, target):
        yield target


def test_with_no_upstream_a_stream_is_refused_at_once_as_score_is(router_without_upstreams):
    target = router_without_upstreams
    requests = requests_of(6)
    with pytest.raises(grpc.RpcError) as refused:
        stub(target).Score(proto(requests[0]), timeout=T)
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    with pytest.raises(grpc.RpcError) as failed:
        list(stub(target).ScoreStream(iter(stream_messages(requests)), timeout=20))
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE   # not DEADLINE_EXCEEDED
    assert "no upstream is serving" in failed.value.details()
    with Client(target) as client, pytest.raises(grpc.RpcError) as raised:
        client.score(requests, timeout=20)
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE


def test_client_score_through_a_router_with_no_upstream_fails(router_without_upstreams,
                                                              tmp_path, capsys):
    inp = write_input(tmp_path / "in.jsonl", 6, bad=False)
    out = str(tmp_path / "out.jsonl")
    assert main(["client", "score", inp, "-o", out, "--target", router_without_upstreams,
                 "--timeout", "20", "--no-progress"]) == 1
    assert "UNAVAILABLE: no upstream is serving" in capsys.readouterr().err


def test_score_target_stops_after_retry_seconds_with_no_upstream(router_without_upstreams,
                                                                 tmp_path, capsys):
    inp = write_input(tmp_path / "in.jsonl", 50)
    out = str(tmp_path / "out.jsonl")
    assert main(["score", inp, "-o", out, "--target", router_without_upstreams,
                 "--retry-seconds", "1", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "stopped: no result from" in err and "--retry-seconds 1" in err
    assert "no upstream is serving" in err
    record = load_progress(progress_path(out))
    assert record["lines_done"] == 0 and not record["complete"]


def test_retry_seconds_stops_a_run_the_server_never_answers(tmp_path, capsys):
    inp = write_input(tmp_path / "in.jsonl", 50)
    out = str(tmp_path / "out.jsonl")
    with FakeUpstream() as fake:
        fake.hang_next(1000)   # every call is taken and never answered (no failure)
        assert main(["score", inp, "-o", out, "--target", fake.target,
                     "--retry-seconds", "1", "--no-progress"]) == 1
        assert fake.requests == []
    err = capsys.readouterr().err
    assert "stopped: no result from" in err and "(--retry-seconds 1)" in err
    assert "answered none" in err
    record = load_progress(progress_path(out))
    assert record["lines_done"] == 0 and not record["complete"]
    assert os.path.getsize(out) == 0


# ---------------------------------------------------------------------------- 3. TLS CA
def test_a_ca_file_without_a_certificate_stops_the_router_with_exit_2(tmp_path):
    ca = tmp_path / "notpem.pem"
    ca.write_text("hello, not a certificate\n")
    process, stderr = router_process("--upstream", dead_target(), "--upstream-tls-ca",
                                     str(ca))
    assert ended(process) == 2
    message = "".join(stderr)
    assert message.startswith(f"moejax router: error: --upstream-tls-ca {ca}: not a PEM "
                              f"certificate")


@pytest.mark.parametrize("content, problem", [
    (b"-----BEGIN CERTIFICATE-----\nbm90IGEgY2VydA==\n-----END CERTIFICATE-----\n",
     "not a valid PEM certificate"),
    (b"\x30\x82\x01\x0a\xff", "not a PEM file"),
    (b"", "not a PEM certificate")])
def test_every_kind_of_bad_ca_file_is_named(tmp_path, capsys, content, problem):
    ca = tmp_path / "ca.pem"
    ca.write_bytes(content)
    assert main(["router", "--upstream", dead_target(), "--port", "0",
                 "--upstream-tls-ca", str(ca)]) == 2
    assert capsys.readouterr().err.startswith(
        f"moejax router: error: --upstream-tls-ca {ca}: {problem}")
    # The same check guards every client channel (moejax score --target, Client).
    with pytest.raises(ValueError, match=f"TLS CA {ca}: {problem}"):
        Client("127.0.0.1:1", tls_ca=str(ca))


# ---------------------------------------------------------------------------- 4. SIGTERM
def test_sigterm_stops_the_router_without_pending_tasks():
    with FakeUpstream() as fake:
        # One upstream never answers its ModelInfo wait (down), one serves and holds a
        # stream open at the signal.
        process, stderr = router_process("--upstream", f"{dead_target()},{fake.target}",
                                         "--startup-timeout", "0.5", "--health-interval",
                                         "0.1", "--grace-seconds", "0.5")
        try:
            port = int(process.stdout.readline())
            wait_until(lambda: any("no ModelInfo yet" in line for line in stderr),
                       "the start-up wait to end")
            fake.hang_next(1)
            call = stub(f"127.0.0.1:{port}").ScoreStream(
                iter(stream_messages(requests_of(2))), timeout=T)
            wait_until(lambda: fake.hanging == 1, "a stream in flight upstream")
            process.send_signal(signal.SIGTERM)
            assert ended(process) == 0, "".join(stderr)
        finally:
            if process.poll() is None:
                process.kill()
        with pytest.raises(grpc.RpcError):
            list(call)
    assert "Task was destroyed but it is pending" not in "".join(stderr)
    assert "router stopped" in "".join(stderr)
