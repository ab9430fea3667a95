"""Issue 37, round two, for long jobs: nothing that fails is reported as done.

* The progress file of ``moejax score --target`` (serving.score_progress) is checked before
  it is trusted: each field's type and range, its offsets against the input and output,
  ``"complete"`` only when no input line is left; and no run is recorded as complete while
  input lines are left without a result.
* ``moejax score``'s exit codes: every result an error, ``--fail-on-errors``.
* The multi-process options: a coordinator address is checked, an unreachable one is
  given up on within ``--coordinator-timeout``; a lost peer process is fatal at once, not
  a result line per request; ``moejax launch`` shows process 0's summary only.
* ``-v`` after the command; ``moejax --help``'s description.

The upstream of the ``--target`` runs is ``tests.grpc_fakes.FakeUpstream`` in this process
(a real gRPC server on a loopback port the OS picks).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from serving.cli import main
from serving.score_progress import (IncompleteRun, input_lines, load_progress, progress_path,
                                    write_progress)
from tests.grpc_fakes import FakeUpstream
from tests.test_remote_score import expected, write_input, written

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(120)


def score(*argv: str) -> int:
    return main(["score", *argv])


@pytest.fixture(scope="module")
def fake():
    with FakeUpstream() as upstream:
        yield upstream


# ----------------------------------------------------------------------------- progress file
N = 40          # input lines (no blank ones: line k is result k)
DONE = 15       # results the partial progress records


def partial_job(tmp_path: Path, fake: FakeUpstream) -> tuple[str, str, dict[str, Any]]:
    """(input, output, record): a finished run's files, with the progress file rewritten
    as a run stopped after DONE results would have left it (the output still holds all N
    lines: a resume truncates it to output_offset)."""
    inp = write_input(tmp_path / "in.jsonl", N, bad=False)
    out = str(tmp_path / "out.jsonl")
    assert score(inp, "-o", out, "--target", fake.target) == 0
    with open(inp, "rb") as fh:
        in_lines = fh.readlines()
    with open(out, "rb") as fh:
        out_lines = fh.readlines()
    record = load_progress(progress_path(out))
    record.update(complete=False, lines_done=DONE, input_line=DONE, errors=0,
                  input_offset=sum(map(len, in_lines[:DONE])),
                  output_offset=sum(map(len, out_lines[:DONE])))
    save(out, record)
    return inp, out, record


def save(out: str, record: dict[str, Any]) -> None:
    with open(progress_path(out), "w", encoding="utf-8") as fh:
        json.dump(record, fh)


def test_a_partial_progress_file_resumes_to_the_full_output(tmp_path, fake, capsys):
    """The baseline the refusals below are measured against: the rewritten record is a
    valid one, and resuming from it writes every line once."""
    inp, out, _ = partial_job(tmp_path, fake)
    capsys.readouterr()
    assert score(inp, "-o", out, "--target", fake.target) == 0
    assert f"resumed after {DONE} results already written" in capsys.readouterr().err
    assert written(out) == expected(inp)


@pytest.mark.parametrize("field, value, message", [
    ("input_line", None, "input_line must be an integer >= 0, got None"),
    ("input_offset", -3, "input_offset must be an integer >= 0, got -3"),
    ("output_offset", -1, "output_offset must be an integer >= 0, got -1"),
    ("lines_done", True, "lines_done must be an integer >= 0, got True"),
    ("lines_done", "15", "lines_done must be an integer >= 0, got '15'"),
    ("errors", 99, "errors must be an integer from 0 to lines_done (15), got 99"),
    ("complete", "yes", "complete must be true or false, got 'yes'"),
    ("input_line", 3, "input_line 3 is before the 15 lines"),
    ("input_offset", 10 ** 9, "input_offset 1000000000 is past the end of the input"),
    ("input", "in.jsonl", "input must be an object, got 'in.jsonl'"),
])
def test_a_malformed_field_is_refused_naming_the_file_and_the_field(tmp_path, fake, capsys,
                                                                    field, value, message):
    """Before: input_line null ended the input in gRPC's sending thread (a swallowed
    TypeError) and the run exited 0 marked complete with the results missing; negative
    offsets gave a bare [Errno 22]."""
    inp, out, record = partial_job(tmp_path, fake)
    save(out, dict(record, **{field: value}))
    before = open(out, "rb").read()
    capsys.readouterr()
    assert score(inp, "-o", out, "--target", fake.target) == 2
    err = capsys.readouterr().err
    assert f"moejax: error: progress file {progress_path(out)}: {message}" in err, err
    assert open(out, "rb").read() == before                  # nothing truncated or written


@pytest.mark.parametrize("field, shift, message", [
    ("output_offset", -7, "output_offset {value} is not at the end of a line of"),
    ("input_offset", 5, "input_offset {value} is not at the end of a line of"),
    ("input_line", 1, "input_line is 16, but"),
    ("lines_done", -1, "lines_done is 14, but"),
])
def test_offsets_that_disagree_with_the_files_are_refused(tmp_path, fake, capsys, field,
                                                         shift, message):
    """Before: an output_offset 7 bytes short cut a result line, and the resume wrote the
    rest after the cut (a broken JSON line), exit 0."""
    inp, out, record = partial_job(tmp_path, fake)
    value = record[field] + shift
    save(out, dict(record, **{field: value}))
    capsys.readouterr()
    assert score(inp, "-o", out, "--target", fake.target) == 2
    err = capsys.readouterr().err
    assert f"progress file {progress_path(out)}: " + message.format(value=value) in err, err


def test_complete_on_a_partial_file_is_not_trusted(tmp_path, fake, capsys, caplog):
    """Before: "complete": true added to a partial record printed "already complete" and
    exited 0 with 25 results missing. Now the run resumes and writes them."""
    inp, out, record = partial_job(tmp_path, fake)
    save(out, dict(record, complete=True))
    capsys.readouterr()
    assert score(inp, "-o", out, "--target", fake.target) == 0
    assert "already complete" not in capsys.readouterr().err
    assert "says complete, but" in caplog.text and "resuming from there" in caplog.text
    assert written(out) == expected(inp)
    assert load_progress(progress_path(out))["complete"]
    capsys.readouterr()
    assert score(inp, "-o", out, "--target", fake.target) == 0   # now truly complete
    assert "already complete: 40 results" in capsys.readouterr().err


def test_a_run_with_lines_left_is_never_recorded_complete(tmp_path):
    """write_progress is where every run is marked complete: with an input line left past
    the recorded offset (a failure swallowed on the way, as the request-iterator thread's
    TypeError was) it records the run as not complete and raises IncompleteRun, which
    the command reports as exit 1. Blank lines left over are no lines to answer."""
    inp = write_input(tmp_path / "in.jsonl", 3, bad=False)
    with open(inp, "ab") as fh:
        fh.write(b"\n  \n")
    progress = str(tmp_path / "out.jsonl.progress")
    from serving.score_progress import new_record

    record = dict(new_record(inp, str(tmp_path / "out.jsonl"), "t"), complete=True)
    with pytest.raises(IncompleteRun, match="has more at byte 0 with no result"):
        write_progress(progress, record)
    with open(progress) as fh:
        assert json.load(fh)["complete"] is False
    with open(inp, "rb") as fh:
        first_three = sum(len(fh.readline()) for _ in range(3))
    record.update(complete=True, input_offset=first_three, input_line=3, lines_done=3)
    write_progress(progress, record)                     # only blank lines left: complete
    with open(progress) as fh:
        assert json.load(fh)["complete"] is True


def test_input_lines_checks_its_arguments_on_the_callers_thread(tmp_path):
    """Before: input_lines was a generator, so a None start line raised a TypeError only
    when gRPC's sending thread read the first line, where it was swallowed."""
    inp = write_input(tmp_path / "in.jsonl", 3, bad=False)
    with open(inp, "rb") as fh:
        with pytest.raises(ValueError, match="start_line must be an integer >= 0, got None"):
            input_lines(fh, None, 0, 1 << 20)
        with pytest.raises(ValueError, match="the input is at byte 0, not at start_offset 9"):
            input_lines(fh, 1, 9, 1 << 20)
        assert [line.number for line, _ in input_lines(fh, 0, 0, 1 << 20)] == [1, 2, 3]


