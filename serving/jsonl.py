"""The JSONL input and output of ``moejax score``, ``moejax generate`` and ``moejax client
score``, hardened against hostile or careless input.

The three commands read and write the same format, so they share one reader, one writer
and one set of checks (here), and a bad line is answered the same way by all of them.

Input
    * Lines end at ``\\n`` (``\\r\\n`` ends a line too; a bare ``\\r`` is part of the
      line), for a file and for stdin alike: the input is read as bytes, not through
      Python's universal newlines. A UTF-8 byte-order mark at the start is skipped.
    * Lines are numbered from 1, counting every physical line, blank ones included.
      A blank line (ASCII whitespace only) gets no result; every other line gets one.
    * A line longer than the limit (``--max-line-mib``, default
      :data:`DEFAULT_MAX_LINE_MIB` MiB) gets an error result and is skipped: it is read
      in bounded pieces and never held whole in memory.
    * A line that is not UTF-8, not JSON, JSON nested deeper than :data:`MAX_JSON_DEPTH`
      levels, an object with a duplicate key, a string holding a lone surrogate (a
      ``\\udc80`` escape: not Unicode text), or not a JSON object gets an error result
      ``"line N: problem"``; the other lines still run.
    * An id-less request is named by its line in error messages (``"line 3: prompt: is
      empty"``); a request with an id is named by it (``"request 'a': ..."``).

Output
    One JSON object per line, UTF-8, or ``\\u`` escapes for what the sink cannot encode
    (a lone surrogate in an id echoed by a library result, a non-UTF-8 stdout), so that
    writing a result never fails on its content.

Files
    Checked before any model loads (the commands call :func:`open_jsonl` first): the
    input must be a readable file (or ``-``), the output (``-o``, default stdout) must be
    writable and must not be the input file (the same inode: ``-o`` through a symlink or
    a hard link included), which writing would truncate before it is read. Failures
    raise :class:`CommandError`: the commands print it on one line and exit 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import os
import stat
import sys
from typing import Any, BinaryIO, Callable, Iterator, Sequence, TextIO, TypeVar

from serving.requests import renamed, text_problem

DEFAULT_MAX_LINE_MIB = 16.0
"""Longest input line accepted, in MiB (``--max-line-mib``): a request of a few million
tokens fits; a runaway line is refused before it is held in memory."""
MAX_JSON_DEPTH = 64
"""Deepest JSON nesting accepted in a line (a valid request nests 3 levels); deeper
lines are refused before any validation code recurses into them."""

_BOM = b"\xef\xbb\xbf"
_SKIP_PIECE = 1 << 20   # bytes read at a time while skipping the rest of an over-long line
_MIB = 1 << 20


class CommandError(ValueError):
    """A problem with the command's files, found before any work: one line, exit 2."""


@dataclasses.dataclass(frozen=True)
class JsonlLine:
    """One non-blank input line: its 1-based number, and the request object or the reason
    it cannot be run (exactly one of ``request`` and ``error`` is set)."""

    number: int
    request: dict[str, Any] | None = None
    error: str | None = None
    unit: str = "line"      # how messages name it: "line 3"; a Parquet row: "row 7"


# ----------------------------------------------------------------------------- options
def positive_number(unit: str) -> Callable[[str], float]:
    """An argparse type: a finite number of ``unit`` > 0 (fractions allowed)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be a number of {unit}, got {text!r}") \
                from None
        if not value > 0 or value == float("inf"):
            raise argparse.ArgumentTypeError(f"must be a positive number of {unit}, got {text}")
        return value

    parse.__name__ = f"positive {unit}"   # argparse names the type in its messages
    return parse


positive_mib = positive_number("MiB")     # a size in MiB


def add_line_limit_option(p: argparse.ArgumentParser) -> None:
    """``--max-line-mib``, shared by the JSONL commands."""
    p.add_argument("--max-line-mib", type=positive_mib, default=DEFAULT_MAX_LINE_MIB,
                   help=f"longest input line, in MiB; a longer line gets an error result "
                        f"and is skipped without being held in memory "
                        f"(default {DEFAULT_MAX_LINE_MIB:g})")


# ----------------------------------------------------------------------------- parsing
class _DuplicateKey(ValueError):
    def __init__(self, key: str):
        super().__init__(key)
        self.key = key


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook``: JSON lets a key repeat and ``json`` keeps the last one, which
    would silently score a request other than the one the user thinks they wrote."""
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise _DuplicateKey(key)
        obj[key] = value
    return obj


