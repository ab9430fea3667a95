"""The progress file of ``moejax score --target`` (:mod:`serving.remote_score`), and
reading its input again from where the progress file says the written results end.

``OUT.jsonl.progress`` (JSON, :data:`PROGRESS_FORMAT`) records the input (path, size,
mtime, SHA-256 of its first MiB), how many results are written, the input line and byte
offset they end at, and the byte offset of the output that holds exactly them. It is
rewritten atomically (temporary file, fsync, ``os.replace``: :func:`write_progress`) after
the output is flushed and fsynced (:meth:`serving.score_transport.RemoteScoring.checkpoint`).
A rerun with the same arguments (after a crash, SIGKILL, Ctrl-C, a stop) truncates the
output to the recorded offset (dropping a partly written tail), seeks the input to the
recorded line and goes on (:func:`input_lines`): no result is written twice or lost. A
finished run marks the file ``"complete": true``.

A progress file is checked before it is trusted (:func:`load_progress`): every field's type
and range (a refusal names the file and the field), the offsets against the files (each
on a line end; the output holds ``lines_done`` lines up to ``output_offset``; the input
holds ``input_line`` lines, ``lines_done`` of them non-blank, up to ``input_offset``), and
``"complete": true`` only when no input line is left past the recorded one (else the run
resumes). :func:`write_progress` never records a run as complete while input lines are
left without a result (:class:`IncompleteRun`, exit 1), whatever failure caused it.

Why a module of its own: what a progress record holds and how an input is recognised and
resumed is one format, apart from the network (:mod:`serving.score_transport`) and from
the command's rules (:mod:`serving.remote_score`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from typing import Any, BinaryIO, Iterator

from serving.jsonl import CommandError, JsonlLine, has_content, read_lines

log = logging.getLogger("moejax.score")

PROGRESS_FORMAT = "moejax-score-progress/1"
PROGRESS_SUFFIX = ".progress"
HEAD_BYTES = 1 << 20      # bytes of the input hashed to recognise it


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


_START_OVER = "delete it, or give --overwrite to start over"


def _refuse(path: str, problem: str) -> CommandError:
    return CommandError(f"progress file {path}: {problem}; {_START_OVER}")


def _is_count(value: Any) -> bool:
    """An integer >= 0 (JSON's true/false are not counts, though Python's bool is an int)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_fields(record: Any, path: str) -> None:
    """Every field's type and range, and the ranges they set each other: CommandError
    naming the progress file and the first wrong field."""
    fields = ("input", "lines_done", "input_line", "input_offset", "output_offset")
    if (not isinstance(record, dict) or record.get("format") != PROGRESS_FORMAT
            or any(key not in record for key in fields)):
        missing = [key for key in fields if key not in record] \
            if isinstance(record, dict) and record.get("format") == PROGRESS_FORMAT else []
        raise _refuse(path, f"not a {PROGRESS_FORMAT} record"
                            + (f" (no {', '.join(missing)})" if missing else ""))
    fingerprint = record["input"]
    if not isinstance(fingerprint, dict):
        raise _refuse(path, f"input must be an object, got {fingerprint!r}")
    for key, valid, what in (("path", lambda v: isinstance(v, str) and v, "a file path"),
                             ("size", _is_count, "an integer >= 0"),
                             ("mtime_ns", lambda v: isinstance(v, int)
                              and not isinstance(v, bool), "an integer"),
                             ("head_sha256", lambda v: isinstance(v, str) and len(v) == 64,
                              "a SHA-256 hex digest")):
        if not valid(fingerprint.get(key)):
            raise _refuse(path, f"input.{key} must be {what}, got {fingerprint.get(key)!r}")
    for key in ("lines_done", "input_line", "input_offset", "output_offset"):
        if not _is_count(record[key]):
            raise _refuse(path, f"{key} must be an integer >= 0, got {record[key]!r}")
    if not _is_count(record.get("errors", 0)) or record.get("errors", 0) > record["lines_done"]:
        raise _refuse(path, f"errors must be an integer from 0 to lines_done "
                            f"({record['lines_done']}), got {record.get('errors')!r}")
    if not isinstance(record.get("complete", False), bool):
        raise _refuse(path, f"complete must be true or false, got {record.get('complete')!r}")
    if record["input_line"] < record["lines_done"]:
        raise _refuse(path, f"input_line {record['input_line']} is before the "
                            f"{record['lines_done']} lines that lines_done says are answered")
    if record["input_offset"] > fingerprint["size"]:
        raise _refuse(path, f"input_offset {record['input_offset']} is past the end of the "
                            f"input ({fingerprint['size']} bytes, input.size)")
    if (record["lines_done"] == 0) != (record["output_offset"] == 0):
        raise _refuse(path, f"output_offset {record['output_offset']} does not fit "
                            f"lines_done {record['lines_done']} (no result takes no bytes)")