# ----------------------------------------------------------------------------- exit codes
def test_a_run_whose_every_result_is_an_error_exits_3(tmp_path, monkeypatch, capsys):
    """Before: ``echo '{"prompt":""}' | moejax score -`` exited 0. Mixed results exit 0,
    unless --fail-on-errors."""
    import io

    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b'{"prompt": ""}\n')))
    assert main(["score", "-"]) == 3
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [row["error"] for row in rows] == ["line 1: prompt: is empty"]   # still written

    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text(json.dumps({"id": "ok", "prompt": "1 + 1 =", "candidates": [" 2", " 3"]})
                     + "\nnot json\n")
    assert score(str(mixed), "-o", str(tmp_path / "a.jsonl")) == 0
    assert score(str(mixed), "-o", str(tmp_path / "b.jsonl"), "--fail-on-errors") == 3
    assert [row["error"] is None for row in written(str(tmp_path / "b.jsonl"))] == [True, False]
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    assert score(str(empty), "-o", str(tmp_path / "c.jsonl"), "--fail-on-errors") == 0


def test_target_runs_follow_the_same_exit_codes(tmp_path, fake):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": ""}\nnot json\n')
    assert score(str(bad), "-o", str(tmp_path / "bad.out"), "--target", fake.target) == 3
    assert score(str(bad), "-o", str(tmp_path / "bad.out"), "--target", fake.target) == 3
    mixed = write_input(tmp_path / "mixed.jsonl", 10)   # line 6 is not JSON
    out = str(tmp_path / "mixed.out")
    assert score(mixed, "-o", out, "--target", fake.target) == 0
    assert score(mixed, "-o", out, "--target", fake.target, "--fail-on-errors") == 3