def _short(text: str, limit: int = 60) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


def _tree_problem(obj: Any) -> str | None:
    """The first problem of a parsed line: nesting deeper than MAX_JSON_DEPTH, or a key or
    string that is not Unicode text (named by its path, e.g. ``candidates[1]``). Walked
    with an explicit stack: the point is not to recurse."""
    stack: list[tuple[Any, int, str]] = [(obj, 1, "")]
    while stack:
        value, depth, path = stack.pop()
        if isinstance(value, str):
            problem = text_problem(value)
            if problem is not None:
                return f"{path}: {problem}"
            continue
        if depth > MAX_JSON_DEPTH:
            return f"invalid JSON: nested too deeply (more than {MAX_JSON_DEPTH} levels)"
        if isinstance(value, dict):
            for key, item in value.items():
                problem = text_problem(key)
                if problem is not None:
                    return f"{path or 'object'}: key {_short(repr(key))} {problem}"
                if isinstance(item, (dict, list, str)):
                    stack.append((item, depth + 1, f"{path}.{key}" if path else key))
        else:
            for i, item in enumerate(value):
                if isinstance(item, (dict, list, str)):
                    stack.append((item, depth + 1, f"{path}[{i}]"))
    return None


def parse_line(number: int, raw: bytes) -> JsonlLine:
    """The request of one non-blank line (without its line ending), or why it has none."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return JsonlLine(number, error=f"line {number}: invalid UTF-8 (byte "
                                       f"0x{raw[exc.start]:02x} at offset {exc.start})")
    try:
        obj = json.loads(text, object_pairs_hook=_unique_keys)
    except _DuplicateKey as exc:
        return JsonlLine(number, error=f"line {number}: duplicate key {_short(repr(exc.key))}")
    except json.JSONDecodeError as exc:
        return JsonlLine(number, error=f"line {number}: invalid JSON: {exc.msg} "
                                       f"(column {exc.colno})")
    except RecursionError:
        return JsonlLine(number, error=f"line {number}: invalid JSON: nested too deeply "
                                       f"(more than {MAX_JSON_DEPTH} levels)")
    except ValueError as exc:   # e.g. an integer of more digits than Python converts
        return JsonlLine(number, error=f"line {number}: invalid JSON: {_short(str(exc), 200)}")
    if not isinstance(obj, dict):
        return JsonlLine(number, error=f"line {number}: expected a JSON object, got "
                                       f"{type(obj).__name__}")
    problem = _tree_problem(obj)
    if problem is not None:
        return JsonlLine(number, error=f"line {number}: {problem}")
    return JsonlLine(number, request=obj)


def _strip_ending(raw: bytes) -> bytes:
    if raw.endswith(b"\r\n"):
        return raw[:-2]
    return raw[:-1] if raw.endswith(b"\n") else raw


def _skip_rest_of_line(stream: BinaryIO) -> None:
    """Read and drop the rest of the current line, a bounded piece at a time."""
    while True:
        piece = stream.readline(_SKIP_PIECE)
        if not piece or piece.endswith(b"\n"):
            return


def _without_bom(raw: bytes, first_line: bool) -> bytes:
    """A line's bytes without the UTF-8 byte-order mark, which only line 1 may carry."""
    return raw[len(_BOM):] if first_line and raw.startswith(_BOM) else raw


def has_content(raw: bytes, first_line: bool) -> bool:
    """Whether a line (its bytes without the ending) gets a result: not blank (ASCII
    whitespace only), a byte-order mark ignored on line 1 (the rule of :func:`read_lines`)."""
    return bool(_without_bom(raw, first_line).strip())


