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

Why a module of its own: what a progress record holds and how an input is recognised and
resumed is one format, apart from the network (:mod:`serving.score_transport`) and from
the command's rules (:mod:`serving.remote_score`).
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any, BinaryIO, Iterator

from serving.jsonl import CommandError, JsonlLine, read_lines

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


def new_record(input_path: str, output_path: str, target: str) -> dict[str, Any]:
    """The progress record of a run that starts at the beginning of ``input_path``."""
    return {"format": PROGRESS_FORMAT, "input": input_fingerprint(input_path),
            "output": os.path.abspath(output_path), "target": target,
            "lines_done": 0, "input_line": 0, "input_offset": 0,
            "output_offset": 0, "errors": 0, "complete": False}


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