def load_progress(path: str, check_files: bool = True) -> dict[str, Any] | None:
    """The progress record at ``path`` (None when there is none), checked: CommandError
    naming the file and the field when a field has the wrong type or range, when its
    offsets do not fall on line ends of the input and output or disagree with their line
    counts (:func:`check_against_files`; ``check_files=False`` skips reading the files, for
    a record this process has just written). ``"complete": true`` is trusted only when the
    input has no line left past the recorded one; otherwise the record is resumed (with a
    warning) instead of being taken for a finished run."""
    try:
        with open(path, encoding="utf-8") as fh:
            record = json.load(fh)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise CommandError(f"progress file {path}: cannot be read ({exc}); {_START_OVER}") \
            from None
    _check_fields(record, path)
    if check_files:
        check_against_files(record, path)
    return record


# ----------------------------------------------------------------------------- agreement
_BLOCK = 1 << 20


@dataclasses.dataclass
class _LineCount:
    """Lines of a file's first bytes: physical lines, and those that get a result (not
    blank: ASCII whitespace only, a byte-order mark ignored on line 1)."""

    lines: int = 0
    answered: int = 0
    ends_a_line: bool = True   # the last byte counted is a line's end (or none was)


def _count_lines(fh: BinaryIO, end: int) -> _LineCount:
    """:class:`_LineCount` of ``fh``'s bytes [0, end), read in bounded blocks."""
    count = _LineCount()
    fh.seek(0)
    left, pending, first = end, b"", True
    while left > 0:
        block = fh.read(min(_BLOCK, left))
        if not block:
            break
        left -= len(block)
        *ended, pending = (pending + block).split(b"\n")
        for line in ended:
            count.lines += 1
            count.answered += has_content(line, first)
            first = False
        if len(pending) > _BLOCK:   # keep only whether a long unfinished line has content
            pending = b"x" if has_content(pending, first) else b" "
    count.ends_a_line = not pending
    if pending:
        count.lines += 1
        count.answered += has_content(pending, first)
    return count


def _output_path(progress: str) -> str:
    return progress[:-len(PROGRESS_SUFFIX)] if progress.endswith(PROGRESS_SUFFIX) else progress


def _check_output(record: dict[str, Any], progress: str) -> None:
    """The output holds exactly ``lines_done`` whole lines up to ``output_offset``. An
    output shorter than that (or missing) is left to the command, which names it."""
    output, offset = _output_path(progress), record["output_offset"]
    try:
        with open(output, "rb") as fh:
            if os.fstat(fh.fileno()).st_size < offset:
                return
            count = _count_lines(fh, offset)
    except FileNotFoundError:
        return
    except OSError as exc:
        raise CommandError(f"output {output}: cannot be read ({exc.strerror or exc})") \
            from None
    if not count.ends_a_line:
        raise _refuse(progress, f"output_offset {offset} is not at the end of a line of "
                                f"{output} (it cuts result line {count.lines})")
    if count.lines != record["lines_done"]:
        raise _refuse(progress, f"lines_done is {record['lines_done']}, but {output} holds "
                                f"{count.lines} result lines up to output_offset {offset}")


def _same_input_file(record: dict[str, Any]) -> bool:
    """Whether the recorded input path still holds the recorded input (when it does not,
    :func:`check_same_input` refuses later, naming both)."""
    fingerprint = record["input"]
    try:
        current = input_fingerprint(fingerprint["path"])
    except OSError:
        return False
    return all(current[key] == fingerprint[key] for key in ("size", "mtime_ns", "head_sha256"))


def _check_input(record: dict[str, Any], progress: str) -> None:
    """The input's bytes up to ``input_offset`` end a line, hold ``input_line`` lines and
    ``lines_done`` lines that get a result."""
    source, offset = record["input"]["path"], record["input_offset"]
    with open(source, "rb") as fh:
        count = _count_lines(fh, offset)
        at_end = offset == os.fstat(fh.fileno()).st_size
    if not (count.ends_a_line or at_end):
        raise _refuse(progress, f"input_offset {offset} is not at the end of a line of "
                                f"{source} (it cuts line {count.lines})")
    if count.lines != record["input_line"]:
        raise _refuse(progress, f"input_line is {record['input_line']}, but {source} has "
                                f"{count.lines} lines up to input_offset {offset}")
    if count.answered != record["lines_done"]:
        raise _refuse(progress, f"lines_done is {record['lines_done']}, but {source} has "
                                f"{count.answered} non-blank lines up to input_offset {offset}")


