"""Sharded scoring runs without Ray: ``moejax score INPUT --shard I/N -o OUT`` scores one
deterministic part of the input, so that a SLURM array or a Kubernetes Indexed Job can run
the N parts anywhere, and ``moejax merge OUT_0 ... OUT_N-1 -o MERGED`` joins them.

The parts: the input's rows (a JSONL file's non-blank lines, a Parquet file's rows,
counted from 0) in slices of :data:`SLICE_ROWS`; shard I takes slices I, I + N, I + 2N, ...
(neighbouring rows, which often share a prompt prefix, stay together, and the parts are
the same size within a slice). Each result carries its input row in ``row``.

Each shard's output has a record beside it, ``OUT.shard`` (JSON,
:data:`RECORD_FORMAT`): the input (path, size, mtime, SHA-256 of its first MiB), the
shard and slice size, the input's row count, this shard's row and error counts, and
``complete``. It is written as the run starts (``complete: false``) and when it ends. A
rerun of a complete shard with the same input and shard does nothing; an incomplete one
(killed, failed) is scored again from its start: a Parquet output cut part-way has no
footer to resume from, and a shard is small enough to redo.

``moejax merge`` checks the records (all complete, one input, shards 0..N-1 of one N
each once, their rows adding up to the input's), then merges the outputs by ``row``
(each is in row order: a streaming k-way merge, bounded memory) and checks that every row
0..rows-1 appears exactly once; the merged output is what an unsharded run writes (no
``row``), JSONL or Parquet by its extension.
"""

from __future__ import annotations

import dataclasses
import heapq
import json
import os
from typing import Any, Iterator, Sequence

from serving.jsonl import CommandError, JsonlLine, format_result
from serving.score_progress import input_fingerprint
from serving.tables import (is_parquet, parquet_ids_integral, read_parquet_rows,
                            write_parquet_results)

SLICE_ROWS = 1024
RECORD_FORMAT = "moejax-score-shard/1"
RECORD_SUFFIX = ".shard"


