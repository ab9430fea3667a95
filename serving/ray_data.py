"""Offline scoring and generation on Ray Data: one Scorer (or Generator) per actor, files
in and out, over one machine's devices or a whole cluster (the ``ray`` extra:
``pip install 'moejax[ray]'``).

Why Ray Data: a job of millions of requests wants every device of a cluster busy, actors
restarted and tasks retried when a node goes, and input read and output written while the
devices work. Ray Data does all of that; this module adds only what is moejax's: a model
built once per actor, the request schema over table columns, per-row errors, and the row
index. (One model too big for one host is ``moejax launch``'s job, not this module's.)

Three layers:

* :class:`BatchScorer` and :class:`BatchGenerator`: callable classes for
  ``Dataset.map_batches(..., batch_format="pyarrow")``. The constructor builds the Scorer
  (Generator) once per actor from ``model`` and an ``options`` dict (the Scorer's keywords:
  ``dtype``, ``backend``, ``devices``, ...); each call turns a batch of request rows into
  a batch of result rows.
* :func:`score` and :func:`generate`: the whole job from paths (JSONL or Parquet, local or
  any URI pyarrow.fs opens: ``s3://``, ``gs://``, ``hdfs://``, ...).
* ``moejax batch INPUT -o OUTPUT --ray [ADDRESS] --actors N`` (``serving.cli.batch``).

Batch format: pyarrow. A Parquet block reaches the actor without a copy, and a null cell
stays null (pandas would turn an integer column with nulls into floats, which the request
checks rightly refuse, and list cells into NumPy arrays).

Input rows
    One request per row; the columns are the request's fields (``prompt`` or
    ``prompt_token_ids`` or ``messages``, ``candidates`` or ``candidate_token_ids``,
    ``kind``, ``normalize``, ``id``, ...; a generation request's ``max_new_tokens``,
    ``temperature``, ...). An absent column or a null cell is an absent field (in a struct
    cell, e.g. a message, a null member too). Three columns are this module's own:
    ``row`` (the input row index, carried to the result), ``request_json`` (the whole
    request as one JSON object text, what the JSONL reader produces: JSON lines may mix
    types in a field, which a table column cannot) and ``read_error`` (the reason the
    reader could not make a request of the row).

Result rows
    ``row``, ``id``, then the result's fields: for scoring ``logprobs``, ``label``,
    ``prompt_tokens``, ``error``, ``selected``, ``warnings``, the ``prompt_logprobs`` and
    ``head`` fields and ``timings`` (the schema of ``moejax score --shard``,
    :func:`serving.tables.result_schema`); for generation ``token_ids``, ``text``,
    ``finish_reason``, ``prompt_tokens``, ``error``. ``id`` is int64 where the input's id
    column is integral, else a string (JSON ids may mix types; a column cannot).

Errors
    A bad request gets its error in its own row and the batch goes on: the library's own
    checks (``Scorer.score`` answers every request), and, before them, a row that cannot
    even become a request (a cell pyarrow cannot convert, a JSONL line that is not JSON).
    An id-less request is named by its row, ``"row 7: prompt: is empty"`` (as ``moejax
    score`` names a Parquet row), one with an id by it (``"request 'a': ..."``). A failure
    of the engine itself (not a request's fault) fails the task, which Ray retries.

Order and the row index
    ``row`` is the request's 0-based index in the input: the files in order (a directory's
    files sorted by path), within a Parquet file its rows, within a JSONL file its
    non-blank lines. Ray Data does not keep order by default and has no row index, so the
    driver plans the reading (a Parquet file's row counts come from its footer; a JSONL
    file's lines are found in one pass over its bytes) into read units of about
    ``batch_size`` rows, each read task numbers its unit's rows, and every result carries
    its ``row``. (The units also spread the rows over the actors: Ray Data joins what one
    task yields into one block, and a block goes to one actor.) :func:`score` and
    :func:`generate` also keep the input's order (``ordered=True``: Ray Data's
    ``preserve_order``) and write one output file on the driver, in row order, as
    ``moejax score`` does; ``ordered=False`` lets results come back as they finish (a slow
    batch then holds nothing up) and the rows are in any order: sort or join by ``row``.

How options reach the actors
    As plain values: ``fn_constructor_kwargs={"model": ..., "options": {...}}``, pickled by
    Ray and handed to every actor's constructor, which sets the XLA flags (the GPU overlap
    flags on an actor with GPUs, host devices for ``devices`` > 1 on CPU) before JAX starts
    in that process and then builds the Scorer.
    They are checked on the driver first, so that a typo fails at once instead of in every
    actor. An actor sees the GPUs Ray gave it (``num_gpus=gpus_per_actor``). With a
    ``compilation_cache``, an actor keeps every program it compiles there (not only those
    over JAX's one second), so the node's other actors and the next job load them.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import io
import json
import os
import sys
import time
from typing import Any, Callable, Iterator, Mapping, Sequence

from serving.jsonl import DEFAULT_MAX_LINE_MIB, CommandError, format_result, read_lines
from serving.requests import renamed

INSTALL_HINT = "serving.ray_data needs Ray Data and pyarrow: pip install 'moejax[ray]'"
BATCH_FORMAT = "pyarrow"
DEFAULT_BATCH_SIZE = 1024       # rows per actor call (and per read unit)
ROW, REQUEST_JSON, READ_ERROR = "row", "request_json", "read_error"
LOCAL = "local"          # ray_address: a new cluster on this machine
OWN_COLUMNS = (ROW, REQUEST_JSON, READ_ERROR)
PARQUET_SUFFIXES = (".parquet", ".pq")
JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
# A large Parquet row group is read in at most this many slices (read units).
MAX_SLICES_PER_GROUP = 64
_BOM = b"\xef\xbb\xbf"
MIN_COMPILE_TIME_ENV = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"
# Score result fields that a JSONL line holds only when set (as ScoreResult.to_dict).
OPTIONAL_SCORE_FIELDS = ("selected", "warnings", "token_ids", "top_token_ids",
                         "top_logprobs", "scores", "timings")


# ----------------------------------------------------------------------------- imports
def require_ray() -> Any:
    """The ``ray`` module with Ray Data, or ImportError with the one-line install hint."""
    try:
        import pyarrow  # noqa: F401
        import ray
        import ray.data  # noqa: F401
    except ImportError:
        raise ImportError(INSTALL_HINT) from None
    return ray


def _pyarrow() -> Any:
    try:
        import pyarrow
        import pyarrow.parquet  # noqa: F401
    except ImportError:
        raise ImportError(INSTALL_HINT) from None
    return pyarrow


# ----------------------------------------------------------------------------- request rows
@dataclasses.dataclass
class _Entry:
    """One input row on its way to the engine: its index, how messages name it, and its
    request or the reason it has none (exactly one of ``request`` and ``error``)."""

    row: int | None
    label: str
    request: dict[str, Any] | None = None
    error: str | None = None


def _without_nulls(value: Any) -> Any:
    """A cell as Python, a struct's null members dropped (a null field is an absent field,
    in a message or a ``templates`` struct as in a top-level column)."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def _first_line(exc: BaseException) -> str:
    text = next(iter(str(exc).splitlines()), "")[:200]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _row_or_problem(table: Any, index: int) -> dict[str, Any] | str:
    """Row ``index`` as a request dict, or why one of its cells cannot be read."""
    request: dict[str, Any] = {}
    for name in table.column_names:
        try:
            value = table.column(name)[index].as_py()
        except Exception as exc:  # noqa: BLE001  (any type pyarrow cannot make Python of)
            return f"column {name!r}: cannot be read ({_first_line(exc)})"
        if value is not None:
            request[name] = _without_nulls(value)
    return request