def read_lines(stream: BinaryIO, max_line_bytes: int) -> Iterator[JsonlLine]:
    """One :class:`JsonlLine` per non-blank line of a binary stream, in order (see the
    module docstring for the rules)."""
    limit = max_line_bytes + 2   # room for the "\r\n" that ends a line of the maximum size
    number = 0
    while True:
        raw = stream.readline(limit)
        if not raw:
            return
        number += 1
        too_long = len(raw) == limit and not raw.endswith(b"\n")
        if too_long:
            _skip_rest_of_line(stream)
        else:
            raw = _without_bom(_strip_ending(raw), number == 1)
            too_long = len(raw) > max_line_bytes
        if too_long:
            yield JsonlLine(number, error=f"line {number}: longer than the limit of "
                                          f"{max_line_bytes / _MIB:g} MiB (--max-line-mib); "
                                          f"skipped")
        elif raw.strip():
            yield parse_line(number, raw)


def chunks(lines: Iterator[JsonlLine], size: int) -> Iterator[list[JsonlLine]]:
    """Lists of up to ``size`` lines, in order (chunks bound memory on huge inputs)."""
    chunk: list[JsonlLine] = []
    for line in lines:
        chunk.append(line)
        if len(chunk) >= size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


# ----------------------------------------------------------------------------- naming
def name_by_line(error: str | None, index: int, number: int, unit: str = "line"
                 ) -> str | None:
    """The libraries name an id-less request ``request #INDEX`` (its position in the list
    they were given); the commands name it by its input line instead, which the user can
    find: ``"request #0: prompt: is empty"`` -> ``"line 3: prompt: is empty"`` (a Parquet
    row: ``"row 2: ..."``)."""
    return renamed(error, index, f"{unit} {number}")


R = TypeVar("R")


def run_chunk(chunk: Sequence[JsonlLine], run: Callable[[list[dict[str, Any]]], Sequence[R]],
              error_result: Callable[[str], R]) -> list[R]:
    """Results of one chunk in line order: a line's own problem as ``error_result(msg)``,
    the requests of the other lines run together by ``run`` (results with an ``error``
    attribute, renamed by :func:`name_by_line`)."""
    requests = [line.request for line in chunk if line.request is not None]
    done = list(run(requests))
    if len(done) != len(requests):
        raise RuntimeError(f"{len(done)} results for {len(requests)} requests")
    results: list[R] = []
    position = 0   # of the line's request in ``requests``: how the library named it
    for line in chunk:
        if line.error is not None:
            results.append(error_result(line.error))
            continue
        result: Any = done[position]
        result.error = name_by_line(result.error, position, line.number, line.unit)
        results.append(result)
        position += 1
    return results


# ----------------------------------------------------------------------------- output
def format_result(result: dict[str, Any], encoding: str | None = "utf-8") -> str:
    """One output line: UTF-8 JSON, or ASCII JSON (``\\u`` escapes) when ``encoding``
    cannot represent it (a lone surrogate, a non-UTF-8 stdout)."""
    text = json.dumps(result, ensure_ascii=False)
    try:
        text.encode(encoding or "utf-8")
    except (UnicodeEncodeError, LookupError):
        text = json.dumps(result, ensure_ascii=True)
    return text + "\n"


# ----------------------------------------------------------------------------- files
def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _fd_stat(stream: Any) -> os.stat_result | None:
    """fstat of a standard stream, None when it has no file descriptor (e.g. in tests)."""
    try:
        return os.fstat(stream.fileno())
    except (AttributeError, OSError, ValueError):
        return None


def open_input(path: str) -> tuple[BinaryIO, os.stat_result | None]:
    """The input as a binary stream and its stat (for the same-file check)."""
    if path == "-":
        buffer = getattr(sys.stdin, "buffer", None)
        if buffer is None:   # a text stream without bytes underneath (a test's StringIO)
            buffer = io.BytesIO(sys.stdin.read().encode("utf-8", "surrogateescape"))
        return buffer, _fd_stat(sys.stdin)
    if os.path.isdir(path):
        raise CommandError(f"input {path}: is a directory")
    try:
        source = open(path, "rb")
    except OSError as exc:
        raise CommandError(f"input {path}: {exc.strerror or exc}") from None
    return source, os.fstat(source.fileno())


