"""Parquet in and out for ``moejax score`` (pyarrow: the ``parquet`` extra), beside JSONL.

A file is Parquet by its extension (:data:`PARQUET_SUFFIXES`), else JSONL; the input and
the output choose apart (JSONL in and Parquet out, and the reverse).

Input rows
    One request per row; the columns are the request's fields (``prompt``,
    ``prompt_token_ids`` as a list of integers, ``candidates``, ``candidate_token_ids``,
    ``kind``, ``normalize``, ``id``, ``messages``, ...) and a null cell is an absent
    field. Rows are read a record batch at a time (``--chunk-size`` rows), so memory stays
    bounded whatever the file's size. A row is named by its 0-based index (``"row 7:
    prompt: is empty"``) where a JSONL line is named by its number; the per-row error rules
    are those of JSONL (``serving.jsonl``): a bad row gets its error in its own result.

Output rows
    One result per row, in input order, with a fixed schema (:func:`result_schema`):
    ``id`` (int64 when the input's id column is integral, else string: JSON ids may mix
    types, a Parquet column cannot), ``logprobs``, ``label``, ``prompt_tokens``,
    ``error``, ``selected``, ``warnings``, the prompt_logprobs and head fields, the
    ``timings``, and ``row`` (the input row index) for a sharded run. A row group is
    written per chunk; a run that stops part-way leaves no readable file (Parquet writes
    its footer last), which is why sharded runs restart a shard whole (``serving.shards``).
"""

from __future__ import annotations

import os
from typing import Any, Iterator

from serving.jsonl import (CommandError, JsonlLine, chunks, format_result, open_input,
                           read_lines)

PARQUET_SUFFIXES = (".parquet", ".pq")
INSTALL_HINT = "Parquet needs pyarrow: pip install 'moejax[parquet]'"


def is_parquet(path: str | None) -> bool:
    """Whether ``path`` names a Parquet file (by its extension)."""
    return path is not None and path != "-" and path.lower().endswith(PARQUET_SUFFIXES)


def _pyarrow() -> tuple[Any, Any]:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise CommandError(INSTALL_HINT) from None
    return pa, pq


# ----------------------------------------------------------------------------- schema
def result_schema(id_integral: bool, with_row: bool) -> Any:
    """The Parquet schema of results (module docstring)."""
    pa, _ = _pyarrow()
    ints, floats = pa.list_(pa.int64()), pa.list_(pa.float64())
    fields = [("row", pa.int64())] if with_row else []
    fields += [("id", pa.int64() if id_integral else pa.string()),
               ("logprobs", floats), ("label", pa.int64()), ("prompt_tokens", pa.int64()),
               ("error", pa.string()), ("selected", ints), ("warnings", pa.list_(pa.string())),
               ("token_ids", ints), ("top_token_ids", pa.list_(ints)),
               ("top_logprobs", pa.list_(floats)), ("scores", floats),
               ("timings", pa.struct([("engines", ints), ("rounds", ints),
                                      ("seconds", pa.float64())]))]
    return pa.schema(fields)


def _cell_id(value: Any, integral: bool) -> Any:
    if value is None or integral:
        return value
    return value if isinstance(value, str) else str(value)


# ----------------------------------------------------------------------------- whole files
def read_parquet_rows(path: str, batch_rows: int = 4096) -> Iterator[dict[str, Any]]:
    """The rows of a Parquet file as dicts, a record batch at a time."""
    _, pq = _pyarrow()
    for batch in pq.ParquetFile(path).iter_batches(batch_size=batch_rows):
        yield from batch.to_pylist()


def parquet_ids_integral(path: str) -> bool:
    """Whether a Parquet file's ``id`` column is integral."""
    pa, pq = _pyarrow()
    schema = pq.ParquetFile(path).schema_arrow
    return "id" in schema.names and pa.types.is_integer(schema.field("id").type)


def write_parquet_results(path: str, results: Iterator[dict[str, Any]], id_integral: bool,
                          group_rows: int = 4096) -> int:
    """Write results (dicts) to a Parquet file of :func:`result_schema` (without ``row``),
    a row group per ``group_rows``; returns the row count. Written to a temporary name
    and renamed: a reader never sees a part-written file."""
    pa, pq = _pyarrow()
    schema = result_schema(id_integral, with_row=False)
    temporary, count, group = path + ".tmp", 0, []
    with pq.ParquetWriter(temporary, schema) as writer:
        for result in results:
            group.append({name: result.get(name) for name in schema.names})
            count += 1
            if len(group) >= group_rows:
                writer.write_table(pa.Table.from_pylist(group, schema=schema))
                group = []
        if group:
            writer.write_table(pa.Table.from_pylist(group, schema=schema))
    os.replace(temporary, path)
    return count