def _field_rows(table: Any) -> list[dict[str, Any] | str]:
    """Every row of the request columns as a dict (null cells left out), or for a row that
    cannot be converted, the reason: the whole table at once, row by row only when that
    fails (so one bad cell costs its own row, not the batch)."""
    try:
        rows = table.to_pylist()
    except Exception:  # noqa: BLE001
        return [_row_or_problem(table, i) for i in range(table.num_rows)]
    return [{k: _without_nulls(v) for k, v in row.items() if v is not None} for row in rows]


def _column(table: Any, name: str) -> list[Any] | None:
    return table.column(name).to_pylist() if name in table.column_names else None


def _json_request(text: str, label: str) -> tuple[dict[str, Any] | None, str | None]:
    try:
        request = json.loads(text)
    except ValueError as exc:
        return None, f"{label}: request_json: invalid JSON ({_first_line(exc)})"
    if not isinstance(request, dict):
        return None, f"{label}: request_json: expected a JSON object, got {type(request).__name__}"
    return request, None


def batch_entries(batch: Any) -> list[_Entry]:
    """The rows of a pyarrow batch as entries (module docstring, "Input rows"). A batch
    without a ``row`` column names its id-less rows by their position in the batch."""
    n = batch.num_rows
    rows = _column(batch, ROW) or [None] * n
    read_errors = _column(batch, READ_ERROR) or [None] * n
    texts = _column(batch, REQUEST_JSON) or [None] * n
    fields = _field_rows(batch.drop_columns([c for c in OWN_COLUMNS if c in batch.column_names]))
    entries = []
    for i in range(n):
        label = f"row {rows[i]}" if rows[i] is not None else f"request #{i}"
        entry = _Entry(rows[i], label)
        if read_errors[i] is not None:
            entry.error = read_errors[i]
        elif texts[i] is not None:
            entry.request, entry.error = _json_request(texts[i], label)
        elif isinstance(fields[i], str):
            entry.error = f"{label}: {fields[i]}"
        else:
            entry.request = fields[i]
        entries.append(entry)
    return entries


# ----------------------------------------------------------------------------- result rows
def _id_cell(value: Any, integral: bool) -> Any:
    if value is None:
        return None
    if integral:
        return value if isinstance(value, int) and not isinstance(value, bool) else None
    return value if isinstance(value, str) else str(value)


def _integral_ids(batch: Any) -> bool:
    """Whether a batch's ids are an integer column (the JSON text of a JSONL row is not)."""
    pa = _pyarrow()
    return ("id" in batch.column_names and REQUEST_JSON not in batch.column_names
            and pa.types.is_integer(batch.schema.field("id").type))


def generation_schema(integral_ids: bool) -> Any:
    """The result columns of :class:`BatchGenerator`."""
    pa = _pyarrow()
    return pa.schema([(ROW, pa.int64()), ("id", pa.int64() if integral_ids else pa.string()),
                      ("token_ids", pa.list_(pa.int64())), ("text", pa.string()),
                      ("finish_reason", pa.string()), ("prompt_tokens", pa.int64()),
                      ("error", pa.string())])


def score_schema(integral_ids: bool) -> Any:
    """The result columns of :class:`BatchScorer`: ``moejax score --shard``'s."""
    from serving.tables import result_schema

    _pyarrow()
    return result_schema(integral_ids, with_row=True)