class JsonlFiles:
    """The input and output of one JSONL command, checked and opened by :func:`open_jsonl`.

    The output file is opened (created if missing) at once, so that an unwritable ``-o``
    fails before the model loads, but truncated only by :meth:`start_output`, after the
    model has loaded: a command that fails to start leaves an existing file as it was
    (and removes the one it created)."""

    def __init__(self, input_path: str, output_path: str | None, max_line_mib: float):
        self.input_path = input_path
        self.output_path = None if output_path in (None, "-") else output_path
        self.max_line_bytes = max(1, int(max_line_mib * _MIB))
        self.source, in_stat = open_input(input_path)
        self._fd: int | None = None
        self._created = False
        self.sink: TextIO | None = None
        try:
            self._check_and_open_output(in_stat)
        except BaseException:
            self._close_source()
            raise

    def _check_and_open_output(self, in_stat: os.stat_result | None) -> None:
        regular_input = in_stat is not None and stat.S_ISREG(in_stat.st_mode)
        path = self.output_path
        if path is None:
            out_stat = _fd_stat(sys.stdout)
            if regular_input and out_stat is not None and _same_file(in_stat, out_stat):
                raise CommandError(f"the input {self.input_path} is also standard output: "
                                   f"writing the results would destroy it")
            return
        if os.path.isdir(path):
            raise CommandError(f"output {path}: is a directory")
        existed = os.path.exists(path)
        if existed and regular_input and _same_file(in_stat, os.stat(path)):
            raise CommandError(f"output {path} is the input file {self.input_path}: writing "
                               f"the results would destroy it (give another -o)")
        try:
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | getattr(os, "O_CLOEXEC", 0),
                               0o666)
        except OSError as exc:
            raise CommandError(f"output {path}: {exc.strerror or exc}") from None
        self._created = not existed

    # ------------------------------------------------------------------ reading
    def lines(self) -> Iterator[JsonlLine]:
        """The non-blank lines of the input (see :func:`read_lines`)."""
        return read_lines(self.source, self.max_line_bytes)

    def chunks(self, size: int) -> Iterator[list[JsonlLine]]:
        """The non-blank lines in lists of up to ``size``."""
        return chunks(self.lines(), size)

    def count(self) -> int | None:
        """Non-blank lines of a regular input file, for a progress bar (None for stdin, a
        pipe, ...: counting those would consume them). Read in bounded blocks."""
        if self.input_path == "-" or not stat.S_ISREG(os.fstat(self.source.fileno()).st_mode):
            return None
        count, content = 0, False
        with open(self.input_path, "rb") as fh:
            while block := fh.read(_MIB):
                *ended, rest = block.split(b"\n")
                for piece in ended:
                    count += content or bool(piece.strip())
                    content = False
                content = content or bool(rest.strip())
        return count + content

    # ------------------------------------------------------------------ writing
    def start_output(self) -> None:
        """Truncate and open the output (call once the model has loaded)."""
        if self._fd is None:
            self.sink = sys.stdout
            return
        fd, self._fd = self._fd, None
        if stat.S_ISREG(os.fstat(fd).st_mode):
            os.ftruncate(fd, 0)
        self.sink = open(fd, "w", encoding="utf-8", newline="\n")

    def write(self, result: dict[str, Any]) -> None:
        """Write one result line (never fails on the result's content)."""
        assert self.sink is not None, "start_output() first"
        self.sink.write(format_result(result, getattr(self.sink, "encoding", None)))

    def flush(self) -> None:
        if self.sink is not None:
            self.sink.flush()

    # ------------------------------------------------------------------ closing
    def _close_source(self) -> None:
        if self.input_path != "-":
            self.source.close()

    def close(self, failed: bool = False) -> None:
        """Close what was opened here (stdout is flushed unless the command failed: a
        broken pipe would fail again)."""
        try:
            if self.sink is sys.stdout:
                if not failed:
                    self.sink.flush()
            elif self.sink is not None:
                self.sink.close()
            elif self._fd is not None:   # never started: leave no file behind
                os.close(self._fd)
                self._fd = None
                if self._created and self.output_path is not None:
                    os.unlink(self.output_path)
        finally:
            self._close_source()

    def __enter__(self) -> JsonlFiles:
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        self.close(failed=exc_type is not None)


def open_jsonl(input_path: str, output_path: str | None,
               max_line_mib: float = DEFAULT_MAX_LINE_MIB) -> JsonlFiles:
    """Check and open the files of a JSONL command (``-`` is stdin; None or ``-`` is
    stdout); raises :class:`CommandError`. Use it as a context manager."""
    return JsonlFiles(input_path, output_path, max_line_mib)
