"""Offline jobs on Ray Data (serving/ray_data.py, ``moejax batch``): on a real local Ray
cluster (2 CPUs, CPU only), the results equal the in-process Scorer's and Generator's row
for row, bad rows carry their own errors, and the row index and order hold, for Parquet and
JSONL each way. The cluster tests are slow (a Ray cluster and fresh actors per job); the
planning and row-conversion checks below need no cluster and run in the quick lane.
Skipped where Ray Data (the ``ray`` extra) is not installed."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from serving.requests import renamed

ROOT = Path(__file__).resolve().parent.parent
HAVE_RAY = all(importlib.util.find_spec(m) is not None for m in ("ray", "pyarrow"))
needs_ray = pytest.mark.skipif(not HAVE_RAY, reason="Ray Data is not installed "
                                                    "(pip install 'moejax[ray]')")


def on_cluster(test):
    """The marks of a test on the module's Ray cluster: slow (``make test-quick`` leaves it
    out), skipped without Ray, and a longer timeout (the first one starts the cluster)."""
    return needs_ray(pytest.mark.slow(pytest.mark.timeout(600)(test)))


ROWS = 2000
BATCH = 250                      # rows per actor call, and per in-process reference call
UNREADABLE_ROW = 1000            # its "when" cell is a timestamp Python cannot hold
BAD_ROWS = {
    17: {"id": "bad-empty", "prompt": "", "candidates": [" a", " b"]},
    404: {"prompt": "x", "candidates": []},
    777: {"id": "bad-kind", "kind": "nope", "prompt": "x", "candidates": [" a"]},
    1200: {"prompt_token_ids": [5, 100000], "candidate_token_ids": [[1], [2]]},
    1501: {"prompt": "x", "candidates": [" a", " a"]},
    1999: {"id": "bad-both", "prompt": "x", "prompt_token_ids": [4], "candidates": [" a", " b"]},
}
GENERATION_ROWS = [
    {"id": "sum", "prompt": "12 + 9 =", "max_new_tokens": 2},
    {"id": "sum-2", "prompt": "7 + 8 =", "max_new_tokens": 3},
    {"prompt": "def add(a, b):", "max_new_tokens": 6, "temperature": 0.7, "top_p": 0.9,
     "seed": 3},
    {"id": "ids", "prompt_token_ids": [17, 4, 99], "max_new_tokens": 4, "stop_token_ids": []},
    {"prompt": "Is 3 + 4 = 7? Answer:", "max_new_tokens": 0},
    {"id": "bad-temperature", "prompt": "1 + 1 =", "temperature": -1.0},
]


def mixed_requests(count: int) -> list[dict]:
    """Classify, choice, multi, token-id prompts (multi-token candidates) and vocabulary
    normalisation in turn, with and without ids, and the :data:`BAD_ROWS`."""
    rng = random.Random(7)
    rows = []
    for i in range(count):
        a, b = rng.randint(1, 60), rng.randint(1, 60)
        form = i % 5
        if form == 0:
            rows.append({"id": f"c{i}", "prompt": f"Claim: {a} + {b} = {a + b + i % 2}.\n"
                                                  f"True or false?",
                         "candidates": [" true", " false"]})
        elif form == 1:
            rows.append({"id": f"h{i}", "kind": "choice", "prompt": f"What is {a} + {b}?",
                         "candidates": [str(a + b), str(a + b + 1), str(a + b + 2)]})
        elif form == 2:
            rows.append({"kind": "multi", "prompt": f"Text: {a} + {b} = {a + b}\n",
                         "candidates": ["math", "code", "prose"]})
        elif form == 3:
            prompt = [rng.randrange(3, 1000) for _ in range(rng.randint(3, 30))]
            rows.append({"id": f"t{i}", "prompt_token_ids": prompt,
                         "candidate_token_ids": [[rng.randrange(3, 1000)],
                                                 [rng.randrange(3, 1000), rng.randrange(3, 1000)]]})
        else:
            rows.append({"prompt": f"{a} + {b} =", "candidates": [f" {a + b}", f" {a + b + 1}"],
                         "normalize": "vocab"})
    for index, bad in BAD_ROWS.items():
        if index < count:
            rows[index] = dict(bad)
    return rows


def request_table(rows: list[dict], unreadable: int | None = None):
    """The rows as a pyarrow table of the request columns (absent fields null), with a
    ``when`` column null everywhere but at ``unreadable``."""
    import pyarrow as pa

    ints = pa.list_(pa.int64())
    schema = pa.schema([("id", pa.string()), ("kind", pa.string()), ("prompt", pa.string()),
                        ("prompt_token_ids", ints), ("candidates", pa.list_(pa.string())),
                        ("candidate_token_ids", pa.list_(ints)), ("normalize", pa.string())])
    table = pa.Table.from_pylist(rows, schema=schema)
    if unreadable is not None:
        when = [None] * len(rows)
        when[unreadable] = 2 ** 62                       # milliseconds: past year 9999
        table = table.append_column("when", pa.array(when, pa.timestamp("ms")))
    return table


def generation_table(rows: list[dict]):
    import pyarrow as pa

    ints = pa.list_(pa.int64())
    schema = pa.schema([("id", pa.string()), ("prompt", pa.string()), ("prompt_token_ids", ints),
                        ("max_new_tokens", pa.int64()), ("temperature", pa.float64()),
                        ("top_p", pa.float64()), ("seed", pa.int64()),
                        ("stop_token_ids", ints)])
    return pa.Table.from_pylist(rows, schema=schema)


def write_parquet(table, path: Path) -> Path:
    import pyarrow.parquet as pq

    pq.write_table(table, path, row_group_size=BATCH)  # a read unit per row group
    return path


def write_jsonl(rows: list[dict], path: Path, extra_lines: list[str] = ()) -> Path:
    lines = [json.dumps(row) for row in rows] + list(extra_lines)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def read_results(path: Path) -> list[dict]:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def assert_same_score(got: dict, want, row: int) -> None:
    assert got["row"] == row
    assert got["error"] == want.error, row
    assert got["label"] == want.label, row
    assert got["prompt_tokens"] == want.prompt_tokens, row
    assert got.get("selected") == want.selected, row
    if want.logprobs is None:
        assert got["logprobs"] is None, row
    else:
        np.testing.assert_allclose(got["logprobs"], want.logprobs, atol=1e-5, rtol=1e-5,
                                   err_msg=f"row {row}")


def scorer_options(scorer) -> dict:
    """The shared demo Scorer's options for the actors (the programs it compiled are in the
    run's compilation cache, which the actors open through $MOEJAX_CACHE), calibration off
    (it changes no score and costs each actor its compiles)."""
    return {"dtype": scorer.options.dtype, "max_batch_tokens": scorer.options.max_batch_tokens,
            "calibrate": False, "compilation_cache": "auto"}


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def ray_session():
    """One local Ray cluster for the module (its start-up is most of a test's time on 2
    cores); the actors inherit this process's environment (XLA flags, $MOEJAX_CACHE)."""
    if not HAVE_RAY:
        pytest.skip("Ray Data is not installed")
    import ray

    ray.init(address="local", num_cpus=2, include_dashboard=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def requests_and_reference(demo_scorer):
    """The mixed requests and the in-process Scorer's results on them, in the actors'
    batches (the same packing, so the same programs: the actors load them from the run's
    compilation cache instead of compiling them again), an id-less request's error named
    by its row as the job names it."""
    rows, reference = mixed_requests(ROWS), []
    for start in range(0, ROWS, BATCH):
        for k, result in enumerate(demo_scorer.score(rows[start:start + BATCH],
                                                     progress=False)):
            result.error = renamed(result.error, k, f"row {start + k}")
            reference.append(result)
    return rows, reference


# ----------------------------------------------------------------------------- on a cluster
@pytest.mark.usefixtures("ray_session")
@on_cluster
def test_two_actors_score_parquet_to_parquet_as_in_process(tmp_path, demo_scorer,
                                                           requests_and_reference):
    """2,000 rows of every kind over 2 actors, Parquet to Parquet: in input order, each
    row's result the in-process Scorer's, a bad row's error its own (the in-process one's,
    or the cell that could not be read)."""
    from serving import ray_data

    rows, reference = requests_and_reference
    source = write_parquet(request_table(rows, unreadable=UNREADABLE_ROW),
                           tmp_path / "in.parquet")
    out = tmp_path / "out.parquet"
    summary = ray_data.score(source, out, actors=2, batch_size=BATCH,
                             **scorer_options(demo_scorer))
    results = read_results(out)
    assert [r["row"] for r in results] == list(range(ROWS))          # in input order
    assert (summary.rows, summary.errors) == (ROWS, len(BAD_ROWS) + 1)
    for row, (got, want) in enumerate(zip(results, reference)):
        if row != UNREADABLE_ROW:
            assert_same_score(got, want, row)
            assert got["id"] == rows[row].get("id")
    assert results[UNREADABLE_ROW]["error"] == (
        f"row {UNREADABLE_ROW}: column 'when': cannot be read (OverflowError: Python int too "
        f"large to convert to C int)")
    assert results[404]["error"].startswith("row 404: candidates")
    assert results[17]["error"].startswith("request 'bad-empty': prompt")


@pytest.mark.usefixtures("ray_session")
@on_cluster
def test_jsonl_in_parquet_out_unordered(tmp_path, demo_scorer, requests_and_reference):
    """A JSONL file's lines are requests of their own (ids of mixed types, a line that is
    not JSON, a blank line); ``ordered=False`` lets results come as they finish, each with
    its row."""
    from serving import ray_data

    rows, reference = requests_and_reference
    extra = {"id": 5, "prompt": "1 + 1 =", "candidates": [" 2", " 3"]}
    source = write_jsonl(rows[:BATCH], tmp_path / "in.jsonl", ["", "{oops", json.dumps(extra)])
    out = tmp_path / "out.parquet"
    ray_data.score(source, out, actors=1, batch_size=BATCH, ordered=False,
                   **scorer_options(demo_scorer))
    results = sorted(read_results(out), key=lambda r: r["row"])
    assert [r["row"] for r in results] == list(range(BATCH + 2))
    for row in range(BATCH):
        assert_same_score(results[row], reference[row], row)
        assert results[row]["id"] == rows[row].get("id")
    assert results[BATCH]["error"] == (f"row {BATCH} (in.jsonl line {BATCH + 2}): invalid "
                                       f"JSON: Expecting property name enclosed in double "
                                       f"quotes (column 2)")
    want = demo_scorer.score([extra], progress=False)[0]
    assert results[BATCH + 1]["id"] == "5"              # JSON ids come back as strings
    np.testing.assert_allclose(results[BATCH + 1]["logprobs"], want.logprobs, atol=1e-5,
                               rtol=1e-5)


@pytest.mark.usefixtures("ray_session")
@on_cluster
def test_generation_equals_in_process(tmp_path, demo_generator):
    """BatchGenerator rows (greedy, sampled with a seed, token ids, bad ones) equal the
    in-process Generator's."""
    from serving import ray_data

    source = write_parquet(generation_table(GENERATION_ROWS), tmp_path / "gen.parquet")
    out = tmp_path / "gen.jsonl"
    options = {"dtype": demo_generator.options.dtype,
               "max_batch_size": demo_generator.options.max_batch_size,
               "compilation_cache": "auto"}
    summary = ray_data.generate(source, out, actors=1, batch_size=4, **options)
    assert (summary.rows, summary.errors) == (6, 2)
    reference = demo_generator.generate(GENERATION_ROWS)
    for row, (got, want) in enumerate(zip(read_results(out), reference)):
        assert got["row"] == row
        assert got["error"] == renamed(want.error, row, f"row {row}"), row
        assert (got["token_ids"], got["text"], got["finish_reason"], got["prompt_tokens"]) == (
            want.token_ids, want.text, want.finish_reason, want.prompt_tokens), row
        assert got["id"] == GENERATION_ROWS[row].get("id")
    assert reference[0].text.startswith(" 21")            # (the demo adds its sums)


@pytest.mark.usefixtures("ray_session")
@on_cluster
def test_cli_parquet_in_jsonl_out(tmp_path, demo_scorer, requests_and_reference, capsys):
    """``moejax batch IN.parquet -o OUT.jsonl --ray``: JSON lines as ``moejax score`` writes
    them, with ``row``, in input order (this process's Ray session is used as it is). The
    module's last job: ``main`` sets the XLA flags of the moejax commands in this process,
    which would change the compilation cache's keys of what it compiles afterwards."""
    from serving.cli import main

    rows, reference = requests_and_reference
    source = write_parquet(request_table(rows[:BATCH]), tmp_path / "in.parquet")
    out = tmp_path / "out.jsonl"
    status = main(["batch", str(source), "-o", str(out), "--ray", "--actors", "1",
                   "--batch-size", str(BATCH), "--dtype", demo_scorer.options.dtype,
                   "--max-batch-tokens", str(demo_scorer.options.max_batch_tokens)])
    assert status == 0
    results = read_results(out)
    assert [r["row"] for r in results] == list(range(BATCH))
    for row, got in enumerate(results):
        assert_same_score(got, reference[row], row)
        assert ("selected" in got) == (rows[row].get("kind") == "multi"), row
    assert f"scored {BATCH - 1} of {BATCH} rows (1 with errors)" in capsys.readouterr().err


# ----------------------------------------------------------------------------- no cluster
@needs_ray
def test_batch_entries_read_rows_as_requests():
    """Null cells and null struct members are absent fields; a cell Python cannot hold is
    its row's error; a batch without ``row`` names rows by their place in it."""
    import pyarrow as pa

    from serving.ray_data import batch_entries

    message = pa.struct([("role", pa.string()), ("content", pa.string()), ("name", pa.string())])
    table = pa.table({
        "messages": pa.array([[{"role": "user", "content": "hi", "name": None}], None],
                             pa.list_(message)),
        "prompt": pa.array([None, "x"]),
        "when": pa.array([None, 2 ** 62], pa.timestamp("ms")),
    })
    first, second = batch_entries(table)
    assert first.request == {"messages": [{"role": "user", "content": "hi"}]}
    assert first.label == "request #0" and first.row is None
    assert second.request is None and second.error.startswith(
        "request #1: column 'when': cannot be read (OverflowError")
    with_rows = pa.table({"row": [7, 8], "request_json": ['{"prompt": "a"}', None],
                          "read_error": [None, "row 8 (a.jsonl line 9): invalid JSON"]})
    seven, eight = batch_entries(with_rows)
    assert (seven.label, seven.request) == ("row 7", {"prompt": "a"})
    assert eight.error == "row 8 (a.jsonl line 9): invalid JSON"


TRICKY_JSONL = (b'\xef\xbb\xbf{"a": 1}\r\n \t\n\n{"b": 2}\n' + b"x" * 40 + b"\n" + b" " * 40 +
                b"\n{}\r\n\xef\xbb\xbf\n{oops\n" + b'{"c": 3}\n' * 5 + b"y" * 17)


@needs_ray
@pytest.mark.parametrize("limit", [16, 17, 18, 1 << 20])
def test_jsonl_rows_are_found_as_read(limit):
    """The driver's pass (where each read unit starts) agrees with the reader on blank
    lines, byte-order marks, CRLF and over-long lines."""
    from serving.jsonl import read_lines
    from serving.ray_data import jsonl_row_starts

    want = [line.number for line in read_lines(io.BytesIO(TRICKY_JSONL), limit)]
    got = list(jsonl_row_starts(io.BufferedReader(io.BytesIO(TRICKY_JSONL)), limit))
    assert [number for _, number, _ in got] == want
    for offset, number, _ in got:                     # each offset starts its line
        assert TRICKY_JSONL[:offset].count(b"\n") == number - 1


def _read_plan(plan, max_line_bytes: int):
    """Every unit of a plan read as a read task would (no cluster), concatenated."""
    import dataclasses

    import pyarrow as pa

    from serving.ray_data import read_units

    tables = []
    for unit in plan.units:
        batch = pa.Table.from_pylist([dataclasses.asdict(unit)])
        tables += read_units(batch, filesystems=plan.filesystems, max_line_bytes=max_line_bytes)
    return tables


@needs_ray
def test_jsonl_units_read_every_line_once(tmp_path):
    """JSONL read in units of one row from their byte offsets: every row once, in order, a
    bad line's error naming its row and its line in the file; a line that starts with a
    byte-order mark (line 8) starts no unit (the reader would drop the mark)."""
    from serving.ray_data import plan_input

    (tmp_path / "a.jsonl").write_bytes(TRICKY_JSONL)
    (tmp_path / "b.jsonl").write_bytes(b'{"d": 4}\n\n{"e": 5}\n')
    plan = plan_input(str(tmp_path), 18, unit_rows=1)
    assert plan.rows == 15 and not plan.integral_ids
    assert [u.rows for u in plan.units] == [1, 1, 1, 1, 2] + [1] * 9
    rows = [row for table in _read_plan(plan, 18) for row in table.to_pylist()]
    assert [r["row"] for r in rows] == list(range(15))
    assert [json.loads(r["request_json"]) for r in rows if r["request_json"]] == (
        [{"a": 1}, {"b": 2}, {}] + [{"c": 3}] * 5 + [{"d": 4}, {"e": 5}])
    assert rows[2]["read_error"].startswith("row 2 (a.jsonl line 5): longer than the limit")
    assert rows[5]["read_error"].startswith("row 5 (a.jsonl line 8): invalid JSON")
    assert rows[6]["read_error"].startswith("row 6 (a.jsonl line 9): invalid JSON")


@needs_ray
def test_parquet_units_slice_row_groups(tmp_path):
    """Small row groups are read together, a large one in slices; the rows come back
    once each, numbered across files."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from serving.ray_data import plan_input

    pq.write_table(pa.table({"id": list(range(100)), "prompt": ["p"] * 100}),
                   tmp_path / "a.parquet", row_group_size=10)
    pq.write_table(pa.table({"id": list(range(100, 1100)), "prompt": ["q"] * 1000}),
                   tmp_path / "b.parquet", row_group_size=1000)
    plan = plan_input(str(tmp_path), 1 << 20, unit_rows=25)
    assert plan.integral_ids and plan.rows == 1100
    assert [u.rows for u in plan.units[:5]] == [20, 20, 20, 20, 20]        # groups of 10
    assert {u.rows for u in plan.units[5:-1]} == {25} and len(plan.units) == 5 + 40
    rows = [row for table in _read_plan(plan, 1 << 20) for row in table.to_pylist()]
    assert [r["row"] for r in rows] == list(range(1100))
    assert [r["id"] for r in rows] == list(range(1100))


@needs_ray
@pytest.mark.parametrize("case, message", [
    ("missing", "input {tmp}/missing.parquet: no such file or directory"),
    ("extension", "input {tmp}/in.csv: unknown format"),
    ("mixed", "mixes Parquet and JSONL files"),
    ("own_column", "column 'row' is the pipeline's own"),
    ("same_file", "output {tmp}/in.parquet is the input file"),
    ("bad_option", "Scorer options: dtype must be one of"),
    ("gpus", "devices 2: an actor sees only the 1 GPU(s) Ray gives it"),
])
def test_refused_before_any_cluster_starts(case, message, tmp_path):
    import pyarrow as pa
    import ray

    from serving import ray_data

    parquet = write_parquet(request_table(mixed_requests(3)), tmp_path / "in.parquet")
    inputs, output, options = [str(parquet)], str(tmp_path / "out.parquet"), {}
    if case == "missing":
        inputs = [str(tmp_path / "missing.parquet")]
    elif case == "extension":
        (tmp_path / "in.csv").write_text("a\n")
        inputs = [str(tmp_path / "in.csv")]
    elif case == "mixed":
        inputs.append(str(write_jsonl(mixed_requests(2), tmp_path / "in.jsonl")))
    elif case == "own_column":
        write_parquet(pa.table({"prompt": ["a"], "row": [3]}), parquet)
    elif case == "same_file":
        output = str(parquet)
    elif case == "bad_option":
        options = {"dtype": "float8"}
    else:
        options = {"devices": 2, "gpus_per_actor": 1}
    session = ray.is_initialized()
    with pytest.raises(ValueError) as raised:
        ray_data.score(inputs, output, **options)
    assert message.format(tmp=tmp_path) in str(raised.value)
    assert ray.is_initialized() == session               # no cluster started for a refusal


@pytest.mark.parametrize("extra, message", [
    (["--ray", "--generate", "--max-batch-tokens", "64"],
     "batch --generate does not take --max-batch-tokens"),
    ([], "batch runs on Ray Data: give --ray"),
])
def test_cli_refuses_before_ray(extra, message, tmp_path):
    """What ``moejax batch`` refuses, before it needs Ray (through the parser and the
    command, without ``main``'s process-wide XLA flags)."""
    from serving.cli import build_parser
    from serving.cli.batch import cmd_batch
    from serving.jsonl import CommandError

    args = build_parser().parse_args(["batch", str(tmp_path / "in.parquet"), "-o",
                                      str(tmp_path / "out.parquet"), *extra])
    with pytest.raises(CommandError, match=message):
        cmd_batch(args)


def test_cli_refuses_multi_process_flags(capsys):
    from serving.cli import build_parser

    with pytest.raises(SystemExit) as raised:
        build_parser().parse_args(["batch", "in.parquet", "-o", "out.parquet", "--ray",
                                   "--num-processes", "2"])
    assert raised.value.code == 2
    assert "one model over several processes or hosts is `moejax launch`'s" in (
        capsys.readouterr().err)


def test_without_ray_the_module_names_the_extra(tmp_path):
    """``import serving`` and ``import moejax`` need no Ray; a job without it fails with the
    install hint (Ray's import is blocked in a fresh interpreter)."""
    code = ("import sys; sys.modules['ray'] = None\n"
            "import moejax, serving, serving.ray_data, serving.cli\n"
            "try:\n"
            "    serving.ray_data.score('in.parquet', 'out.parquet')\n"
            "except ImportError as exc:\n"
            "    print(exc)\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ("serving.ray_data needs Ray Data and pyarrow: "
                                   "pip install 'moejax[ray]'")
