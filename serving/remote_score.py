"""``moejax score IN.jsonl -o OUT.jsonl --target HOST:PORT``: resumable batch scoring of a
large JSONL file through a moejax gRPC server (``moejax serve``) or a router speaking the
same ``moejax.v1.Scoring`` API.

Output
    One JSON result per non-blank input line, in input order, the same lines ``moejax
    score`` writes in process (plus the server's ``timings``); a bad line gets an error
    result naming its line (the input rules are :mod:`serving.jsonl`'s).

Transport
    Requests go out on ``ScoreStream`` calls (a few streams at once, :data:`MAX_STREAMS`),
    with at most ``--concurrency`` requests sent and not yet answered, and a bounded
    reorder window (results waiting for an earlier line). When a stream fails, the results
    it delivered are kept and its unanswered requests are sent again:

    * ``UNAVAILABLE`` (server restarting, shutting down, unreachable), ``RESOURCE_EXHAUSTED``
      with a ``retry-after-ms`` hint (overload), ``DEADLINE_EXCEEDED``, ``ABORTED``, or no
      result for ``--timeout`` seconds: resent after the hint or an exponential backoff;
      after ``--retry-seconds`` without any result the run stops (exit 1) with the
      progress kept, and a rerun resumes.
    * ``UNAUTHENTICATED``, ``PERMISSION_DENIED``, ``UNIMPLEMENTED``, ``NOT_FOUND``,
      ``FAILED_PRECONDITION``: the run stops at once (exit 1; every request would fail).
    * Any other code (``INVALID_ARGUMENT``, ``INTERNAL``, ``RESOURCE_EXHAUSTED`` without a
      hint, e.g. a message over the server's size limit, ...) may be one request's fault:
      the stream's unanswered requests are then sent one by one with ``Score``, and a
      request refused that way gets an error result, so one bad request never costs the
      others their results.

Resuming
    ``OUT.jsonl.progress`` (JSON, :data:`PROGRESS_FORMAT`) records the input (path, size,
    mtime, SHA-256 of its first MiB), how many results are written, the input line and
    byte offset they end at, and the byte offset of the output that holds exactly them. It
    is rewritten atomically (temporary file, fsync, ``os.replace``) after the output is
    flushed and fsynced, about every :data:`CHECKPOINT_SECONDS`. A rerun with the same
    arguments (after a crash, SIGKILL, Ctrl-C, a stop) truncates the output to the
    recorded offset (dropping a partly written tail), seeks the input to the recorded
    line and goes on: no result is written twice or lost. A finished run marks the file
    ``"complete": true``; rerunning it says so and exits 0.

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
import collections
import dataclasses
import hashlib
import json
import logging
import os
import random
import signal
import sys
import threading
import time
from typing import Any, BinaryIO, Iterator

from serving.jsonl import CommandError, JsonlLine, format_result, name_by_line, open_jsonl, \
    read_lines

log = logging.getLogger("moejax.score")

PROGRESS_FORMAT = "moejax-score-progress/1"
PROGRESS_SUFFIX = ".progress"
DEFAULT_CONCURRENCY = 64
DEFAULT_RETRY_SECONDS = 120.0
CHECKPOINT_SECONDS = 1.0  # the most work a kill can cost a rerun (plus what was in flight)
MAX_STREAMS = 4           # ScoreStream calls at once (a router may spread them over servers)
REQUESTS_PER_STREAM = 32  # ... one per this many of --concurrency (each stream costs threads)
REORDER_FACTOR = 16       # results held for an earlier line: at most this x --concurrency
MIN_REORDER = 4096
HEAD_BYTES = 1 << 20      # bytes of the input hashed to recognise it
BACKOFF_FIRST, BACKOFF_MAX = 0.1, 5.0  # seconds between retries after UNAVAILABLE
WRITE_PAUSE = 0.01        # seconds the writer lets results gather after each write
POLL = 0.2                # seconds between the writer's checks (stalls, Ctrl-C, checkpoint)

RETRY_CODES = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "ABORTED", "CANCELLED")
FATAL_CODES = ("UNAUTHENTICATED", "PERMISSION_DENIED", "UNIMPLEMENTED", "NOT_FOUND",
               "FAILED_PRECONDITION")


# ----------------------------------------------------------------------------- options
def positive_seconds(text: str) -> float:
    """argparse type: a number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a number of seconds, got {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {text}")
    return value


def add_remote_options(p: argparse.ArgumentParser) -> None:
    """The options of ``moejax score --target`` (connection options included)."""
    from serving.cli import positive_int
    from serving.grpc.cli import _add_connection_options

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
                   help=f"with --target: keep retrying an unavailable or overloaded server "
                        f"this long without any result, then stop (a rerun resumes; "
                        f"default {DEFAULT_RETRY_SECONDS:g})")
    _add_connection_options(p, None, target=False,
                            timeout_help="with --target: seconds a stream may go without a "
                                         "result while requests are in flight before it is "
                                         "resent (default: no limit)")