# ----------------------------------------------------------------------------- files
class TableFiles:
    """The input and output of ``moejax score`` when either is Parquet (the same interface
    as :class:`serving.jsonl.JsonlFiles`, which serves JSONL to JSONL): checked and opened
    before the model loads, the output truncated only by :meth:`start_output`."""

    def __init__(self, input_path: str, output_path: str | None, max_line_mib: float,
                 with_row: bool = False):
        if is_parquet(input_path) or is_parquet(output_path):
            _pyarrow()                       # the install hint before anything else
        self.input_path, self.output_path = input_path, output_path
        self.with_row = with_row
        self._parquet_in: Any = None
        self._id_integral = False
        if is_parquet(input_path):
            self._open_parquet_input(input_path)
        else:
            self._max_line_bytes = max(1, int(max_line_mib * (1 << 20)))
            self._source, _ = open_input(input_path)
        self._check_output()
        self._writer: Any = None
        self._schema: Any = None
        self._sink: Any = None
        self._pending: list[dict[str, Any]] = []

    # ------------------------------------------------------------------ input
    def _open_parquet_input(self, path: str) -> None:
        pa, pq = _pyarrow()
        if os.path.isdir(path):
            raise CommandError(f"input {path}: is a directory")
        try:
            self._parquet_in = pq.ParquetFile(path)
        except (OSError, pa.ArrowException) as exc:
            raise CommandError(f"input {path}: not a readable Parquet file ({exc})") from None
        schema = self._parquet_in.schema_arrow
        if "id" in schema.names:
            self._id_integral = pa.types.is_integer(schema.field("id").type)

    def lines(self) -> Iterator[JsonlLine]:
        """One entry per input row (Parquet: every row; JSONL: every non-blank line)."""
        if self._parquet_in is None:
            return read_lines(self._source, self._max_line_bytes)
        return self._rows()

    def _rows(self) -> Iterator[JsonlLine]:
        row = 0
        for batch in self._parquet_in.iter_batches(batch_size=4096):
            for values in batch.to_pylist():
                request = {k: v for k, v in values.items() if v is not None}
                yield JsonlLine(row, request=request, unit="row")
                row += 1

    def chunks(self, size: int) -> Iterator[list[JsonlLine]]:
        return chunks(self.lines(), size)

    def count(self) -> int | None:
        """Rows of a Parquet input (from its footer), None for JSONL (the progress bar
        then shows no total)."""
        return None if self._parquet_in is None else self._parquet_in.metadata.num_rows

    # ------------------------------------------------------------------ output
    def _check_output(self) -> None:
        path = self.output_path
        if path in (None, "-"):
            return
        if os.path.isdir(path):
            raise CommandError(f"output {path}: is a directory")
        if os.path.exists(path) and self.input_path != "-" and \
                os.path.samefile(path, self.input_path):
            raise CommandError(f"output {path} is the input file {self.input_path}: writing "
                               f"the results would destroy it (give another -o)")
        directory = os.path.dirname(os.path.abspath(path))
        if not os.access(directory, os.W_OK):
            raise CommandError(f"output {path}: its directory is not writable")

    def start_output(self) -> None:
        """Open the output (after the model has loaded)."""
        path = self.output_path
        if is_parquet(path):
            _, pq = _pyarrow()
            self._schema = result_schema(self._id_integral, self.with_row)
            self._writer = pq.ParquetWriter(path, self._schema)
        elif path in (None, "-"):
            import sys

            self._sink = sys.stdout
        else:
            self._sink = open(path, "w", encoding="utf-8", newline="\n")

    def write(self, result: dict[str, Any]) -> None:
        """One result; Parquet rows are written a row group per :meth:`flush`."""
        if self._writer is None:
            self._sink.write(format_result(result, getattr(self._sink, "encoding", None)))
            return
        row = {**result, "id": _cell_id(result.get("id"), self._id_integral)}
        self._pending.append(row)

    def flush(self) -> None:
        if self._writer is not None and self._pending:
            pa, _ = _pyarrow()
            names = self._schema.names
            rows = [{name: row.get(name) for name in names} for row in self._pending]
            self._writer.write_table(pa.Table.from_pylist(rows, schema=self._schema))
            self._pending = []
        elif self._sink is not None:
            self._sink.flush()

    # ------------------------------------------------------------------ closing
    def close(self, failed: bool = False) -> None:
        try:
            if self._writer is not None:
                self.flush()
                self._writer.close()
            elif self._sink is not None and self.output_path not in (None, "-"):
                self._sink.close()
        finally:
            if self._parquet_in is None and self.input_path != "-":
                self._source.close()

    def __enter__(self) -> "TableFiles":
        return self

    def __exit__(self, exc_type: Any, *exc: Any) -> None:
        self.close(failed=exc_type is not None)


def open_score_files(input_path: str, output_path: str | None, max_line_mib: float,
                     with_row: bool = False) -> Any:
    """The files of ``moejax score``: :class:`serving.jsonl.JsonlFiles` for JSONL to JSONL
    (unsharded), else :class:`TableFiles`."""
    if not (is_parquet(input_path) or is_parquet(output_path) or with_row):
        from serving.jsonl import open_jsonl

        return open_jsonl(input_path, output_path, max_line_mib)
    return TableFiles(input_path, output_path, max_line_mib, with_row)


__all__ = ("INSTALL_HINT", "PARQUET_SUFFIXES", "TableFiles", "is_parquet",
           "open_score_files", "parquet_ids_integral", "read_parquet_rows", "result_schema",
           "write_parquet_results")
