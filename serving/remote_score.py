"""``moejax score IN.jsonl -o OUT.jsonl --target HOST:PORT``: resumable batch scoring of a
large JSONL file through a moejax gRPC server (``moejax serve``) or a router speaking the
same ``moejax.v1.Scoring`` API.

Output
    One JSON result per non-blank input line, in input order, the same lines ``moejax
    score`` writes in process (plus the server's ``timings``); a bad line gets an error
    result naming its line (the input rules are :mod:`serving.jsonl`'s).

Transport (:mod:`serving.score_transport`)
    Requests go out on a few ``ScoreStream`` calls, at most ``--concurrency`` of them sent
    and not yet answered. A failed stream's unanswered requests are sent again: after the
    server's retry hint or a backoff when the server (or a router's upstream) is
    unavailable, overloaded or silent for ``--timeout`` seconds; one by one with ``Score``
    when the failure may be one request's fault (a request refused that way gets an error
    result); not at all when every request would fail (UNAUTHENTICATED, PERMISSION_DENIED, ...: the run stops, exit 1). When
    requests wait and no result came for ``--retry-seconds`` (the server down, refusing,
    or holding the streams and answering nothing), the run stops, exit 1, with the
    progress kept and not marked complete.

Resuming (:mod:`serving.score_progress`)
    ``OUT.jsonl.progress`` records the input, how many results are written and where they
    end in the input and the output; it is rewritten atomically after the output is
    fsynced, about every second. A rerun with the same arguments (after a crash, SIGKILL,
    Ctrl-C, a stop) truncates the output to the recorded offset, seeks the input to the
    recorded line and goes on: no result is written twice or lost. A finished run marks
    the file ``"complete": true``; rerunning it says so and exits 0.

Refused (one line ``moejax: error: ...``, exit 2): ``--target`` without ``-o`` (or with
``-o -``) or with stdin as input; an existing non-empty output without a progress file
(unless ``--overwrite``, which starts over); a progress file of another input (both
named); an output shorter than its progress file records; a second run on the same output
at the same time.

Exit status: 0 done (or already complete), 1 stopped on a server failure (progress
kept), 2 refused, 130 Ctrl-C / 143 SIGTERM (progress kept).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from typing import Any, BinaryIO

from serving.jsonl import CommandError, open_jsonl, positive_number
from serving.score_progress import (check_same_input, input_fingerprint, load_progress,
                                    new_record, progress_path, write_progress)
from serving.score_transport import Connection, RemoteScoring, RunStopped

DEFAULT_CONCURRENCY = 64
DEFAULT_RETRY_SECONDS = 120.0


# ----------------------------------------------------------------------------- options
positive_seconds = positive_number("seconds")   # argparse type: seconds > 0


def add_remote_options(p: argparse.ArgumentParser) -> None:
    """The options of ``moejax score --target`` (connection options included)."""
    from serving.cli.options import positive_int
    from serving.grpc.cli_options import add_connection_options

    p.add_argument("--target", default=None,
                   help="score through the moejax gRPC server or router at HOST:PORT instead "
                        "of in process: resumable, needs -o (see serving/remote_score.py)")
    p.add_argument("--concurrency", type=positive_int, default=DEFAULT_CONCURRENCY,
                   help=f"with --target: requests in flight at once "
                        f"(default {DEFAULT_CONCURRENCY})")
    p.add_argument("--overwrite", action="store_true",
                   help="with --target: start over, replacing an existing -o file and its "
                        "progress file")
    p.add_argument("--retry-seconds", type=positive_seconds, default=DEFAULT_RETRY_SECONDS,
                   help=f"with --target: seconds without any result from the server while "
                        f"requests wait for one (it is down, overloaded, or answers "
                        f"nothing) before the run stops with exit 1 (a rerun resumes; "
                        f"give more than the slowest request takes; "
                        f"default {DEFAULT_RETRY_SECONDS:g})")
    add_connection_options(p, None, target=False,
                           timeout_help="with --target: seconds a stream may go without a "
                                        "result while requests are in flight before it is "
                                        "resent (default: no limit)")


# ----------------------------------------------------------------------------- the command
class _Terminated(KeyboardInterrupt):
    """SIGTERM, handled as Ctrl-C is (the progress is recorded), exit 143."""


def _on_sigterm(signum: int, frame: Any) -> None:
    raise _Terminated()


def _lock(output: BinaryIO, path: str) -> None:
    """One run per output at a time (two would interleave their lines)."""
    try:
        import fcntl
    except ImportError:   # not POSIX: no lock
        return
    try:
        fcntl.flock(output.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        raise CommandError(f"output {path}: another moejax score is writing it") from None


def _plan(args: argparse.Namespace, progress: str, record: dict[str, Any] | None,
          existed: bool) -> str:
    """'fresh', 'resume' or 'complete' (refusing what must not run)."""
    if args.overwrite:
        return "fresh"
    if record is None:
        if existed and os.path.getsize(args.output) > 0:
            raise CommandError(
                f"output {args.output} exists and has no progress file ({progress}): "
                f"refusing to overwrite or append to it; give --overwrite to score again "
                f"from the start, or another -o")
        return "fresh"
    check_same_input(record["input"], input_fingerprint(args.input), progress)
    if record.get("complete"):
        return "complete"
    return "resume"


def run_remote(args: argparse.Namespace) -> int:
    """``moejax score --target``: see the module docstring. Returns the exit status."""
    if args.output in (None, "-"):
        raise CommandError("--target needs -o OUT.jsonl: the results go to a file, which a "
                           "rerun resumes (not to standard output)")
    if args.input == "-":
        raise CommandError("--target needs an input file, not standard input: a rerun "
                           "resumes by reading it again")
    progress = progress_path(args.output)
    existed = os.path.exists(args.output)
    record = None if args.overwrite else load_progress(progress)
    # The shared checks first (readable input, writable output that is not the input);
    # open_jsonl creates a missing output, and removes it again if the command fails
    # before start_output().
    with open_jsonl(args.input, args.output, args.max_line_mib) as files:
        if not os.path.isfile(args.input):
            raise CommandError(f"--target needs a regular input file (a rerun resumes by "
                               f"reading it again), got {args.input}")
        if not os.path.isfile(args.output):
            raise CommandError(f"--target needs a regular output file (a rerun truncates it "
                               f"to what is recorded), got {args.output}")
        mode = _plan(args, progress, record, existed)
        if mode == "complete":
            assert record is not None
            print(f"already complete: {record['lines_done']} results in {args.output} (see "
                  f"{progress}); nothing to do (--overwrite scores again)", file=sys.stderr)
            return 0
        if mode == "resume" and not existed and record["output_offset"] > 0:
            raise CommandError(f"output {args.output} is missing, but {progress} records "
                               f"{record['lines_done']} results written to it: delete "
                               f"{progress} or give --overwrite to start over")
        with open(args.output, "r+b") as output:   # written through this handle only
            _lock(output, args.output)
            if not existed:
                files.start_output()   # keep the file open_jsonl created (it is empty)
            if mode == "fresh":
                record = new_record(args.input, args.output, args.target)
                # Recorded before the output is truncated: a kill in between resumes at 0.
                write_progress(progress, record)
            assert record is not None
            record["target"] = args.target
            return _run(args, files, output, record, progress)


def _run(args: argparse.Namespace, files: Any, output: BinaryIO, record: dict[str, Any],
         progress: str) -> int:
    """Resume (or start) at the recorded offsets and score the rest."""
    size = os.fstat(output.fileno()).st_size
    offset = record["output_offset"]
    if size < offset:
        raise CommandError(f"output {args.output} holds {size} bytes, fewer than the {offset} "
                           f"that {progress} records: it was changed since; give --overwrite "
                           f"to start over")
    output.truncate(offset)   # drop what was written after the last checkpoint
    output.seek(offset)
    files.source.seek(record["input_offset"])
    resumed_from = record["lines_done"]
    job = RemoteScoring(args, files.source, output, record, progress, files.max_line_bytes)
    status, reason, completed = 0, None, False
    bar = connection = None
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
    start = time.perf_counter()
    try:
        try:
            show_bar = args.progress if args.progress is not None else sys.stderr.isatty()
            if show_bar:
                from tqdm import tqdm

                bar = tqdm(total=files.count(), initial=resumed_from, unit="req",
                           desc=f"scoring via {args.target}", file=sys.stderr,
                           smoothing=0.1)
            connection = Connection(args)
            job.run(connection, bar)
            completed = True
        except RunStopped as stop:
            status, reason = stop.status, str(stop)
        except KeyboardInterrupt as exc:
            status = 143 if isinstance(exc, _Terminated) else 130
            reason = "terminated" if status == 143 else "interrupted"
        finally:
            # Record what is written (a finished run as complete), and drop any tail
            # written past it.
            job.checkpoint(complete=completed)
            output.truncate(record["output_offset"])
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
        if connection is not None:
            connection.close()
        if bar is not None:
            bar.close()
    elapsed = time.perf_counter() - start
    rate = job.written / elapsed if elapsed > 0 else 0.0
    summary = (f"{job.written} results written ({job.errors} with errors) in {elapsed:.2f}s, "
               f"{rate:.0f} req/s via {args.target}"
               + (f", resumed after {resumed_from} results already written" if resumed_from
                  else "")
               + f"; {record['lines_done']} results in {args.output}")
    if reason is not None:
        print(f"moejax score: stopped: {reason}", file=sys.stderr)
        summary += f"; progress kept in {progress}: run the same command again to resume"
    print(summary, file=sys.stderr)
    return status