# ----------------------------------------------------------------------------- progress file
def progress_path(output: str) -> str:
    """Where the progress of ``output`` is kept."""
    return output + PROGRESS_SUFFIX


def input_fingerprint(path: str) -> dict[str, Any]:
    """What recognises an input file again: its path, size, mtime and the SHA-256 of its
    first :data:`HEAD_BYTES` bytes."""
    with open(path, "rb") as fh:
        st = os.fstat(fh.fileno())
        head = hashlib.sha256(fh.read(HEAD_BYTES)).hexdigest()
    return {"path": os.path.abspath(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "head_sha256": head}


def _describe(fingerprint: dict[str, Any]) -> str:
    return (f"{fingerprint.get('path')} ({fingerprint.get('size')} bytes, sha256 of the first "
            f"MiB {str(fingerprint.get('head_sha256'))[:12]}...)")


def check_same_input(recorded: dict[str, Any], current: dict[str, Any], progress: str) -> None:
    """Refuse to resume a progress file written for another input (or this input since
    changed): CommandError naming both."""
    differs = [key for key in ("size", "head_sha256", "mtime_ns")
               if recorded.get(key) != current.get(key)]
    if differs:
        what = {"size": "size", "head_sha256": "content", "mtime_ns": "modification time"}
        raise CommandError(
            f"progress file {progress} was written for input {_describe(recorded)}, but the "
            f"input is {_describe(current)} ({', '.join(what[k] for k in differs)} differ"
            f"{'s' if len(differs) == 1 else ''}): refusing to resume; give the same input, "
            f"another -o, or --overwrite to start over")


def load_progress(path: str) -> dict[str, Any] | None:
    """The progress record at ``path`` (None when there is none); CommandError when it is
    not one."""
    try:
        with open(path, encoding="utf-8") as fh:
            record = json.load(fh)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise CommandError(f"progress file {path}: cannot be read ({exc}); delete it, or give "
                           f"--overwrite to start over") from None
    fields = ("input", "lines_done", "input_line", "input_offset", "output_offset")
    if (not isinstance(record, dict) or record.get("format") != PROGRESS_FORMAT
            or any(key not in record for key in fields)
            or not isinstance(record["input"], dict)):
        raise CommandError(f"progress file {path}: not a {PROGRESS_FORMAT} record; delete it, "
                           f"or give --overwrite to start over")
    return record


def write_progress(path: str, record: dict[str, Any]) -> None:
    """Replace the progress record atomically: a kill leaves the old or the new one."""
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(record, fh, indent=1)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- input
class _TrackedInput:
    """A binary input for :func:`serving.jsonl.read_lines` that knows its byte offset.

    ``blank_first``: read one blank line before the file's bytes. On a resume this makes
    the real lines start at read_lines' line 2, so the UTF-8 byte-order mark rule (line 1
    only) cannot strip a line the uninterrupted run would have kept."""

    def __init__(self, raw: BinaryIO, offset: int, blank_first: bool):
        self.raw = raw
        self.offset = offset
        self._blank = blank_first

    def readline(self, limit: int = -1) -> bytes:
        if self._blank:
            self._blank = False
            return b"\n"
        data = self.raw.readline(limit)
        self.offset += len(data)
        return data


def input_lines(raw: BinaryIO, start_line: int, start_offset: int, max_line_bytes: int
                ) -> Iterator[tuple[JsonlLine, int]]:
    """(line, byte offset just past it) for the non-blank lines of ``raw`` after physical
    line ``start_line``, which ends at ``start_offset`` (where ``raw`` is positioned).
    Lines keep their numbers in the whole file, in ``number`` and in their error."""
    tracked = _TrackedInput(raw, start_offset, blank_first=start_line > 0)
    shift = start_line - 1 if start_line > 0 else 0
    for line in read_lines(tracked, max_line_bytes):
        if shift:
            number = line.number + shift
            error = line.error
            old = f"line {line.number}:"
            if error is not None and error.startswith(old):
                error = f"line {number}:" + error[len(old):]
            line = JsonlLine(number, line.request, error)
        yield line, tracked.offset


# ----------------------------------------------------------------------------- the run
@dataclasses.dataclass
class _Item:
    """One non-blank input line on its way: ``seq`` orders the output."""

    seq: int
    number: int
    end_offset: int
    message: Any = None   # the StreamRequest (None for a line answered locally)


@dataclasses.dataclass
class _Stream:
    """One ScoreStream call and the requests it has been given and not yet answered."""

    outstanding: dict[int, _Item] = dataclasses.field(default_factory=dict)
    call: Any = None
    dead: bool = False
    stalled: bool = False
    last_activity: float = 0.0


class _Stop(Exception):
    """Ends the run early: a server failure (exit 1) or a signal."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


def _code_name(exc: Any) -> str:
    code = exc.code() if callable(getattr(exc, "code", None)) else None
    return getattr(code, "name", str(code))


def _describe_rpc_error(exc: Any) -> str:
    details = exc.details() if callable(getattr(exc, "details", None)) else None
    return f"{_code_name(exc)}: {details or exc}"


class RemoteScoring:
    """One ``moejax score --target`` run over an opened input (positioned at the recorded
    offset) and output (positioned at its recorded offset); ``record`` is the progress
    record, updated as results are written. See the module docstring."""

    def __init__(self, args: argparse.Namespace, raw_input: BinaryIO, output: BinaryIO,
                 record: dict[str, Any], progress: str, max_line_bytes: int):
        self.args = args
        self.output = output
        self.record = record
        self.progress = progress
        self.concurrency = args.concurrency
        self.reorder_limit = max(REORDER_FACTOR * args.concurrency, MIN_REORDER)
        self.retry_seconds = args.retry_seconds
        self.stall_seconds = args.timeout
        self.lines = input_lines(raw_input, record["input_line"], record["input_offset"],
                                 max_line_bytes)
        # One lock; senders wait on ``room`` (in-flight and reorder room, requests to
        # resend), the writer on ``ready`` (the next line's result): waking everyone on
        # every result would cost more than the results themselves.
        self.lock = threading.Lock()
        self.room = threading.Condition(self.lock)
        self.ready = threading.Condition(self.lock)
        self.stop = threading.Event()
        self.failure: str | None = None
        self.exhausted = False      # the input has been read to its end
        self.seq_next = 0           # next line read gets this seq
        self.write_next = 0         # next seq to write
        self.in_flight = 0          # requests sent and not yet answered
        self.retry: collections.deque[_Item] = collections.deque()
        self.results: dict[int, tuple[_Item, Any]] = {}
        self.live: dict[int, _Stream] = {}
        self.last_success = time.monotonic()
        self.written = self.errors = 0

    # ------------------------------------------------------------------ reading
    def _read_one(self) -> _Item | None:
        """The next line to send (under the lock), answering bad lines locally; None at
        the end of the input."""
        from serving.grpc.client import _to_message
        from serving.requests import ScoreResult

        while not self.exhausted:
            if self.seq_next - self.write_next >= self.reorder_limit:
                return None   # (the caller waits for room)
            try:
                line, end = next(self.lines)
            except StopIteration:
                self.exhausted = True
                self.room.notify_all()
                self.ready.notify()
                return None
            item = _Item(self.seq_next, line.number, end)
            self.seq_next += 1
            if line.error is not None:
                self._deliver(item, ScoreResult(error=line.error))
                continue
            # Validated here (no tokenizer needed): an invalid request is answered without
            # a round trip, as Client.stream answers it. Its wire index is its line number,
            # so the server names an id-less request "request #LINE" (renamed below).
            message = _to_message(line.request, line.number)
            if isinstance(message, ScoreResult):
                self._deliver(item, message)
                continue
            item.message = message
            return item
        return None

    def _deliver(self, item: _Item, result: Any, index: int | None = None) -> None:
        """Hand a result to the writer (under the lock)."""
        result.error = name_by_line(result.error, item.number if index is None else index,
                                    item.number)
        self.results[item.seq] = (item, result)
        if item.seq == self.write_next:
            self.ready.notify()

    def _finished_sending(self) -> bool:
        return self.exhausted and not self.retry

    # ------------------------------------------------------------------ streams
    def _messages(self, stream: _Stream) -> Iterator[Any]:
        """The requests of one stream: resent ones first, then new lines, while fewer
        than --concurrency are in flight. Runs on gRPC's sending thread."""
        while True:
            with self.lock:
                while True:
                    if self.stop.is_set() or stream.dead or self._finished_sending():
                        return
                    if self.in_flight < self.concurrency:
                        item = self.retry.popleft() if self.retry else self._read_one()
                        if item is not None:
                            break
                        if self._finished_sending():
                            return
                    self.room.wait(POLL)
                if not stream.outstanding:
                    stream.last_activity = time.monotonic()
                stream.outstanding[item.number] = item
                self.in_flight += 1
            yield item.message

    def _answered(self, stream: _Stream, response: Any) -> None:
        from serving.grpc import convert

        result = convert.result_from_proto(response.result)
        with self.lock:
            item = stream.outstanding.pop(response.index, None)
            if item is None:   # not ours, or answered twice: never write a line twice
                log.warning("ignoring a result for index %d, which this stream has no "
                            "request of", response.index)
                return
            self.in_flight -= 1
            self.room.notify()
            stream.last_activity = self.last_success = time.monotonic()
            self._deliver(item, result)

    def _take_back(self, stream: _Stream) -> list[_Item]:
        """Mark the stream dead and take back its unanswered requests (under the lock, so
        its sending thread cannot add one after)."""
        with self.lock:
            stream.dead = True
            items = sorted(stream.outstanding.values(), key=lambda item: item.seq)
            stream.outstanding.clear()
            self.in_flight -= len(items)
            self.room.notify_all()
            return items

    def _worker(self, wid: int) -> None:
        """Run streams until every line is sent and answered, or the run stops."""
        import grpc

        failures = 0
        try:
            while not self.stop.is_set():
                with self.lock:
                    if self._finished_sending():
                        return
                stream = _Stream()
                error: Any = None
                try:
                    call = self.connection.open_stream(self._messages(stream))
                    with self.lock:
                        stream.call = call
                        self.live[wid] = stream
                    for response in call:
                        self._answered(stream, response)
                        failures = 0
                except grpc.RpcError as exc:
                    error = exc
                finally:
                    with self.lock:
                        self.live.pop(wid, None)
                    left = self._take_back(stream)
                if self.stop.is_set():
                    return
                if error is None:
                    if left:   # the server ended the stream without answering everything
                        self._resend(left)
                    continue
                failures += 1
                self._after_stream_failure(error, stream, left, failures)
        except _Stop as stop:
            self._fail(str(stop))
        except BaseException as exc:  # noqa: BLE001  (a bug must stop the run, not hang it)
            self._fail(f"internal error in stream worker {wid}: {exc!r}")
            raise

    def _after_stream_failure(self, error: Any, stream: _Stream, left: list[_Item],
                              failures: int) -> None:
        """Resend, isolate or stop after a failed stream (see the module docstring)."""
        from serving.grpc.client import _retry_hint_seconds

        code = _code_name(error)
        hint = _retry_hint_seconds(error) if code == "RESOURCE_EXHAUSTED" else None
        what = _describe_rpc_error(error)
        if stream.stalled:
            what = f"no result for {self.stall_seconds:g}s (--timeout)"
        if code in FATAL_CODES:
            raise _Stop(f"the server refused the stream: {what}", 1)
        if code in RETRY_CODES or hint is not None or not left:
            self._resend(left)
            self._wait_to_retry(what, hint, failures)
            return
        # Possibly one request's fault (too large a message, a request the server fails
        # on): send the stream's unanswered requests one at a time.
        log.warning("stream failed (%s); sending its %d unanswered requests one by one",
                    what, len(left))
        with self.lock:
            self.in_flight += len(left)
        for item in left:
            if self.stop.is_set():   # (stopping: what is not written is sent on resume)
                return
            self._score_alone(item)

    def _wait_to_retry(self, what: str, hint: float | None, failures: int) -> None:
        """Sleep before a retry, or stop when nothing has been answered for too long."""
        silent = time.monotonic() - self.last_success
        if silent > self.retry_seconds:
            raise _Stop(f"no result from {self.args.target} for {silent:.0f}s "
                        f"(--retry-seconds {self.retry_seconds:g}); last error: {what}", 1)
        if hint is not None:
            delay = hint * random.uniform(1.0, 1.2)   # spread the refused crowd a little
        else:
            delay = min(BACKOFF_MAX, BACKOFF_FIRST * 2 ** (failures - 1))
            delay *= random.uniform(0.5, 1.0)
        (log.warning if failures == 1 else log.info)(
            "%s; retrying in %.2fs (unanswered requests are sent again)", what, delay)
        self.stop.wait(delay)

    def _score_alone(self, item: _Item) -> None:
        """Score one request with a unary Score call: its result, or its own error."""
        import grpc

        from serving.grpc import convert
        from serving.grpc.client import _retry_hint_seconds
        from serving.requests import request_label

        failures = 0
        while not self.stop.is_set():
            try:
                response = self.connection.score_one(item.message.request, self.stall_seconds)
            except grpc.RpcError as exc:
                code = _code_name(exc)
                hint = _retry_hint_seconds(exc) if code == "RESOURCE_EXHAUSTED" else None
                if code in FATAL_CODES:
                    raise _Stop(f"the server refused a request: {_describe_rpc_error(exc)}", 1)
                if code in RETRY_CODES or hint is not None:
                    failures += 1
                    self._wait_to_retry(_describe_rpc_error(exc), hint, failures)
                    continue
                # The request's own problem. The server names an id-less request
                # "request #0" (one per call), renamed to its line by _deliver.
                label = request_label(convert.get_id(item.message.request), 0)
                details = exc.details() or code
                error = details if details.startswith(label) else f"{label}: {details}"
                result = convert.error_result(convert.get_id(item.message.request), error)
            else:
                result = convert.result_from_proto(response)
            with self.lock:
                self.in_flight -= 1
                self.room.notify()
                self.last_success = time.monotonic()
                self._deliver(item, result, index=0)
            return

    # ------------------------------------------------------------------ stopping
    def _resend(self, items: list[_Item]) -> None:
        """Queue unanswered requests to be sent again, first."""
        with self.lock:
            self.retry.extendleft(reversed(items))
            self.room.notify_all()

    def _fail(self, message: str) -> None:
        with self.lock:
            if self.failure is None:
                self.failure = message
            self.ready.notify()
        self._cancel_all()

    def _cancel_all(self) -> None:
        self.stop.set()
        with self.lock:
            calls = [s.call for s in self.live.values() if s.call is not None]
            self.room.notify_all()
            self.ready.notify()
        for call in calls:
            call.cancel()

    def _check_stalls(self) -> None:
        """Cancel (to resend) a stream with requests in flight and no result for
        --timeout seconds."""
        if self.stall_seconds is None:
            return
        now = time.monotonic()
        with self.lock:
            stuck = [s for s in self.live.values() if s.outstanding and not s.stalled
                     and now - s.last_activity > self.stall_seconds]
            for s in stuck:
                s.stalled = True
        for s in stuck:
            s.call.cancel()

    # ------------------------------------------------------------------ writing
    def _write(self, batch: list[tuple[_Item, Any]]) -> None:
        data = b"".join(format_result(result.to_dict(), "utf-8").encode("utf-8")
                        for _, result in batch)
        self.output.write(data)
        # Counted only once written: a Ctrl-C in write() leaves at most an unrecorded tail,
        # which a resume truncates away.
        last = batch[-1][0]
        self.record["output_offset"] += len(data)
        self.record["lines_done"] += len(batch)
        self.record["input_line"] = last.number
        self.record["input_offset"] = last.end_offset
        errors = sum(result.error is not None for _, result in batch)
        self.record["errors"] = self.record.get("errors", 0) + errors
        self.written += len(batch)
        self.errors += errors

    def checkpoint(self, complete: bool = False) -> None:
        """Flush and fsync the output, then record how far it goes."""
        self.output.flush()
        os.fsync(self.output.fileno())
        self.record["complete"] = complete
        self.record["updated"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        write_progress(self.progress, self.record)

    def _collect(self) -> list[tuple[_Item, Any]] | None:
        """The results ready to be written in order (waits a little); None when all are."""
        with self.lock:
            if self.write_next not in self.results:
                if self.exhausted and self.write_next == self.seq_next:
                    return None
                if self.failure is None:
                    self.ready.wait(POLL)
            batch = []
            while self.write_next in self.results:
                batch.append(self.results.pop(self.write_next))
                self.write_next += 1
            if batch:
                self.room.notify_all()   # room in the reorder window
            return batch

    def run(self, connection: Any, bar: Any) -> None:
        """Send, receive and write until every line is written; raises _Stop when the
        run stops early (KeyboardInterrupt passes through)."""
        self.connection = connection
        workers = [threading.Thread(target=self._worker, args=(i,), daemon=True,
                                    name=f"moejax-score-stream-{i}")
                   for i in range(min(MAX_STREAMS,
                                      -(-self.concurrency // REQUESTS_PER_STREAM)))]
        for worker in workers:
            worker.start()
        last_checkpoint, recorded = time.monotonic(), self.record["lines_done"]
        try:
            while True:
                if self.failure is not None:
                    raise _Stop(self.failure, 1)
                batch = self._collect()
                if batch is None:
                    break
                if not batch and not any(worker.is_alive() for worker in workers):
                    batch = self._collect()   # what the last worker delivered as it ended
                    if batch is None:
                        break
                    if not batch and self.failure is None:
                        raise _Stop("internal error: every stream worker ended before every "
                                    "line was answered", 1)
                if batch:
                    self._write(batch)
                    if bar is not None:
                        bar.update(len(batch))
                    # Let results gather: writing them a few at a time costs more wake-ups
                    # (and GIL hand-overs with the stream threads) than the writing.
                    time.sleep(WRITE_PAUSE)
                if (time.monotonic() - last_checkpoint >= CHECKPOINT_SECONDS
                        and self.record["lines_done"] != recorded):
                    self.checkpoint()
                    last_checkpoint, recorded = time.monotonic(), self.record["lines_done"]
                self._check_stalls()
        finally:
            self._cancel_all()
            for worker in workers:
                worker.join(timeout=5)


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


class _Connection:
    """``serving.grpc.Client`` plus the two calls this run makes itself: a ScoreStream it
    feeds lazily (resending on failures, which ``Client.stream`` does not) and a unary
    Score."""

    def __init__(self, args: argparse.Namespace):
        from serving.grpc.cli import _token
        from serving.grpc.client import Client

        # gRPC's reconnect backoff grows to 2 minutes by default: after an outage, a run
        # would wait that long to see the server back. Cap it below --retry-seconds.
        self.client = Client(args.target, token=_token(args), tls=args.tls,
                             tls_ca=args.tls_ca, tls_server_name=args.tls_server_name,
                             options=[("grpc.initial_reconnect_backoff_ms", 100),
                                      ("grpc.min_reconnect_backoff_ms", 100),
                                      ("grpc.max_reconnect_backoff_ms", 2000)])

    def open_stream(self, messages: Iterator[Any]) -> Any:
        client = self.client
        return client._stub.ScoreStream(messages, metadata=client._metadata)

    def score_one(self, request: Any, timeout: float | None) -> Any:
        client = self.client
        return client._stub.Score(request, timeout=timeout, metadata=client._metadata)

    def close(self) -> None:
        self.client.close()


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
                record = {"format": PROGRESS_FORMAT, "input": input_fingerprint(args.input),
                          "output": os.path.abspath(args.output), "target": args.target,
                          "lines_done": 0, "input_line": 0, "input_offset": 0,
                          "output_offset": 0, "errors": 0, "complete": False}
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
            connection = _Connection(args)
            job.run(connection, bar)
            completed = True
        except _Stop as stop:
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