def test_score_help_lists_the_exit_codes(capsys):
    with pytest.raises(SystemExit) as done:
        main(["score", "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert "exit codes:" in text and "--fail-on-errors" in text
    for code in ("0 ", "1 ", "2 ", "3 ", "130 ", "141 "):
        assert f"\n  {code}" in text, code


# ----------------------------------------------------------------------------- CLI papercuts
def test_verbose_is_accepted_after_the_command():
    """Before: ``moejax score -v ...`` was "unrecognized arguments: -v"."""
    from serving.cli import build_parser

    parser = build_parser()
    assert parser.parse_args(["score", "-v", "in.jsonl"]).verbose is True
    assert parser.parse_args(["score", "in.jsonl", "--verbose"]).verbose is True
    assert parser.parse_args(["-v", "score", "in.jsonl"]).verbose is True
    assert parser.parse_args(["score", "in.jsonl"]).verbose is False
    assert parser.parse_args(["client", "score", "in.jsonl", "--target", "h:1", "-v"]).verbose


def test_top_level_help_describes_moejax(capsys):
    """Before: ``moejax --help`` showed the module docstring's first line, "The ``moejax``
    command line (console script ``moejax = serving.cli:main``)"."""
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    assert "console script" not in text and "``" not in text
    assert "Mixture-of-Experts" in text and "moejax COMMAND --help" in text


# ----------------------------------------------------------------------------- coordinator
@pytest.mark.parametrize("address, message", [
    ("[::1]:99999", "port 99999 is not in 1..65535"),
    ("127.0.0.1:0", "port 0 is not in 1..65535"),
    ("300.1.1.1:8476", "300.1.1.1 is not an IPv4 address"),
    ("[fe80::zz]:8476", "[fe80::zz] is not an IPv6 address"),
    ("bad host:8476", "'bad host' is not a host name"),
    ("::1:8476", "must be HOST:PORT"),
])
def test_a_bad_coordinator_address_is_refused_at_once(address, message, capsys):
    """Before: ``--coordinator [::1]:99999`` or ``127.0.0.1:0`` hung for over a minute."""
    with pytest.raises(SystemExit) as done:
        main(["score", "in.jsonl", "--coordinator", address, "--num-processes", "2",
              "--process-id", "1", "--devices", "2"])
    assert done.value.code == 2
    assert f"argument --coordinator: {address!r}: {message}" in capsys.readouterr().err


@pytest.mark.parametrize("address", ["127.0.0.1:8476", "[::1]:1", "node-0.moejax:65535",
                                     "localhost:8476"])
def test_good_coordinator_addresses_pass(address):
    from moejax.distributed import coordinator_problem

    assert coordinator_problem(address) is None


def child_env() -> dict[str, str]:
    """This test process's environment for a child moejax, without the host-device count
    (the child sets its own)."""
    from tests.test_multi_process import child_env as multi_process_env

    return dict(multi_process_env(), JAX_PLATFORMS="cpu")


def test_an_unreachable_coordinator_is_given_up_on_with_a_message(tmp_path):
    """Before: a worker whose coordinator does not answer waited 300 s silently (then JAX
    aborted it with a C++ stack trace). Now it says what it waits for, and gives up after
    --coordinator-timeout with a message and exit 1."""
    from serving.launch import free_port

    requests = tmp_path / "in.jsonl"
    requests.write_text('{"prompt": "a", "candidates": [" b"]}\n')
    port = free_port()   # free now: nobody listens there
    done = subprocess.run(
        [sys.executable, "-m", "serving.cli", "score", str(requests), "--devices", "2",
         "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", "1",
         "--coordinator-timeout", "2"],
        cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=90)
    assert done.returncode == 1, done.stderr[-2000:]
    where = f"coordinator 127.0.0.1:{port} as process 1 of 2"
    assert f"moejax: joining {where} (giving up after 2s, --coordinator-timeout)" \
        in done.stderr
    assert (f"moejax: error: could not join {where}: the coordinator did not answer within "
            f"2s (--coordinator-timeout); last attempt: Connection refused") in done.stderr
    assert "Check failure stack trace" not in done.stderr and done.stdout == ""


# ----------------------------------------------------------------------------- a lost process
# What process 0 of ``moejax launch --processes 2 -- moejax score ... --backend async_ep``
# got from XLA when process 1 was killed (copied from a real run).
GLOO_LOST_PEER = ("INTERNAL: Error dispatching computation: Gloo AllGather failed: "
                  "[external/gloo/gloo/transport/tcp/pair.cc:538] Read error "
                  "[127.0.0.1]:61149: Connection reset by peer")


def test_a_failed_collective_is_told_from_a_batchs_own_failure():
    import jax

    from serving.multi_process import CollectiveFailure, is_collective_failure

    assert is_collective_failure(jax.errors.JaxRuntimeError(GLOO_LOST_PEER))
    assert is_collective_failure(jax.errors.JaxRuntimeError(
        "INTERNAL: NCCL operation ncclAllGather(...) failed: remote process exited"))
    assert is_collective_failure(CollectiveFailure("lost"))
    assert not is_collective_failure(jax.errors.JaxRuntimeError(
        "RESOURCE_EXHAUSTED: Out of memory allocating 1073741824 bytes"))
    assert not is_collective_failure(RuntimeError(GLOO_LOST_PEER))   # not XLA's error
    assert not is_collective_failure(ValueError("Gloo AllGather failed"))


def test_a_lost_process_fails_the_batch_instead_of_answering_each_request():
    """Before: process 0 wrote a result ``scoring failed (JaxRuntimeError: ... Gloo
    AllGather failed ...)`` for each of 32,160 requests, then aborted 22 s later. Now
    combine_results (where every failed step's requests get their results) raises, so no
    request is answered with a failure that is not its own; a batch's own failure still
    gives its requests error results."""
    import jax
    import numpy as np

    from moejax.ops import OpKey, PrefillOp
    from serving.multi_process import CollectiveFailure
    from serving.requests import OpOutput
    from serving.results import combine_results

    requests = [{"id": f"r{i}", "prompt": "a", "candidate_token_ids": [[1], [2]]}
                for i in range(2)]
    ops = [PrefillOp(key=OpKey(i, -1), token_ids=np.array([3, 4], np.int32),
                     score_positions=(1,), score_token_ids=((1, 2),)) for i in range(2)]
    good = OpOutput(logits=[np.array([0.0, -1.0])], logsumexp=None)
    lost = jax.errors.JaxRuntimeError(GLOO_LOST_PEER)
    with pytest.raises(CollectiveFailure, match="Gloo AllGather failed") as raised:
        combine_results(requests, ops, [good, lost], {}, {0: 2, 1: 2})
    assert raised.value.__cause__ is lost
    own = jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory")
    results = combine_results(requests, ops, [good, own], {}, {0: 2, 1: 2})
    assert results[0].error is None
    assert results[1].error == ("request 'r1': scoring failed (JaxRuntimeError: "
                                "RESOURCE_EXHAUSTED: Out of memory)")


# ----------------------------------------------------------------------------- launch output
CHILD = """
import sys
index = int(sys.argv[sys.argv.index("--process-id") + 1])
print(f"[Gloo] Rank {index} is connected to 1 peer ranks. Expected number of connected "
      f"peer ranks is : 1", file=sys.stderr, flush=True)
print("progress\\r", end="", file=sys.stderr, flush=True)
print(f"summary of process {index}", file=sys.stderr)
print(f"result of process {index}")
sys.exit(int(sys.argv[1]) if index == 1 else 0)
"""


def launch(tmp_path: Path, status: int) -> subprocess.CompletedProcess:
    """``moejax launch`` of 2 processes of CHILD; its output decoded as is (a text-mode
    capture would turn the progress bar's \\r into a line end)."""
    done = subprocess.run(
        [sys.executable, "-m", "serving.cli", "launch", "--processes", "2", "--log-dir",
         str(tmp_path / "logs"), "--grace-seconds", "5", "--", sys.executable, "-c", CHILD,
         str(status)], cwd=REPO, env=child_env(), capture_output=True, timeout=60)
    done.stdout, done.stderr = done.stdout.decode(), done.stderr.decode()
    return done


def test_launch_shows_process_0s_messages_only(tmp_path):
    """Before: a second summary (process 1's, ending "results in /dev/null") and gloo's
    connection lines. Now process 1 writes to its log; process 0's stdout is as it was."""
    done = launch(tmp_path, 0)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "result of process 0\n"
    log = tmp_path / "logs" / "process-1.log"
    assert done.stderr == (f"moejax launch: the output of processes 1-1 goes to "
                           f"{tmp_path / 'logs' / 'process-I.log'}\n"
                           f"progress\rsummary of process 0\n")
    assert "summary of process 1" in log.read_text()


def test_launch_shows_the_end_of_a_failed_process_log(tmp_path):
    done = launch(tmp_path, 5)
    assert done.returncode == 5
    assert "moejax launch: process 1 exited with status 5" in done.stderr
    assert f"the end of {tmp_path / 'logs' / 'process-1.log'}:" in done.stderr
    assert "summary of process 1" in done.stderr and "[Gloo]" not in done.stderr


@pytest.mark.parametrize("pieces, shown", [
    ([b"[Gloo] Rank 0 is connected to 1 peer ranks. x\nkept\n"], b"kept\n"),
    ([b"[Glo", b"o] Rank 3 is connected to 3 peer ranks\nnext"], b"next"),
    ([b"[Glo", b"bal] not chatter\n"], b"[Global] not chatter\n"),
    ([b"half a line ", b"[Gloo] Rank 0 is connected to 1 peer ranks\n"],
     b"half a line [Gloo] Rank 0 is connected to 1 peer ranks\n"),
])
def test_chatter_is_dropped_by_whole_lines_only(pieces, shown):
    from serving.launch import without_chatter

    out, held, mid_line = b"", b"", False
    for piece in pieces:
        part, held, mid_line = without_chatter(held + piece, mid_line)
        out += part
    assert out + held == shown


def test_native_stdout_goes_to_stderr_in_a_multi_process_run():
    """gloo prints its connection lines on the process's stdout (file descriptor 1): in a
    multi-process ``moejax score IN > OUT`` they landed among the results."""
    code = ("import os; from serving.cli.distributed import native_stdout_to_stderr; "
            "native_stdout_to_stderr(); os.write(1, b'[Gloo] Rank 0 is connected\\n'); "
            "print('{\"id\": 1}')")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=child_env(),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == '{"id": 1}\n'
    assert done.stderr == "[Gloo] Rank 0 is connected\n"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_killed_process_gets_no_fake_error_results(tmp_path):
    """The real thing (2 processes x 2 CPU devices, gloo): SIGKILL process 1 once process 0
    has written results; process 0 stops at once with exit 1 and one message, and every
    result line it wrote is a real score (before: a 'scoring failed (JaxRuntimeError: ...
    Gloo AllGather failed ...)' line per request of every later batch, then a fatal
    abort, exit 247). The heartbeat is the default (60 s): the failed collective is what
    must end process 0. One that must first reconnect to the dead peer fails at its 30 s
    rendezvous timeout, and one stuck reading from it at the collective timeout moejax
    sets (half the heartbeat); before those, the coordination service aborted process 0
    itself in CI (README, "Failure"). Slow: two JAX processes compiling async_ep."""
    import signal
    import time

    from serving.launch import free_port

    requests = tmp_path / "in.jsonl"
    requests.write_text("".join(json.dumps({"id": i, "prompt": f"item {i} " * 10,
                                            "candidates": [" yes", " no"]}) + "\n"
                                for i in range(2000)))
    out = tmp_path / "out.jsonl"
    common = [sys.executable, "-m", "serving.cli", "score", str(requests), "-o", str(out),
              "--backend", "async_ep", "--devices", "4", "--chunk-size", "16",
              "--no-progress", "--coordinator", f"127.0.0.1:{free_port()}",
              "--num-processes", "2"]
    logs = [tmp_path / f"p{i}.log" for i in range(2)]
    procs = []
    for index, log in enumerate(logs):
        with open(log, "w") as sink:
            procs.append(subprocess.Popen(common + ["--process-id", str(index)], cwd=REPO,
                                          env=child_env(), stdout=sink,
                                          stderr=subprocess.STDOUT))
    try:
        deadline = time.monotonic() + 200
        while (not out.exists() or out.stat().st_size == 0) and time.monotonic() < deadline:
            assert procs[0].poll() is None, logs[0].read_text()[-2000:]
            time.sleep(0.2)
        assert out.stat().st_size > 0, "process 0 wrote no result before the deadline"
        procs[1].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        code = procs[0].wait(timeout=120)
        waited = time.monotonic() - killed_at
    finally:
        for process in procs:
            if process.poll() is None:
                process.kill()
                process.wait()
    log = logs[0].read_text()
    assert code == 1, log[-2000:]
    assert waited < 90, waited      # its next collective's failure, not a hang
    assert "moejax: error: a collective between the processes failed" in log, log[-2000:]
    assert "Check failure stack trace" not in log
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert 0 < len(rows) < 2000
    assert all(row["error"] is None for row in rows)
    assert [row["id"] for row in rows] == list(range(len(rows)))


def test_an_input_error_on_the_sending_thread_stops_the_run(tmp_path, fake, capsys,
                                                            monkeypatch):
    """An exception while reading the input happens on gRPC's sending thread, which only
    logs it: the run must stop with the cause (exit 1), not finish and call itself done."""
    from serving import score_transport

    inp = write_input(tmp_path / "in.jsonl", N, bad=False)
    out = str(tmp_path / "out.jsonl")
    real = score_transport.input_lines

    def failing_lines(*args, **kwargs):
        for count, line in enumerate(real(*args, **kwargs)):
            if count == 5:
                raise OSError("the disk went away")
            yield line

    monkeypatch.setattr(score_transport, "input_lines", failing_lines)
    assert score(inp, "-o", out, "--target", fake.target) == 1
    assert "internal error reading the input: OSError: the disk went away" in \
        capsys.readouterr().err
    assert load_progress(progress_path(out))["complete"] is False
