"""The transport of ``moejax score --target`` (:mod:`serving.remote_score`): one run's
requests sent over a few ``ScoreStream`` calls, failures retried, results written in input
order and checkpointed (:class:`RemoteScoring`), over a :class:`Connection`.

Requests go out on ``ScoreStream`` calls (a few streams at once, :data:`MAX_STREAMS`),
with at most ``--concurrency`` requests sent and not yet answered, and a bounded reorder
window (results waiting for an earlier line). When a stream fails, the results it
delivered are kept and its unanswered requests are sent again:

* ``UNAVAILABLE`` (server restarting, shutting down, unreachable), ``RESOURCE_EXHAUSTED``
  with a ``retry-after-ms`` hint (overload), ``DEADLINE_EXCEEDED``, ``ABORTED``, or no
  result for ``--timeout`` seconds: resent after the hint or an exponential backoff.
* ``--retry-seconds`` without any result while requests wait for one (sent, or to be sent
  again) stops the run (exit 1, the progress kept, not marked complete; a rerun resumes),
  whatever the cause: failing streams, or streams the server holds open and never answers.
* ``UNAUTHENTICATED``, ``PERMISSION_DENIED``, ``UNIMPLEMENTED``, ``NOT_FOUND``,
  ``FAILED_PRECONDITION``: the run stops at once (exit 1; every request would fail).
* Any other code (``INVALID_ARGUMENT``, ``INTERNAL``, ``RESOURCE_EXHAUSTED`` without a
  hint, e.g. a message over the server's size limit, ...) may be one request's fault: the
  stream's unanswered requests are then sent one by one with ``Score``, and a request
  refused that way gets an error result, so one bad request never costs the others their
  results.

Threads: one worker thread per stream (its requests are generated on gRPC's sending
thread), and the caller's thread, which writes the results in order and checkpoints the
progress file (:mod:`serving.score_progress`) about every :data:`CHECKPOINT_SECONDS`. Why
a module of its own: this is the part of the command that talks to the server; the command
around it (options, refusals, resuming, signals) is :mod:`serving.remote_score`.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import logging
import os
import random
import threading
import time
from typing import Any, BinaryIO, Iterator

from serving.jsonl import format_result, name_by_line
from serving.score_progress import input_lines, write_progress

log = logging.getLogger("moejax.score")

CHECKPOINT_SECONDS = 1.0  # the most work a kill can cost a rerun (plus what was in flight)
MAX_STREAMS = 4           # ScoreStream calls at once (a router may spread them over servers)
REQUESTS_PER_STREAM = 32  # ... one per this many of --concurrency (each stream costs threads)
REORDER_FACTOR = 16       # results held for an earlier line: at most this x --concurrency
MIN_REORDER = 4096
BACKOFF_FIRST, BACKOFF_MAX = 0.1, 5.0  # seconds between retries after UNAVAILABLE
WRITE_PAUSE = 0.01        # seconds the writer lets results gather after each write
POLL = 0.2                # seconds between the writer's checks (stalls, Ctrl-C, checkpoint)

RETRY_CODES = ("UNAVAILABLE", "DEADLINE_EXCEEDED", "ABORTED", "CANCELLED")
FATAL_CODES = ("UNAUTHENTICATED", "PERMISSION_DENIED", "UNIMPLEMENTED", "NOT_FOUND",
               "FAILED_PRECONDITION")


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


class RunStopped(Exception):
    """Ends the run early on a server failure; ``status``: the exit status (1)."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


def _code_name(exc: Any) -> str:
    code = exc.code() if callable(getattr(exc, "code", None)) else None
    return getattr(code, "name", str(code))