def unanswered_line(path: str, offset: int) -> int | None:
    """The byte offset of the first non-blank byte of ``path`` at or after ``offset`` (a
    line still to answer), or None when only blank lines follow."""
    with open(path, "rb") as fh:
        fh.seek(offset)
        position = offset
        while block := fh.read(_BLOCK):
            stripped = block.lstrip()
            if stripped:
                return position + len(block) - len(stripped)
            position += len(block)
    return None


def check_against_files(record: dict[str, Any], progress: str) -> None:
    """Refuse a record whose offsets disagree with the output (``progress`` without
    :data:`PROGRESS_SUFFIX`) or with its input (when that is still the recorded file);
    downgrade an unfounded ``"complete": true`` to a resume, with a warning."""
    _check_output(record, progress)
    if not _same_input_file(record):
        return
    _check_input(record, progress)
    if record.get("complete") and unanswered_line(record["input"]["path"],
                                                  record["input_offset"]) is not None:
        log.warning("progress file %s says complete, but %s has lines after line %d (byte "
                    "%d) with no result: resuming from there", progress,
                    record["input"]["path"], record["input_line"], record["input_offset"])
        record["complete"] = False


def new_record(input_path: str, output_path: str, target: str) -> dict[str, Any]:
    """The progress record of a run that starts at the beginning of ``input_path``."""
    return {"format": PROGRESS_FORMAT, "input": input_fingerprint(input_path),
            "output": os.path.abspath(output_path), "target": target,
            "lines_done": 0, "input_line": 0, "input_offset": 0,
            "output_offset": 0, "errors": 0, "complete": False}


class IncompleteRun(RuntimeError):
    """A run that was to be marked complete has input lines left without a result (an
    error swallowed on the way, e.g. in a thread reading the input): the command fails
    (exit 1) with the progress kept, and a rerun resumes."""


def write_progress(path: str, record: dict[str, Any]) -> None:
    """Replace the progress record atomically: a kill leaves the old or the new one.

    A record marked complete is checked first: when its input has a non-blank line past
    ``input_offset``, it is written as not complete and :class:`IncompleteRun` is raised,
    so that no failure, wherever it happened, is recorded as a finished run."""
    if record.get("complete"):
        try:
            left = unanswered_line(record["input"]["path"], record["input_offset"])
        except OSError as exc:   # cannot tell: not recorded as done
            record["complete"] = False
            _replace(path, record)
            raise IncompleteRun(f"cannot check that every line of {record['input']['path']} "
                                f"is answered ({exc.strerror or exc}): not marking the run "
                                f"complete; progress kept in {path}") from None
        if left is not None:
            record["complete"] = False
            _replace(path, record)
            raise IncompleteRun(
                f"the run ended after input line {record['input_line']} of "
                f"{record['input']['path']}, but the input has more at byte {left} with no "
                f"result: not marking it complete ({record['lines_done']} results written); "
                f"progress kept in {path}: run the same command again to resume")
    _replace(path, record)


def _replace(path: str, record: dict[str, Any]) -> None:
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
    Lines keep their numbers in the whole file, in ``number`` and in their error.

    The arguments are checked here, on the caller's thread (ValueError), not when the
    first line is read: the lines are read on another thread (gRPC's sending thread),
    where an exception would end the input silently."""
    for name, value in (("start_line", start_line), ("start_offset", start_offset),
                        ("max_line_bytes", max_line_bytes)):
        if not _is_count(value):
            raise ValueError(f"input_lines: {name} must be an integer >= 0, got {value!r}")
    if (start_line == 0) != (start_offset == 0):
        raise ValueError(f"input_lines: line {start_line} cannot end at byte {start_offset}")
    seekable = getattr(raw, "seekable", None)
    position = raw.tell() if seekable is not None and seekable() else start_offset
    if position != start_offset:
        raise ValueError(f"input_lines: the input is at byte {position}, not at start_offset "
                         f"{start_offset}")
    return _lines_after(raw, start_line, start_offset, max_line_bytes)


def _lines_after(raw: BinaryIO, start_line: int, start_offset: int, max_line_bytes: int
                 ) -> Iterator[tuple[JsonlLine, int]]:
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