def _host_devices(options: Mapping[str, Any]) -> int:
    return max(options.get("devices") or 1, options.get("engines") or 1,
               options.get("decoders") or 1)


def _has_gpus() -> bool:
    """Whether Ray gave this process GPUs (False outside a Ray worker)."""
    try:
        import ray
    except ImportError:
        return False
    return ray.is_initialized() and bool(ray.get_gpu_ids())


def _configure_xla(options: Mapping[str, Any]) -> None:
    """This actor's XLA flags, as the moejax commands set them, but only those that act
    here: the GPU overlap flags on an actor with GPUs, the CPU host devices when the
    options ask for several. A flag that does nothing still changes XLA_FLAGS, which is
    part of every key of JAX's compilation cache: a CPU actor would then find none of the
    programs a CPU process without it compiled."""
    from moejax.backends.xla_flags import apply_host_device_count, apply_overlap_flags

    if _has_gpus():
        apply_overlap_flags()
    apply_host_device_count(_host_devices(options))


def _keep_every_compiled_program() -> None:
    """In an actor (a process of its own): let JAX's persistent compilation cache, when the
    options turn it on, keep programs however fast they compiled (JAX keeps only those over
    a second), so that the other actors of a node, a restarted actor and the next job load
    them instead of compiling them again. A value set in the environment is kept."""
    if MIN_COMPILE_TIME_ENV in os.environ:
        return
    import jax

    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)


class _BatchRunner(abc.ABC):
    """What :class:`BatchScorer` and :class:`BatchGenerator` share: the engine built once
    per actor, rows in, result rows out, one bad row never sinking its batch."""

    def __init__(self, model: str = "demo", options: Mapping[str, Any] | None = None,
                 integral_ids: bool | None = None):
        _pyarrow()
        options = dict(options or {})
        _configure_xla(options)          # before JAX starts here: XLA reads its flags once
        _keep_every_compiled_program()
        self.integral_ids = integral_ids
        started = time.perf_counter()
        self.engine = self._build(model, options)
        self.startup_seconds = time.perf_counter() - started

    @abc.abstractmethod
    def _build(self, model: str, options: dict[str, Any]) -> Any:
        """The engine (a Scorer or a Generator) of ``model`` with ``options``."""

    @abc.abstractmethod
    def _run(self, requests: list[dict[str, Any]]) -> list[Any]:
        """One result per request, in order."""

    @abc.abstractmethod
    def _failed(self, error: str) -> Any:
        """The result of a row that could not become a request."""

    @abc.abstractmethod
    def _schema(self, integral_ids: bool) -> Any:
        """The result columns."""

    def __call__(self, batch: Any) -> Any:
        pa = _pyarrow()
        if not isinstance(batch, pa.Table):
            raise TypeError(f"{type(self).__name__} takes pyarrow batches: map_batches(..., "
                            f"batch_format={BATCH_FORMAT!r}), got {type(batch).__name__}")
        integral = self.integral_ids if self.integral_ids is not None else _integral_ids(batch)
        entries = batch_entries(batch)
        records = [self._record(result, entry.row, integral)
                   for entry, result in zip(entries, self._results(entries))]
        return pa.Table.from_pylist(records, schema=self._schema(integral))

    def _results(self, entries: list[_Entry]) -> list[Any]:
        """One result per entry, in order: the requests run together, each error named by
        the entry's label (the library names an id-less request by its position in the
        list it was given)."""
        requests = [entry.request for entry in entries if entry.request is not None]
        done = self._run(requests) if requests else []
        if len(done) != len(requests):
            raise RuntimeError(f"{len(done)} results for {len(requests)} requests")
        results, position = [], 0
        for entry in entries:
            if entry.request is None:
                results.append(self._failed(entry.error))
                continue
            result = done[position]
            result.error = renamed(result.error, position, entry.label)
            results.append(result)
            position += 1
        return results

    @staticmethod
    def _record(result: Any, row: int | None, integral: bool) -> dict[str, Any]:
        record = result.to_dict()
        record[ROW] = row
        record["id"] = _id_cell(record.get("id"), integral)
        return record


class BatchScorer(_BatchRunner):
    """``Dataset.map_batches(BatchScorer, fn_constructor_kwargs={"model": ..., "options":
    {...}}, batch_format="pyarrow", ...)``: a :class:`serving.Scorer` per actor, a batch of
    request rows in, their :func:`score_schema` rows out (module docstring).
    ``integral_ids``: the ``id`` column's type (int64 or string); None decides per batch,
    from its ``id`` column (fix it when batches may differ, or the blocks' schemas will)."""

    def _build(self, model: str, options: dict[str, Any]) -> Any:
        from serving import Scorer

        return Scorer(model, **options)

    def _run(self, requests: list[dict[str, Any]]) -> list[Any]:
        return self.engine.score(requests, progress=False)

    def _failed(self, error: str) -> Any:
        from serving.requests import ScoreResult

        return ScoreResult(error=error)

    def _schema(self, integral_ids: bool) -> Any:
        return score_schema(integral_ids)


class BatchGenerator(_BatchRunner):
    """The same as :class:`BatchScorer` for generation: a :class:`serving.Generator` per
    actor, :func:`generation_schema` rows out (``token_ids``, ``text``, ``finish_reason``,
    ``prompt_tokens``, ``error``)."""

    def _build(self, model: str, options: dict[str, Any]) -> Any:
        from serving import Generator

        _refuse_expert_traces(options)
        return Generator(model, **options)

    def _run(self, requests: list[dict[str, Any]]) -> list[Any]:
        return self.engine.generate(requests)

    def _failed(self, error: str) -> Any:
        from serving.generate import GenerationResult

        return GenerationResult(error=error)

    def _schema(self, integral_ids: bool) -> Any:
        return generation_schema(integral_ids)


