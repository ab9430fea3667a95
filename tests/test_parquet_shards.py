"""``moejax score`` on Parquet (in, out, and each with JSONL), and sharded runs without
Ray: ``--shard I/N`` parts, one killed with SIGKILL and rerun, joined by ``moejax merge``
into what an unsharded run writes (serving/tables.py, serving/shards.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

from serving import cli  # noqa: E402
from serving.shards import SLICE_ROWS, Shard  # noqa: E402

KINDS = [{"prompt": "def add(a, b):", "candidates": [" code", " prose"]},
         {"kind": "choice", "prompt": "2 + 2 =", "candidates": ["4", "5"]},
         {"kind": "multi", "prompt": "Numbers:", "candidates": ["7", "cat"]},
         {"prompt_token_ids": [5, 6, 7], "candidate_token_ids": [[9], [10, 11]]},
         {"prompt": "", "candidates": [" a"]},                     # bad: empty prompt
         {"prompt": "hello", "candidates": [" a"], "colour": 1}]   # bad: unknown field


def requests(count: int) -> list[dict]:
    return [{"id": i, **KINDS[i % len(KINDS)]} for i in range(count)]


def write_jsonl(path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def write_parquet(path, rows) -> None:
    columns = sorted({k for r in rows for k in r})
    pq.write_table(pa.Table.from_pylist([{k: r.get(k) for k in columns} for r in rows]),
                   str(path), row_group_size=5)


def read_results(path) -> list[dict]:
    if str(path).endswith(".parquet"):
        return pq.read_table(str(path)).to_pylist()
    return [json.loads(line) for line in path.read_text().splitlines()]


def comparable(result: dict) -> dict:
    """A result without what differs from run to run (timings) and the nulls a Parquet row
    carries for the fields a JSONL line leaves out."""
    return {k: v for k, v in result.items() if k != "timings" and v is not None}


def score(*argv) -> int:
    return cli.main(["score", *map(str, argv), "--model", "demo"])


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """An unsharded JSONL run of 40 mixed requests (a few bad)."""
    tmp = tmp_path_factory.mktemp("baseline")
    write_jsonl(tmp / "in.jsonl", requests(40))
    assert score(tmp / "in.jsonl", "-o", tmp / "out.jsonl") == 0
    return [comparable(r) for r in read_results(tmp / "out.jsonl")]


def test_parquet_in_and_out_and_mixed_with_jsonl_equal_the_jsonl_run(tmp_path, baseline):
    rows = requests(40)
    write_parquet(tmp_path / "in.parquet", rows)
    write_jsonl(tmp_path / "in.jsonl", rows)
    for source, target in (("in.parquet", "out.parquet"), ("in.parquet", "out.jsonl"),
                           ("in.jsonl", "out2.parquet")):
        assert score(tmp_path / source, "-o", tmp_path / target) == 0
        got = [comparable(r) for r in read_results(tmp_path / target)]
        if source.endswith(".parquet"):
            # Errors name a Parquet row by its 0-based index, a JSONL line by its number.
            want = [{**r, "error": r["error"].replace(f"line {i + 1}", f"row {i}")}
                    if "error" in r else r for i, r in enumerate(baseline)]
        else:
            want = baseline
        if target.endswith(".parquet") and source.endswith(".jsonl"):
            want = [{**r, "id": str(r["id"])} for r in want]   # JSON ids may mix types
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert g.keys() == w.keys(), (g, w)
            for key in g:
                if key == "logprobs":
                    assert g[key] == pytest.approx(w[key], abs=1e-5)
                else:
                    assert g[key] == w[key], (key, g, w)
    schema = pq.read_schema(str(tmp_path / "out.parquet"))
    assert schema.field("id").type == pa.int64() and "row" not in schema.names
    assert pq.read_schema(str(tmp_path / "out2.parquet")).field("id").type == pa.string()


def test_a_parquet_input_is_read_a_record_batch_at_a_time(tmp_path):
    """Memory: the reader holds one record batch, never the whole table (its chunks
    arrive before the file's end is read)."""
    from serving.tables import TableFiles

    write_parquet(tmp_path / "in.parquet", requests(30))
    with TableFiles(str(tmp_path / "in.parquet"), str(tmp_path / "o.jsonl"), 16.0) as files:
        assert files.count() == 30
        first = next(files.chunks(4))
        assert [line.number for line in first] == [0, 1, 2, 3]
        assert first[0].unit == "row" and first[0].request["id"] == 0
        assert "prompt_token_ids" not in first[0].request   # a null cell: an absent field


def test_shards_are_deterministic_slices():
    shards = [Shard(i, 3) for i in range(3)]
    rows = range(5 * SLICE_ROWS)
    owners = [[s.index for s in shards if s.holds(r)] for r in rows]
    assert all(len(o) == 1 for o in owners)
    assert owners[0] == owners[SLICE_ROWS - 1] == [0] and owners[SLICE_ROWS] == [1]
    assert owners[3 * SLICE_ROWS] == [0]
    for bad in ("3/3", "a/2", "1", "-1/2"):
        with pytest.raises(ValueError, match="--shard"):
            Shard.parse(bad)


def test_three_shards_one_killed_and_rerun_merge_into_the_unsharded_run(tmp_path):
    """2,600 rows (3 slices of 1,024 and a part): shard 1 is killed with SIGKILL while it
    runs and rerun; the merge equals an unsharded run, every row once."""
    rows = requests(2600)
    write_parquet(tmp_path / "in.parquet", rows)
    outputs = [tmp_path / f"part-{i}.parquet" for i in range(3)]
    command = [sys.executable, "-m", "serving.cli", "score", str(tmp_path / "in.parquet"),
               "--model", "demo", "--chunk-size", "64"]
    killed = subprocess.Popen(command + ["--shard", "1/3", "-o", str(outputs[1])],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    record = outputs[1].with_name(outputs[1].name + ".shard")
    deadline = time.monotonic() + 120
    while not record.exists() and time.monotonic() < deadline:   # it has started scoring
        time.sleep(0.1)
    killed.send_signal(signal.SIGKILL)
    killed.wait(30)
    assert json.loads(record.read_text())["complete"] is False
    # A merge of an incomplete shard is refused, naming it.
    assert cli.main(["score", str(tmp_path / "in.parquet"), "-o", str(outputs[0]),
                     "--model", "demo", "--shard", "0/3"]) == 0
    assert cli.main(["score", str(tmp_path / "in.parquet"), "-o", str(outputs[2]),
                     "--model", "demo", "--shard", "2/3"]) == 0
    merged = tmp_path / "merged.parquet"
    assert cli.main(["merge", *map(str, outputs), "-o", str(merged)]) == 2
    # The rerun scores shard 1 whole; a rerun of a complete shard does nothing.
    assert cli.main(["score", str(tmp_path / "in.parquet"), "-o", str(outputs[1]),
                     "--model", "demo", "--shard", "1/3"]) == 0
    before = os.stat(outputs[1]).st_mtime_ns
    assert cli.main(["score", str(tmp_path / "in.parquet"), "-o", str(outputs[1]),
                     "--model", "demo", "--shard", "1/3"]) == 0
    assert os.stat(outputs[1]).st_mtime_ns == before
    assert cli.main(["merge", *map(str, outputs), "-o", str(merged)]) == 0
    whole = tmp_path / "whole.parquet"
    assert cli.main(["score", str(tmp_path / "in.parquet"), "-o", str(whole),
                     "--model", "demo"]) == 0
    got, want = read_results(merged), read_results(whole)
    assert [r["id"] for r in got] == list(range(2600))
    for g, w in zip(got, want):
        g, w = comparable(g), comparable(w)
        assert g.keys() == w.keys() and g.get("error") == w.get("error")
        assert g.get("label") == w.get("label")
        if "logprobs" in w:
            assert g["logprobs"] == pytest.approx(w["logprobs"], abs=1e-5)
    sizes = [pq.read_metadata(str(p)).num_rows for p in outputs]
    assert sizes == [1024, 1024, 552] and sum(sizes) == 2600


def test_merge_refuses_shards_that_do_not_add_up(tmp_path):
    rows = requests(12)
    write_jsonl(tmp_path / "in.jsonl", rows)
    outputs = [tmp_path / f"p{i}.jsonl" for i in range(2)]
    for i, output in enumerate(outputs):
        assert cli.main(["score", str(tmp_path / "in.jsonl"), "-o", str(output),
                         "--model", "demo", "--shard", f"{i}/2"]) == 0
    merged = tmp_path / "m.jsonl"
    assert cli.main(["merge", str(outputs[0]), "-o", str(merged)]) == 2      # shard 1 missing
    assert cli.main(["merge", str(outputs[0]), str(outputs[0]), "-o", str(merged)]) == 2
    # A result line dropped from a shard's output: the row is named.
    lines = outputs[0].read_text().splitlines()
    outputs[0].write_text("\n".join(lines[:5] + lines[6:]) + "\n")
    assert cli.main(["merge", *map(str, outputs), "-o", str(merged)]) == 2
    outputs[0].write_text("\n".join(lines) + "\n")
    assert cli.main(["merge", *map(str, outputs), "-o", str(merged)]) == 0
    assert [r["id"] for r in read_results(merged)] == list(range(12))
    assert "row" not in read_results(merged)[0]
    assert cli.main(["score", str(tmp_path / "in.jsonl"), "--model", "demo",
                     "--shard", "0/2"]) == 2                                # no -o