def _code_and_hint(exc: Any) -> tuple[str, float | None]:
    """The status code's name of a failed call, and the server's retry hint in seconds
    when it refused for overload (RESOURCE_EXHAUSTED with ``retry-after-ms``; else None)."""
    from serving.grpc.client import retry_hint_seconds

    code = _code_name(exc)
    return code, retry_hint_seconds(exc) if code == "RESOURCE_EXHAUSTED" else None


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
        self.last_success = time.monotonic()   # the last result from the server
        self.last_error: str | None = None      # the last failed call, for messages
        self.written = self.errors = 0

    # ------------------------------------------------------------------ reading
    def _read_one(self) -> _Item | None:
        """The next line to send (under the lock), answering bad lines locally; None at
        the end of the input."""
        from serving.grpc.client import to_message
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
            message = to_message(line.request, line.number)
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
        """The requests of one stream (:meth:`_stream_messages`). gRPC's sending thread
        swallows an exception raised here (it only logs "Exception iterating requests!"),
        so one (reading the input, say) stops the run with its cause instead: the run then
        fails, and is never taken for a finished one."""
        try:
            yield from self._stream_messages(stream)
        except Exception as exc:
            self._fail(f"internal error reading the input: {type(exc).__name__}: {exc}")
            raise

    def _stream_messages(self, stream: _Stream) -> Iterator[Any]:
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
        except RunStopped as stop:
            self._fail(str(stop))
        except BaseException as exc:  # noqa: BLE001  (a bug must stop the run, not hang it)
            self._fail(f"internal error in stream worker {wid}: {exc!r}")
            raise

    def _after_stream_failure(self, error: Any, stream: _Stream, left: list[_Item],
                              failures: int) -> None:
        """Resend, isolate or stop after a failed stream (see the module docstring)."""
        code, hint = _code_and_hint(error)
        what = _describe_rpc_error(error)
        if stream.stalled:
            what = f"no result for {self.stall_seconds:g}s (--timeout)"
        if code in FATAL_CODES:
            raise RunStopped(f"the server refused the stream: {what}", 1)
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
        self.last_error = what
        silent = time.monotonic() - self.last_success
        if silent > self.retry_seconds:
            raise RunStopped(f"no result from {self.args.target} for {silent:.0f}s "
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
        from serving.requests import request_label

        failures = 0
        while not self.stop.is_set():
            try:
                response = self.connection.score_one(item.message.request, self.stall_seconds)
            except grpc.RpcError as exc:
                code, hint = _code_and_hint(exc)
                if code in FATAL_CODES:
                    raise RunStopped(f"the server refused a request: {_describe_rpc_error(exc)}", 1)
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

    def _check_silence(self) -> None:
        """Stop the run (RunStopped) when requests wait for a result and the server gave
        none for ``--retry-seconds``: a server that holds streams open and never answers
        must stop the run as an unreachable one does, not keep it waiting forever (when
        ``--timeout`` is not given, nothing else notices it)."""
        with self.lock:
            waiting = self.in_flight + len(self.retry)
            silent = time.monotonic() - self.last_success
            last_error = self.last_error
        if not waiting or silent <= self.retry_seconds:
            return
        cause = (f"last error: {last_error}" if last_error is not None
                 else "the server took the requests and answered none")
        raise RunStopped(f"no result from {self.args.target} for {silent:.0f}s "
                         f"(--retry-seconds {self.retry_seconds:g}) with {waiting} requests "
                         f"waiting for one; {cause}", 1)

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
        """Send, receive and write until every line is written; raises RunStopped when the
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
                    raise RunStopped(self.failure, 1)
                batch = self._collect()
                if batch is None:
                    break
                if not batch and not any(worker.is_alive() for worker in workers):
                    batch = self._collect()   # what the last worker delivered as it ended
                    if batch is None:
                        break
                    if not batch and self.failure is None:
                        raise RunStopped("internal error: every stream worker ended "
                                         "before every line was answered", 1)
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
                self._check_silence()
        finally:
            self._cancel_all()
            for worker in workers:
                worker.join(timeout=5)


class Connection:
    """``serving.grpc.Client`` plus the two calls this run makes itself: a ScoreStream it
    feeds lazily (resending on failures, which ``Client.stream`` does not) and a unary
    Score."""

    def __init__(self, args: argparse.Namespace):
        from serving.grpc.cli_options import connect

        # gRPC's reconnect backoff grows to 2 minutes by default: after an outage, a run
        # would wait that long to see the server back. Cap it below --retry-seconds.
        self.client = connect(args, options=[("grpc.initial_reconnect_backoff_ms", 100),
                                             ("grpc.min_reconnect_backoff_ms", 100),
                                             ("grpc.max_reconnect_backoff_ms", 2000)])

    def open_stream(self, messages: Iterator[Any]) -> Any:
        client = self.client
        return client.stub.ScoreStream(messages, metadata=client.metadata)

    def score_one(self, request: Any, timeout: float | None) -> Any:
        client = self.client
        return client.stub.Score(request, timeout=timeout, metadata=client.metadata)

    def close(self) -> None:
        self.client.close()