def _refuse_expert_traces(options: Mapping[str, Any]) -> None:
    if options.get("trace_experts") or options.get("trace_router_inputs"):
        raise ValueError("trace_experts: the batch results hold no expert traces; record "
                         "them with `moejax trace`")


# ----------------------------------------------------------------------------- input plan
@dataclasses.dataclass(frozen=True)
class ReadUnit:
    """One read task's share of the input, about ``batch_size`` rows: a task's output
    reaches the actors as one block (Ray Data merges the pieces a task yields), so the
    units, not the reader, decide how the rows spread over the actors."""

    filesystem: int          # index into the plan's filesystems
    path: str
    format: str              # "parquet" | "jsonl"
    first_row: int           # the input row index of its first request
    rows: int
    row_groups: tuple[int, ...] = ()    # Parquet: the row groups it reads
    skip: int = 0                       # Parquet: rows of its first group before it
    offset: int = 0                     # JSONL: the byte offset of its first line
    first_line: int = 1                 # JSONL: that line's number in the file


@dataclasses.dataclass(frozen=True)
class InputPlan:
    """What the driver knows of the input before any actor starts."""

    units: list[ReadUnit]
    filesystems: list[Any]
    rows: int
    integral_ids: bool
    local: bool              # every file on this machine's file system


def file_format(path: str, role: str) -> str:
    """"parquet" or "jsonl" by the extension of ``path``, else CommandError naming it."""
    lower = path.lower()
    if lower.endswith(PARQUET_SUFFIXES):
        return "parquet"
    if lower.endswith(JSONL_SUFFIXES):
        return "jsonl"
    raise CommandError(f"{role} {path}: unknown format; name it .parquet (or .pq) or .jsonl "
                       f"(or .ndjson, .json: JSON lines)")


def filesystem_of(location: str, role: str) -> tuple[Any, str]:
    """The pyarrow filesystem and path of a local path or a URI."""
    from pyarrow import fs

    uri = location if "://" in location else os.path.abspath(location)
    try:
        return fs.FileSystem.from_uri(uri)
    except Exception as exc:  # noqa: BLE001  (ArrowInvalid, OSError, a missing driver)
        raise CommandError(f"{role} {location}: cannot be opened ({_first_line(exc)})") from None


def _input_files(location: str) -> tuple[Any, list[str]]:
    """The files of one input location: the file itself, or a directory's files of a known
    format (recursively, sorted by path; names starting with '.' or '_' skipped)."""
    from pyarrow import fs

    filesystem, path = filesystem_of(location, "input")
    info = filesystem.get_file_info(path)
    if info.type == fs.FileType.NotFound:
        raise CommandError(f"input {location}: no such file or directory")
    if info.type != fs.FileType.Directory:
        file_format(path, "input")
        return filesystem, [path]
    found = filesystem.get_file_info(fs.FileSelector(path, recursive=True))
    files = sorted(f.path for f in found if f.type == fs.FileType.File
                   and not os.path.basename(f.path).startswith((".", "_"))
                   and f.path.lower().endswith(PARQUET_SUFFIXES + JSONL_SUFFIXES))
    if not files:
        raise CommandError(f"input {location}: a directory without .parquet or .jsonl files")
    return filesystem, files


def jsonl_row_starts(stream: Any, max_line_bytes: int) -> Iterator[tuple[int, int, bool]]:
    """(byte offset, line number, starts with a byte-order mark) of every line that
    :func:`serving.jsonl.read_lines` answers (non-blank, over-long ones included), found
    without parsing: the driver's one pass over a JSONL file."""
    limit, offset, number = max_line_bytes + 2, 0, 0
    while True:
        raw = stream.readline(limit)
        if not raw:
            return
        number, start, offset = number + 1, offset, offset + len(raw)
        if len(raw) == limit and not raw.endswith(b"\n"):       # over-long: an error row
            while piece := stream.readline(1 << 20):
                offset += len(piece)
                if piece.endswith(b"\n"):
                    break
            yield start, number, False
            continue
        body = raw[:-2] if raw.endswith(b"\r\n") else raw[:-1] if raw.endswith(b"\n") else raw
        bom = body.startswith(_BOM)
        if number == 1 and bom:
            body = body[len(_BOM):]
        if len(body) > max_line_bytes or body.strip():
            yield start, number, bom


def _jsonl_units(filesystem: Any, fs_index: int, path: str, first_row: int, unit_rows: int,
                 max_line_bytes: int) -> list[ReadUnit]:
    """Units of ``unit_rows`` lines of a JSONL file (a unit never starts at a line that
    begins with a byte-order mark: the reader would take it for the file's)."""
    starts: list[tuple[int, int, int]] = []          # (offset, line, row)
    rows = 0
    with io.BufferedReader(filesystem.open_input_stream(path), 1 << 20) as stream:
        for offset, number, bom in jsonl_row_starts(stream, max_line_bytes):
            if not starts or (rows - starts[-1][2] >= unit_rows and not bom):
                starts.append((offset, number, rows))
            rows += 1
    ends = [row for _, _, row in starts[1:]] + [rows]
    return [ReadUnit(fs_index, path, "jsonl", first_row + row, end - row, offset=offset,
                     first_line=line) for (offset, line, row), end in zip(starts, ends)]