@dataclasses.dataclass(frozen=True)
class Shard:
    """Shard ``index`` of ``count`` (``I/N`` on the command line)."""

    index: int
    count: int

    @classmethod
    def parse(cls, text: str) -> "Shard":
        """``"I/N"`` with 0 <= I < N (an argparse type: ValueError names the rule)."""
        parts = text.split("/")
        if len(parts) != 2 or not all(p.isdigit() for p in parts):
            raise ValueError(f"--shard {text!r}: expected I/N, e.g. 0/4")
        index, count = int(parts[0]), int(parts[1])
        if not 0 <= index < count:
            raise ValueError(f"--shard {text!r}: I must lie in [0, N)")
        return cls(index, count)

    def holds(self, row: int, slice_rows: int = SLICE_ROWS) -> bool:
        return (row // slice_rows) % self.count == self.index

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def shard_chunks(lines: Iterator[JsonlLine], shard: Shard, size: int,
                 slice_rows: int = SLICE_ROWS) -> Iterator[tuple[list[int], list[JsonlLine]]]:
    """(input rows, lines) of this shard, up to ``size`` at a time, in row order."""
    rows: list[int] = []
    chunk: list[JsonlLine] = []
    for row, line in enumerate(lines):
        if not shard.holds(row, slice_rows):
            continue
        rows.append(row)
        chunk.append(line)
        if len(chunk) >= size:
            yield rows, chunk
            rows, chunk = [], []
    if chunk:
        yield rows, chunk


class CountedRows:
    """An iterator of input lines that counts them: a shard's record holds the input's row
    count, which only a pass over every row (its own or not) learns."""

    def __init__(self, lines: Iterator[JsonlLine]):
        self._lines = iter(lines)
        self.count = 0

    def __iter__(self) -> "CountedRows":
        return self

    def __next__(self) -> JsonlLine:
        line = next(self._lines)
        self.count += 1
        return line


# ----------------------------------------------------------------------------- records
def record_path(output: str) -> str:
    return output + RECORD_SUFFIX


def new_record(input_path: str, shard: Shard) -> dict[str, Any]:
    return {"format": RECORD_FORMAT, "input": input_fingerprint(input_path),
            "shard": [shard.index, shard.count], "slice_rows": SLICE_ROWS,
            "rows_total": None, "rows": 0, "errors": 0, "complete": False}


def write_record(output: str, record: dict[str, Any]) -> None:
    """Replace the record atomically (a reader sees the old one or the new one)."""
    path = record_path(output)
    temporary = path + ".tmp"
    with open(temporary, "w", encoding="utf-8") as fh:
        json.dump(record, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(temporary, path)


def read_record(output: str) -> dict[str, Any] | None:
    """The record beside ``output`` (None when there is none); CommandError naming it when
    it is not one."""
    path = record_path(output)
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8") as fh:
            record = json.load(fh)
    except (OSError, ValueError) as exc:
        raise CommandError(f"{path}: not a shard record ({exc})") from None
    if not isinstance(record, dict) or record.get("format") != RECORD_FORMAT:
        raise CommandError(f"{path}: not a shard record (format {RECORD_FORMAT} expected)")
    return record


def already_complete(input_path: str, output: str, shard: Shard) -> bool:
    """Whether a previous run of this shard of this input finished (its output is there)."""
    record = read_record(output)
    return (record is not None and record.get("complete") is True
            and record.get("shard") == [shard.index, shard.count]
            and record.get("slice_rows") == SLICE_ROWS and os.path.exists(output)
            and record.get("input") == input_fingerprint(input_path))


# ----------------------------------------------------------------------------- merge
def _rows_of(path: str) -> Iterator[dict[str, Any]]:
    """The results of one shard output, in its (row) order."""
    if is_parquet(path):
        yield from read_parquet_rows(path)
        return
    with open(path, encoding="utf-8") as fh:
        for number, text in enumerate(fh, start=1):
            try:
                yield json.loads(text)
            except ValueError as exc:
                raise CommandError(f"{path}: line {number} is not a result ({exc})") from None


def check_records(outputs: Sequence[str]) -> int:
    """The input's row count, once the shards' records agree (module docstring); else
    CommandError naming the shard and the problem."""
    records = []
    for output in outputs:
        record = read_record(output)
        if record is None:
            raise CommandError(f"{output}: no shard record ({record_path(output)}): not the "
                               f"output of moejax score --shard")
        if record.get("complete") is not True:
            raise CommandError(f"{output}: shard {record['shard'][0]}/{record['shard'][1]} "
                               f"is not complete: run it again")
        records.append((output, record))
    first_output, first = records[0]
    count = first["shard"][1]
    for output, record in records[1:]:
        if record["input"] != first["input"]:
            raise CommandError(f"{output} and {first_output} score different inputs "
                               f"({record['input'].get('path')} and "
                               f"{first['input'].get('path')})")
        if record["shard"][1] != count or record["slice_rows"] != first["slice_rows"]:
            raise CommandError(f"{output} is shard {record['shard'][0]}/{record['shard'][1]}"
                               f" and {first_output} shard {first['shard'][0]}/{count}: one "
                               f"run's shards only")
    seen = sorted(record["shard"][0] for _, record in records)
    if seen != list(range(count)):
        missing = sorted(set(range(count)) - set(seen))
        twice = sorted({i for i in seen if seen.count(i) > 1})
        raise CommandError(f"the shards must be 0..{count - 1} once each: "
                           + (f"missing {missing}" if missing else f"given twice {twice}"))
    total = first["rows_total"]
    if sum(record["rows"] for _, record in records) != total:
        raise CommandError(f"the shards hold {sum(r['rows'] for _, r in records)} rows, the "
                           f"input {total}")
    return total


def merged_rows(outputs: Sequence[str], total: int) -> Iterator[dict[str, Any]]:
    """Every shard's results in row order, without ``row``; CommandError at the first row
    missing, repeated or out of range."""
    streams = [((row["row"], index, row) for row in _rows_of(path))
               for index, path in enumerate(outputs)]
    expected = 0
    for row, index, result in heapq.merge(*streams, key=lambda entry: entry[:2]):
        if not isinstance(row, int) or row != expected:
            problem = ("repeated" if isinstance(row, int) and row < expected
                       else f"missing (the next is {row})")
            raise CommandError(f"row {expected} is {problem} in the shards' outputs "
                               f"({outputs[index]})")
        expected += 1
        yield {k: v for k, v in result.items() if k != "row"}
    if expected != total:
        raise CommandError(f"the shards' outputs end at row {expected}, the input has "
                           f"{total} rows")


def write_merged(outputs: Sequence[str], output: str) -> int:
    """Merge the shards' outputs into ``output``; returns the row count."""
    total = check_records(outputs)
    rows = merged_rows(outputs, total)
    if is_parquet(output):
        return write_parquet_results(output, rows, _integral_ids(outputs))
    count = 0
    temporary = output + ".tmp"
    with open(temporary, "w", encoding="utf-8", newline="\n") as sink:
        for result in rows:
            sink.write(format_result(result))
            count += 1
    os.replace(temporary, output)
    return count


def _integral_ids(outputs: Sequence[str]) -> bool:
    """Whether the shards' Parquet outputs hold integral ids (JSONL ones: no)."""
    parquet = [p for p in outputs if is_parquet(p)]
    return bool(parquet) and parquet_ids_integral(parquet[0])


__all__ = ("CountedRows", "RECORD_FORMAT", "SLICE_ROWS", "Shard", "already_complete", "check_records",
           "merged_rows", "new_record", "read_record", "record_path", "shard_chunks",
           "write_merged", "write_record")