def _parquet_meta(filesystem: Any, path: str) -> Any:
    pa = _pyarrow()
    try:
        return pa.parquet.ParquetFile(filesystem.open_input_file(path)).metadata
    except Exception as exc:  # noqa: BLE001
        raise CommandError(f"input {path}: not a readable Parquet file "
                           f"({_first_line(exc)})") from None


def _parquet_units(meta: Any, fs_index: int, path: str, first_row: int,
                   unit_rows: int) -> list[ReadUnit]:
    """Units of a Parquet file from its footer: small row groups together up to
    ``unit_rows`` rows; a larger group in slices of at least ``unit_rows`` rows and at
    most :data:`MAX_SLICES_PER_GROUP` slices (a slice is read from its group's start, so
    more slices would read the group more often than they spread it)."""
    units: list[ReadUnit] = []
    pending: list[int] = []
    pending_rows, row = 0, first_row

    def flush() -> None:
        nonlocal pending, pending_rows, row
        if pending_rows:
            units.append(ReadUnit(fs_index, path, "parquet", row, pending_rows, tuple(pending)))
            row += pending_rows
        pending, pending_rows = [], 0

    for group in range(meta.num_row_groups):
        size = meta.row_group(group).num_rows
        if size <= unit_rows:
            if pending_rows + size > unit_rows:
                flush()
            pending.append(group)
            pending_rows += size
            continue
        flush()
        step = max(unit_rows, -(-size // MAX_SLICES_PER_GROUP))
        for skip in range(0, size, step):
            rows = min(step, size - skip)
            units.append(ReadUnit(fs_index, path, "parquet", row, rows, (group,), skip))
            row += rows
    flush()
    return units


def _check_columns(path: str, schema: Any) -> bool:
    """Refuse a column this module writes; returns whether the ``id`` column is integral
    (True when absent: nothing to contradict)."""
    pa = _pyarrow()
    own = [name for name in (ROW, READ_ERROR) if name in schema.names]
    if own:
        raise CommandError(f"input {path}: column {own[0]!r} is the pipeline's own (the input "
                           f"row index, or a read error): rename it")
    return "id" not in schema.names or pa.types.is_integer(schema.field("id").type)


def plan_input(inputs: str | Sequence[str], max_line_bytes: int,
               unit_rows: int = DEFAULT_BATCH_SIZE) -> InputPlan:
    """Files, formats, row counts and read units of the input, checked on the driver (one
    line naming the problem) before any actor starts."""
    from pyarrow import fs

    locations = [inputs] if isinstance(inputs, (str, os.PathLike)) else list(inputs)
    units: list[ReadUnit] = []
    filesystems: list[Any] = []
    formats, integral, ids_seen, rows = set(), True, False, 0
    for location in map(os.fspath, locations):
        filesystem, files = _input_files(location)
        filesystems.append(filesystem)
        index = len(filesystems) - 1
        for path in files:
            kind = file_format(path, "input")
            formats.add(kind)
            if kind == "parquet":
                meta = _parquet_meta(filesystem, path)
                schema = meta.schema.to_arrow_schema()
                integral &= _check_columns(path, schema)
                ids_seen |= "id" in schema.names
                file_units = _parquet_units(meta, index, path, rows, unit_rows)
            else:
                file_units = _jsonl_units(filesystem, index, path, rows, unit_rows,
                                          max_line_bytes)
            units += file_units
            rows += sum(unit.rows for unit in file_units)
    if len(formats) > 1:
        raise CommandError(f"input {', '.join(map(str, locations))}: mixes Parquet and JSONL "
                           f"files; give one format")
    return InputPlan(units, filesystems, rows,
                     integral_ids=formats == {"parquet"} and integral and ids_seen,
                     local=all(isinstance(f, fs.LocalFileSystem) for f in filesystems))


# ----------------------------------------------------------------------------- reading
def _parquet_block(filesystem: Any, unit: Mapping[str, Any]) -> Any:
    """The unit's rows of its row groups, with their ``row``."""
    pa = _pyarrow()
    reader = pa.parquet.ParquetFile(filesystem.open_input_file(unit["path"]))
    skip, left, pieces = unit["skip"], unit["rows"], []
    for batch in reader.iter_batches(batch_size=min(left, 65536),
                                     row_groups=list(unit["row_groups"])):
        if skip >= batch.num_rows:
            skip -= batch.num_rows
            continue
        piece = batch.slice(skip, left)
        skip, left = 0, left - piece.num_rows
        pieces.append(piece)
        if not left:
            break
    table = pa.Table.from_batches(pieces, schema=reader.schema_arrow)
    _check_count(unit, table.num_rows)
    first = unit["first_row"]
    return table.append_column(ROW, pa.array(range(first, first + table.num_rows), pa.int64()))


def _jsonl_block(filesystem: Any, unit: Mapping[str, Any], max_line_bytes: int) -> Any:
    """The unit's lines as (row, request_json, read_error), read and checked by the rules
    of ``moejax score`` (``serving.jsonl``), a bad line's error named by its row and line."""
    pa = _pyarrow()
    name, first_row = os.path.basename(unit["path"]), unit["first_row"]
    block: dict[str, list[Any]] = {ROW: [], REQUEST_JSON: [], READ_ERROR: []}
    source = filesystem.open_input_file(unit["path"])
    source.seek(unit["offset"])
    with io.BufferedReader(source, 1 << 20) as stream:
        for line in read_lines(stream, max_line_bytes):
            row = first_row + len(block[ROW])
            number = unit["first_line"] + line.number - 1
            block[ROW].append(row)
            block[REQUEST_JSON].append(None if line.request is None else
                                       json.dumps(line.request, ensure_ascii=False))
            block[READ_ERROR].append(None if line.error is None else
                                     _line_error(line.error, line.number, number, row, name))
            if len(block[ROW]) == unit["rows"]:
                break
    _check_count(unit, len(block[ROW]))
    return pa.table(block, schema=pa.schema([(ROW, pa.int64()), (REQUEST_JSON, pa.string()),
                                             (READ_ERROR, pa.string())]))


def _line_error(error: str, read_number: int, number: int, row: int, name: str) -> str:
    """A JSONL line's own problem (``"line 4: invalid JSON: ..."``, numbered from where the
    reader started) named by its row and its line in the file: ``"row 2 (requests.jsonl
    line 4): invalid JSON: ..."``."""
    prefix = f"line {read_number}:"
    detail = error[len(prefix):] if error.startswith(prefix) else " " + error
    return f"row {row} ({name} line {number}):{detail}"


def _check_count(unit: Mapping[str, Any], read: int) -> None:
    if read != unit["rows"]:
        raise RuntimeError(f"input {unit['path']}: {read} rows read where {unit['rows']} were "
                           f"planned (from row {unit['first_row']}): the file changed while "
                           f"the job ran")


def read_units(batch: Any, *, filesystems: Sequence[Any], max_line_bytes: int
               ) -> Iterator[Any]:
    """``map_batches`` function of the read stage: the units of ``batch`` (rows of
    :class:`ReadUnit` fields) as blocks of request rows with their ``row``."""
    for unit in batch.to_pylist():
        filesystem = filesystems[unit["filesystem"]]
        if unit["format"] == "parquet":
            yield _parquet_block(filesystem, unit)
        else:
            yield _jsonl_block(filesystem, unit, max_line_bytes)


# ----------------------------------------------------------------------------- output
class _Sink:
    """The job's one output file, written on the driver as results arrive: Parquet, or
    JSON lines as ``moejax score`` writes them (plus ``row``); a local file is written
    under a temporary name and renamed when complete, so a failed job leaves none."""

    def __init__(self, location: str, schema: Any, optional_fields: Sequence[str],
                 inputs: Sequence[str]):
        from pyarrow import fs

        pa = _pyarrow()
        self.format = file_format(location, "output")
        self.filesystem, self.path = filesystem_of(location, "output")
        self.local = isinstance(self.filesystem, fs.LocalFileSystem)
        if self.local:
            _check_local_output(self.path, inputs)
        self.target = f"{self.path}.tmp{os.getpid()}" if self.local else self.path
        self.schema, self.optional = schema, frozenset(optional_fields)
        try:
            self.stream = self.filesystem.open_output_stream(self.target)
        except Exception as exc:  # noqa: BLE001
            raise CommandError(f"output {location}: cannot be written "
                               f"({_first_line(exc)})") from None
        self.writer = (pa.parquet.ParquetWriter(self.stream, schema)
                       if self.format == "parquet" else None)

    def write(self, table: Any) -> None:
        if self.writer is not None:
            self.writer.write_table(table.select(self.schema.names))
            return
        lines = []
        for record in table.select(self.schema.names).to_pylist():
            lines.append(format_result({k: v for k, v in record.items()
                                        if v is not None or k not in self.optional}))
        self.stream.write("".join(lines).encode("utf-8"))

    def close(self, complete: bool) -> None:
        if self.writer is not None:
            self.writer.close()
        self.stream.close()
        if self.local:
            if complete:
                os.replace(self.target, self.path)
            else:
                with contextlib.suppress(OSError):
                    os.remove(self.target)


def _check_local_output(path: str, inputs: Sequence[str]) -> None:
    directory = os.path.dirname(path)
    if os.path.isdir(path):
        raise CommandError(f"output {path}: is a directory")
    if not os.path.isdir(directory) or not os.access(directory, os.W_OK):
        raise CommandError(f"output {path}: its directory is missing or not writable")
    for location in inputs:
        source = os.path.abspath(location) if "://" not in location else None
        if source and os.path.exists(path) and os.path.samefile(path, source):
            raise CommandError(f"output {path} is the input file {location}: writing the "
                               f"results would destroy it (give another output)")


# ----------------------------------------------------------------------------- the job
@dataclasses.dataclass(frozen=True)
class BatchSummary:
    """What a finished job did."""

    rows: int
    errors: int
    seconds: float
    output: str
    first_result_seconds: float | None = None   # from the start to the first result block
    first_result_rows: int = 0                  # the rows of that block


@dataclasses.dataclass(frozen=True)
class _Job:
    verb: str                                     # the progress bar's label
    runner: type
    schema: Callable[[bool], Any]
    optional_fields: tuple[str, ...]
    check_options: Callable[[dict[str, Any]], None]


def _check_scorer_options(options: dict[str, Any]) -> None:
    from serving.options import load_options

    own = {k: v for k, v in options.items()
           if k not in ("deployment", "normalize_options", "distributed")}
    try:
        load_options(own, deployment=options.get("deployment"))
    except (TypeError, ValueError, OSError) as exc:
        raise ValueError(f"Scorer options: {exc}") from None


def _check_generator_options(options: dict[str, Any]) -> None:
    from serving.generation_options import make_options

    _refuse_expert_traces(options)
    try:
        make_options({k: v for k, v in options.items() if k not in ("share_with", "distributed")})
    except (TypeError, ValueError) as exc:
        raise ValueError(f"Generator options: {exc}") from None


SCORING = _Job("scoring", BatchScorer, score_schema, OPTIONAL_SCORE_FIELDS,
               _check_scorer_options)
GENERATION = _Job("generating", BatchGenerator, generation_schema, (),
                  _check_generator_options)


def _pool(size: int, *, actors: bool) -> dict[str, Any]:
    """``map_batches``' pool size: ``compute=`` a strategy from Ray 2.51 on, where
    ``concurrency`` is deprecated; ``concurrency=`` before, where it was the way."""
    import ray

    version = tuple(int(part) for part in ray.__version__.split(".")[:2] if part.isdigit())
    if version >= (2, 51):
        strategy = ray.data.ActorPoolStrategy if actors else ray.data.TaskPoolStrategy
        return {"compute": strategy(size=size)}
    return {"concurrency": size}


@contextlib.contextmanager
def _data_context(ordered: bool, ray_progress_bars: bool) -> Iterator[None]:
    """Ray Data's order and progress settings for this job, the caller's put back after
    (they are process-wide; a dataset copies them when it is made)."""
    import ray

    context = ray.data.DataContext.get_current()
    saved = context.execution_options.preserve_order, context.enable_progress_bars
    context.execution_options.preserve_order = ordered
    context.enable_progress_bars = ray_progress_bars
    try:
        yield
    finally:
        context.execution_options.preserve_order, context.enable_progress_bars = saved


def _read_placement(plan: InputPlan) -> dict[str, Any]:
    """Local files are read on this machine (another node of a cluster has no such path);
    files behind a URI anywhere. Newer Ray pins by the node-id label (``ray_remote_args``,
    which carried a scheduling strategy, is deprecated there), older Ray by a strategy."""
    if not plan.local:
        return {}
    import inspect

    import ray

    node = ray.get_runtime_context().get_node_id()
    if "label_selector" in inspect.signature(ray.data.Dataset.map_batches).parameters:
        return {"label_selector": {"ray.io/node-id": node}}
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return {"scheduling_strategy": NodeAffinitySchedulingStrategy(node, soft=False)}


def build_dataset(plan: InputPlan, job: _Job, model: str, options: Mapping[str, Any], *,
                  actors: int, gpus_per_actor: float, cpus_per_actor: float, batch_size: int,
                  max_line_bytes: int) -> Any:
    """The lazy Ray Data pipeline: the read units -> request blocks -> result blocks. The
    read tasks take no CPU of their own (the actors may hold every one) and at most
    ``max(1, actors // 4)`` run at a time."""
    import ray

    units = [dataclasses.asdict(unit) for unit in plan.units]
    ds = ray.data.from_items(units, override_num_blocks=len(units))
    ds = ds.map_batches(read_units, batch_size=1, batch_format=BATCH_FORMAT,
                        fn_kwargs={"filesystems": plan.filesystems,
                                   "max_line_bytes": max_line_bytes},
                        num_cpus=0, **_pool(max(1, actors // 4), actors=False),
                        **_read_placement(plan))
    return ds.map_batches(job.runner, batch_size=batch_size, batch_format=BATCH_FORMAT,
                          fn_constructor_kwargs={"model": model, "options": dict(options),
                                                 "integral_ids": plan.integral_ids},
                          num_cpus=cpus_per_actor, num_gpus=gpus_per_actor or None,
                          **_pool(actors, actors=True))


def _check_job(actors: int, gpus_per_actor: float, cpus_per_actor: float, batch_size: int,
               options: Mapping[str, Any]) -> None:
    if not isinstance(actors, int) or isinstance(actors, bool) or actors < 1:
        raise ValueError(f"actors must be a positive integer, got {actors!r}")
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    if gpus_per_actor < 0 or cpus_per_actor < 0:
        raise ValueError(f"gpus_per_actor and cpus_per_actor must be >= 0, got "
                         f"{gpus_per_actor!r} and {cpus_per_actor!r}")
    devices = _host_devices(options)
    if gpus_per_actor and devices > gpus_per_actor:
        raise ValueError(f"devices {devices}: an actor sees only the {gpus_per_actor:g} GPU(s) "
                         f"Ray gives it; give gpus_per_actor={devices}")


def _progress_bar(total: int, verb: str, progress: bool | None) -> Any:
    show = sys.stderr.isatty() if progress is None else progress
    if not show:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="row", desc=verb, file=sys.stderr, smoothing=0.1)


def _drain(ds: Any, sink: _Sink, plan: InputPlan, ordered: bool, bar: Any,
           started: float) -> tuple[int, int, float | None, int]:
    """Write the result blocks as they arrive; (rows, errors, seconds to the first block,
    its rows)."""
    rows = errors = first_rows = 0
    first = None
    for table in ds.iter_batches(batch_format=BATCH_FORMAT, batch_size=None):
        if first is None:
            first, first_rows = time.perf_counter() - started, table.num_rows
        if ordered:
            _check_order(table, rows)
        sink.write(table)
        rows += table.num_rows
        errors += table.num_rows - table.column("error").null_count
        if bar is not None:
            bar.update(table.num_rows)
    if rows != plan.rows:
        raise RuntimeError(f"the job answered {rows} rows of {plan.rows}")
    return rows, errors, first, first_rows


def _check_order(table: Any, done: int) -> None:
    got = table.column(ROW).to_pylist()
    if got != list(range(done, done + len(got))):
        raise RuntimeError(f"results out of order: rows {got[:3]}... after {done} rows")


def connect(ray: Any, address: str | None) -> None:
    """Join or start the cluster ``address`` names, unless this process has a Ray session
    already (a notebook's, a test's: used as it is). None: what ``ray.init()`` finds
    (``RAY_ADDRESS``, else a new cluster on this machine); :data:`LOCAL`: a new cluster on
    this machine with every core; ``"auto"``: the cluster this machine belongs to; else a
    cluster's address (``ray://HOST:10001``)."""
    if ray.is_initialized():
        return
    try:
        if address == LOCAL:
            ray.init(address="local", num_cpus=os.cpu_count())
        elif address is None:
            ray.init()
        else:
            ray.init(address=address)
    except ConnectionError as exc:
        raise ConnectionError(f"Ray cluster {address or 'auto'}: {exc}") from None


def run_job(job: _Job, inputs: str | Sequence[str], output: str, *, model: str,
            options: Mapping[str, Any], actors: int, gpus_per_actor: float,
            cpus_per_actor: float, batch_size: int, ordered: bool, progress: bool | None,
            max_line_mib: float, ray_address: str | None = None) -> BatchSummary:
    """The job of :func:`score` / :func:`generate`: plan and check on the driver (before
    any cluster starts), then read, run and write through Ray Data."""
    ray = require_ray()
    options = dict(options)
    _check_job(actors, gpus_per_actor, cpus_per_actor, batch_size, options)
    job.check_options(options)
    max_line_bytes = max(1, int(max_line_mib * (1 << 20)))
    plan = plan_input(inputs, max_line_bytes, unit_rows=batch_size)
    locations = [inputs] if isinstance(inputs, (str, os.PathLike)) else list(inputs)
    sink = _Sink(os.fspath(output), job.schema(plan.integral_ids), job.optional_fields,
                 [os.fspath(p) for p in locations])
    started = time.perf_counter()
    complete = False
    bar = _progress_bar(plan.rows, job.verb, progress)
    try:
        rows, errors, first, first_rows = 0, 0, None, 0
        if plan.rows:
            connect(ray, ray_address)
            with _data_context(ordered, ray_progress_bars=bar is None):
                ds = build_dataset(plan, job, model, options, actors=actors,
                                   gpus_per_actor=gpus_per_actor, cpus_per_actor=cpus_per_actor,
                                   batch_size=batch_size, max_line_bytes=max_line_bytes)
                rows, errors, first, first_rows = _drain(ds, sink, plan, ordered, bar,
                                                         started)
        complete = True
    finally:
        if bar is not None:
            bar.close()
        sink.close(complete)
    return BatchSummary(rows, errors, time.perf_counter() - started, os.fspath(output), first,
                        first_rows)


def score(input: str | Sequence[str], output: str, *, model: str = "demo", actors: int = 1,
          gpus_per_actor: float = 0, cpus_per_actor: float = 1,
          batch_size: int = DEFAULT_BATCH_SIZE, ordered: bool = True,
          progress: bool | None = None, max_line_mib: float = DEFAULT_MAX_LINE_MIB,
          ray_address: str | None = None,
          **scorer_options: Any) -> BatchSummary:
    """Score the requests of ``input`` (a JSONL or Parquet file, a directory of them, a URI,
    or a list of those) into ``output`` (JSONL or Parquet by its extension), on ``actors``
    actors of the Ray cluster (the one ``ray.init()`` finds or starts), each holding a
    Scorer of ``model`` built with ``scorer_options`` on ``gpus_per_actor`` GPUs.
    ``batch_size``: rows per actor call. ``ordered``: results in input order (module
    docstring); every result carries its ``row`` either way. ``progress``: a bar of rows
    done, rows/s and the time left (default: when stderr is a terminal; Ray Data's own
    bars otherwise). ``ray_address``: the cluster, when this process has no Ray session
    yet (:func:`connect`); the session is left open for the next job."""
    return run_job(SCORING, input, output, model=model, options=scorer_options, actors=actors,
                   gpus_per_actor=gpus_per_actor, cpus_per_actor=cpus_per_actor,
                   batch_size=batch_size, ordered=ordered, progress=progress,
                   max_line_mib=max_line_mib, ray_address=ray_address)


def generate(input: str | Sequence[str], output: str, *, model: str = "demo", actors: int = 1,
             gpus_per_actor: float = 0, cpus_per_actor: float = 1,
             batch_size: int = DEFAULT_BATCH_SIZE, ordered: bool = True,
             progress: bool | None = None, max_line_mib: float = DEFAULT_MAX_LINE_MIB,
             ray_address: str | None = None,
             **generator_options: Any) -> BatchSummary:
    """:func:`score` for generation requests: a Generator per actor, built with
    ``generator_options``; results ``token_ids``, ``text``, ``finish_reason``,
    ``prompt_tokens``, ``error`` with their ``row``."""
    return run_job(GENERATION, input, output, model=model, options=generator_options,
                   actors=actors, gpus_per_actor=gpus_per_actor,
                   cpus_per_actor=cpus_per_actor, batch_size=batch_size, ordered=ordered,
                   progress=progress, max_line_mib=max_line_mib, ray_address=ray_address)


__all__ = ("BATCH_FORMAT", "DEFAULT_BATCH_SIZE", "INSTALL_HINT", "LOCAL", "BatchGenerator",
           "BatchScorer", "BatchSummary", "InputPlan", "ReadUnit", "batch_entries",
           "build_dataset", "connect", "generate", "generation_schema", "jsonl_row_starts",
           "plan_input", "read_units", "require_ray", "run_job", "score", "score_schema")
