"""The JSONL commands (``moejax score``, ``generate``, ``client score``) against hostile or
careless input (issue 14): every bad line gets its own error result naming its line and
the other lines still run; file mistakes are one-line errors (exit 2) found before the
model loads; a closed stdout ends quietly; memory stays bounded on a huge line; a broken
model directory names the broken file.

Each test reproduces a failure seen before the fix (in its docstring). The demo model
keeps them fast; the runs that need a model are shared per module where they can be.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from serving import cli, jsonl

REPO = Path(__file__).resolve().parents[1]
GOOD = {"id": "ok", "prompt": "Claim: 2 + 2 = 4. True or false?",
        "candidates": [" true", " false"]}
GOOD_GENERATION = {"id": "ok", "prompt": "1 + 1 =", "max_new_tokens": 2}
pytestmark = pytest.mark.timeout(240)


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def _good(i: int, request: dict = GOOD) -> bytes:
    return json.dumps(dict(request, id=f"ok{i}")).encode()


# The hostile file of items 5, 6, 10, 13, run once through each command (lines 1 and 11
# are valid requests of that command). Its line numbers (1-based, blank lines counted)
# are what the error messages must name.
HOSTILE_LINES: list[bytes] = [
    b"GOOD 1",                                                      # 1
    b"",                                                            # 2 blank: no result
    b'{"prompt": ""}',                                              # 3 id-less, invalid
    b"[" * 5000 + b"]" * 5000,                                      # 4 nested past recursion
    b'{"a": ' * 5000 + b"1" + b"}" * 5000,                          # 5 nested objects
    b'{"id": ' + b"[" * 100 + b"]" * 100 + b', "prompt": "x"}',     # 6 nested under the limit
    b'{"id": "\\udc80", "prompt": "x", "candidates": [" a"]}',      # 7 lone surrogate id
    b'{"id": "raw", "prompt": "caf\xff", "candidates": [" a"]}',    # 8 raw 0xFF byte
    b'{"prompt": "a", "prompt": "b", "candidates": [" a"]}',        # 9 duplicate key
    b"   ",                                                         # 10 blank: no result
    b"GOOD 2",                                                      # 11
    b'{"prompt_token_ids": []}',                                    # 12 id-less, invalid
]
WANTED = [1, 3, 4, 5, 6, 7, 8, 9, 11, 12]   # the lines that get a result, in order


def _write_hostile(path: Path, good: dict = GOOD) -> Path:
    lines = [_good(int(line[5:]), good) if line.startswith(b"GOOD ") else line
             for line in HOSTILE_LINES]
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


@pytest.fixture(scope="module")
def scored(tmp_path_factory) -> list[dict]:
    """`moejax score` of the hostile file (written through the command, in process)."""
    tmp = tmp_path_factory.mktemp("score")
    out = tmp / "out.jsonl"
    assert cli.main(["score", str(_write_hostile(tmp / "in.jsonl")), "-o", str(out),
                     "--chunk-size", "4"]) == 0
    return _rows(out)


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> list[dict]:
    """`moejax generate` of the hostile file."""
    tmp = tmp_path_factory.mktemp("generate")
    out = tmp / "out.jsonl"
    assert cli.main(["generate", str(_write_hostile(tmp / "in.jsonl", GOOD_GENERATION)),
                     "-o", str(out),
                     "--dtype", "float32"]) == 0
    return _rows(out)


@pytest.fixture(scope="module")
def server_target():
    """A gRPC server on a free loopback port with the demo model."""
    from serving import Scorer
    from serving.grpc.server import ScoringServer, ServerOptions

    server = ScoringServer(ServerOptions(port=0, grace_seconds=2))
    port = server.start()
    server.attach(Scorer("demo", max_batch_tokens=64, calibrate=False))
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(1)


@pytest.fixture(scope="module")
def client_scored(server_target, tmp_path_factory) -> list[dict]:
    """`moejax client score` of the hostile file."""
    tmp = tmp_path_factory.mktemp("client")
    out = tmp / "out.jsonl"
    assert cli.main(["client", "score", str(_write_hostile(tmp / "in.jsonl")), "-o", str(out),
                     "--target", server_target, "--timeout", "60", "--no-progress"]) == 0
    return _rows(out)


COMMANDS = ["scored", "generated", "client_scored"]


def _by_line(rows: list[dict]) -> dict[int, dict]:
    assert len(rows) == len(WANTED), [r["error"] for r in rows]
    return dict(zip(WANTED, rows))


# ----------------------------------------------------------------------------- item 5
@pytest.mark.parametrize("command", COMMANDS)
def test_deep_nesting_is_an_error_result_and_the_other_lines_run(command, request):
    """Before: a line nested ~1000 deep raised RecursionError and the whole chunk was lost."""
    rows = _by_line(request.getfixturevalue(command))
    for number in (4, 5, 6):
        assert rows[number]["error"].startswith(f"line {number}: invalid JSON: nested too "
                                                f"deeply"), rows[number]
    assert rows[1]["error"] is None and rows[11]["error"] is None


# ----------------------------------------------------------------------------- item 6
@pytest.mark.parametrize("command", COMMANDS)
def test_non_unicode_input_is_an_error_result_and_every_line_is_written(command, request):
    """Before: a lone-surrogate id was scored and then writing crashed (1 of 3 lines
    written); a raw 0xFF byte went through as a surrogate escape."""
    rows = _by_line(request.getfixturevalue(command))
    assert rows[7]["error"].startswith("line 7: id: is not valid UTF-8 text"), rows[7]
    assert rows[8]["error"] == "line 8: invalid UTF-8 (byte 0xff at offset 28)"
    assert rows[7]["id"] is None and rows[8]["id"] is None


def test_results_are_written_even_when_they_hold_a_lone_surrogate(monkeypatch):
    """A result that echoes a non-Unicode id (say from a library call) is written with
    escapes, to a UTF-8 file as to an ASCII stdout, instead of raising."""
    line = jsonl.format_result({"id": "\udc80", "error": None})
    assert line == '{"id": "\\udc80", "error": null}\n' and line.isascii()
    assert jsonl.format_result({"id": "caf\u00e9"}) == '{"id": "caf\u00e9"}\n'
    assert jsonl.format_result({"id": "caf\u00e9"}, "ascii") == '{"id": "caf\\u00e9"}\n'
    raw = io.BytesIO()
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(raw, encoding="ascii"))
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(b"")))
    with jsonl.open_jsonl("-", None) as files:
        files.start_output()
        files.write({"id": "\udc80", "text": "\u00e9"})
    assert json.loads(raw.getvalue()) == {"id": "\udc80", "text": "\u00e9"}


def test_client_score_never_fails_the_call_for_one_request(server_target, monkeypatch):
    """Before: Client.score with a lone-surrogate id failed the whole call with UNKNOWN
    (the proto refused the string in gRPC's request thread)."""
    from serving.grpc import Client, client as client_module

    requests = [dict(GOOD, id="x"), dict(GOOD, id="\udc80"), dict(GOOD, id="y"),
                {"prompt": "", "candidates": [" a"]}]
    with Client(server_target) as client:
        results = client.score(requests, timeout=60)
    assert [r.error is None for r in results] == [True, False, True, False]
    assert "id" in results[1].error and results[3].error.startswith("request #3: prompt")
    # Whatever else the proto refuses is that request's error result, not the call's.
    real = client_module.convert.request_to_proto

    def refusing(request, index=None):
        if request.id == "y":
            raise ValueError("the proto refused \udcff")
        return real(request, index)

    monkeypatch.setattr(client_module.convert, "request_to_proto", refusing)
    with Client(server_target) as client:
        results = client.score(requests[:1] + requests[2:3], timeout=60)
    assert results[0].error is None
    assert results[1].error == "request 'y': cannot be sent: the proto refused \\udcff"


# ----------------------------------------------------------------------------- item 13
@pytest.mark.parametrize("command", COMMANDS)
def test_duplicate_keys_are_an_error_result(command, request):
    """Before: {"prompt": "a", "prompt": "b"} scored "b" (the last one won, silently)."""
    rows = _by_line(request.getfixturevalue(command))
    assert rows[9]["error"] == "line 9: duplicate key 'prompt'"


def test_parse_line_rules():
    """The reader's answers, one line at a time (no model)."""
    assert jsonl.parse_line(2, b'{"a": {"b": 1, "b": 2}}').error == "line 2: duplicate key 'b'"
    assert jsonl.parse_line(1, b'{"c": ["\\ud800"]}').error.startswith(
        "line 1: c[0]: is not valid UTF-8 text (lone surrogate '\\ud800'")
    assert jsonl.parse_line(1, b'{"\\udc80": 1}').error.startswith("line 1: object: key")
    assert jsonl.parse_line(3, b"[1]").error == "line 3: expected a JSON object, got list"
    assert jsonl.parse_line(4, b'{"n": ' + b"1" * 5000 + b"}").error.startswith(
        "line 4: invalid JSON:")
    deep = b'{"x": ' + b"[" * 63 + b"]" * 63 + b"}"   # 64 levels: accepted
    assert jsonl.parse_line(5, deep).request is not None
    assert "nested too deeply" in jsonl.parse_line(5, deep.replace(b"[", b"[[", 1)
                                                   .replace(b"]", b"]]", 1)).error


# ----------------------------------------------------------------------------- item 10
@pytest.mark.parametrize("command", COMMANDS)
def test_id_less_requests_are_named_by_their_line_number(command, request):
    """Before: id-less requests were named #N counting only the valid lines of the chunk
    (line 3 was "#0") in score/generate, and by a 0-based ordinal in client score."""
    rows = _by_line(request.getfixturevalue(command))
    assert rows[3]["error"] == "line 3: prompt: is empty", rows[3]
    assert rows[12]["error"] == "line 12: prompt_token_ids: is empty", rows[12]


def test_file_and_stdin_split_lines_alike_and_skip_a_bom(tmp_path, monkeypatch, capsys):
    """Before: a file was split on a bare \\r (universal newlines) and stdin was not, so
    line numbers differed; a BOM made line 1 invalid JSON."""
    data = (b"\xef\xbb\xbf" + _good(1) + b"\r\n"
            + b'{"prompt": "", "candidates": [" a"]}\r{"x": 1}\n'   # one line: \r inside
            + b'{"candidates": [" a"]}\n')
    src = tmp_path / "in.jsonl"
    src.write_bytes(data)
    out = tmp_path / "out.jsonl"
    assert cli.main(["score", str(src), "-o", str(out)]) == 0
    from_file = _rows(out)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8"))
    assert cli.main(["score", "-"]) == 0
    from_stdin = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["error"] for r in from_file] == [r["error"] for r in from_stdin]
    assert from_file[0]["error"] is None and from_file[0]["id"] == "ok1"
    assert from_file[1]["error"].startswith("line 2: invalid JSON")   # the \r did not split
    assert from_file[2]["error"].startswith("line 3: prompt")
    assert len(from_file) == 3


# ----------------------------------------------------------------------------- item 7, 9
@pytest.fixture
def no_model(monkeypatch):
    """Loading a model (or connecting) fails the test: the checks must come first."""
    import serving
    import serving.generate
    from serving.grpc import cli as grpc_cli

    def loaded(*args, **kwargs):
        raise AssertionError("the model was loaded before the files were checked")

    monkeypatch.setattr(serving, "Scorer", loaded)
    monkeypatch.setattr(serving.generate, "Generator", loaded)
    monkeypatch.setattr(grpc_cli, "connect", loaded)


def _command(name: str, src: str, *rest: str) -> list[str]:
    head = {"score": ["score"], "generate": ["generate"],
            "client": ["client", "score", "--target", "127.0.0.1:1"]}[name]
    return head + [src, *rest]


@pytest.mark.parametrize("name", ["score", "generate", "client"])
def test_output_naming_the_input_is_refused_before_anything(name, tmp_path, capsys, no_model):
    """Before: `moejax score f.jsonl -o f.jsonl` emptied the input and exited 0."""
    src = tmp_path / "in.jsonl"
    src.write_bytes(_good(1) + b"\n")
    (tmp_path / "link.jsonl").symlink_to(src)
    os.link(src, tmp_path / "hard.jsonl")
    for output in (src, tmp_path / "link.jsonl", tmp_path / "hard.jsonl"):
        assert cli.main(_command(name, str(src), "-o", str(output))) == 2
        err = capsys.readouterr().err
        assert err.startswith("moejax: error: output ") and "is the input file" in err
        assert err.count("\n") == 1
    assert src.read_bytes() == _good(1) + b"\n"


@pytest.mark.parametrize("name", ["score", "generate", "client"])
def test_file_errors_are_one_line_before_the_model_loads(name, tmp_path, capsys, no_model):
    """Before: -o DIR, an input directory, a missing input and an unwritable -o gave
    tracebacks, and -o was checked only after the model had loaded."""
    src = tmp_path / "in.jsonl"
    src.write_bytes(_good(1) + b"\n")
    cases = [
        ([str(src), "-o", str(tmp_path)], f"output {tmp_path}: is a directory"),
        ([str(tmp_path)], f"input {tmp_path}: is a directory"),
        ([str(tmp_path / "nope.jsonl")], f"input {tmp_path / 'nope.jsonl'}: No such file"),
        ([str(src), "-o", str(tmp_path / "no" / "out.jsonl")], "No such file or directory"),
        ([str(src), "-o", str(src / "out.jsonl")], "Not a directory"),
    ]
    for argv, message in cases:
        assert cli.main(_command(name, *argv)) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("moejax: error: ") and message in err, err
        assert err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "no").exists()


def test_a_failed_start_leaves_the_output_file_alone(tmp_path, capsys):
    """-o is opened early (to check it) but truncated only once the model has loaded."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_bytes(_good(1) + b"\n")
    out.write_text("keep me\n")
    assert cli.main(["score", str(src), "-o", str(out), "--model", str(tmp_path / "x")]) == 2
    assert out.read_text() == "keep me\n"
    new = tmp_path / "new.jsonl"
    assert cli.main(["score", str(src), "-o", str(new), "--model", str(tmp_path / "x")]) == 2
    assert not new.exists()
    capsys.readouterr()


def _run_cli(args: list[str], **kwargs) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu")
    return subprocess.Popen([sys.executable, "-m", "serving.cli", *args], cwd=REPO, env=env,
                            stderr=subprocess.PIPE, **kwargs)


@pytest.mark.parametrize("command", ["score", "info"])
def test_a_closed_stdout_ends_quietly(command, tmp_path):
    """Before: `moejax score f.jsonl | head -1` ended with a BrokenPipeError traceback
    (and "Exception ignored ..." at exit). Now: no message, exit 141 (as for SIGPIPE)."""
    src = tmp_path / "in.jsonl"
    src.write_bytes(b"\n".join(_good(i) for i in range(20)) + b"\n")
    args = ["score", str(src), "--chunk-size", "2"] if command == "score" else ["info"]
    proc = _run_cli(args, stdout=subprocess.PIPE)
    proc.stdout.close()   # the reader is gone before the first result is written
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=180) == cli.BROKEN_PIPE_STATUS, err
    assert "Traceback" not in err and "Exception ignored" not in err
    assert "BrokenPipe" not in err, err


# ----------------------------------------------------------------------------- item 8
class _Pieces(io.RawIOBase):
    """A binary stream holding a huge line, made up on the fly (never in memory)."""

    def __init__(self, head: bytes, size: int, tail: bytes):
        self.parts: list[bytes | int] = [head, size, tail]

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while self.parts:
            part = self.parts[0]
            if isinstance(part, int):
                n = min(part, len(buffer))
                buffer[:n] = b"a" * n
                self.parts[0] = part - n
                if self.parts[0] == 0:
                    self.parts.pop(0)
                return n
            if part:
                n = min(len(part), len(buffer))
                buffer[:n] = part[:n]
                self.parts[0] = part[n:]
                return n
            self.parts.pop(0)
        return 0


def test_an_over_long_line_is_refused_in_bounded_pieces():
    """A 200 MiB line is read and dropped a bounded piece at a time: the reader's peak
    allocation stays near the limit (1 MiB), not the line's size."""
    import tracemalloc

    stream = io.BufferedReader(_Pieces(_good(1) + b'\n{"prompt": "', 200 << 20,
                                       b'"}\n' + _good(2) + b"\n"))
    tracemalloc.start()
    try:
        lines = list(jsonl.read_lines(stream, 1 << 20))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [line.number for line in lines] == [1, 2, 3]
    assert lines[1].error == "line 2: longer than the limit of 1 MiB (--max-line-mib); skipped"
    assert lines[0].request["id"] == "ok1" and lines[2].request["id"] == "ok2"
    assert peak < 8 << 20, peak


def test_a_huge_line_keeps_memory_bounded(tmp_path):
    """Before: a 100 MB prompt line drove RSS to 10 GB with 0 lines written. Now: a 64 MB
    line with --max-line-mib 1 gets an error result, the others are scored, and the peak
    RSS grows far less than the line's size."""
    small, big = tmp_path / "small.jsonl", tmp_path / "big.jsonl"
    small.write_bytes(_good(1) + b"\n")
    with open(big, "wb") as fh:
        fh.write(_good(1) + b'\n{"prompt": "')
        block = b"a" * (1 << 20)
        for _ in range(64):
            fh.write(block)
        fh.write(b'", "candidates": [" a"]}\n' + _good(3) + b"\n")
    code = textwrap.dedent(f"""
        import json, resource
        from serving.cli import main
        rss = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
        assert main(["score", {str(small)!r}, "-o", {str(tmp_path / "o1")!r}]) == 0
        before = rss()
        assert main(["score", {str(big)!r}, "-o", {str(tmp_path / "o2")!r},
                     "--max-line-mib", "1"]) == 0
        print(json.dumps([before, rss()]))
    """)
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=200,
                          env=dict(os.environ, PYTHONPATH=str(REPO), JAX_PLATFORMS="cpu"))
    assert done.returncode == 0, done.stderr
    before, after = json.loads(done.stdout.splitlines()[-1])
    assert (after - before) * 1024 < 16 << 20, (before, after)
    rows = _rows(tmp_path / "o2")
    assert [r["error"] for r in rows] == [
        None, "line 2: longer than the limit of 1 MiB (--max-line-mib); skipped", None]


# ----------------------------------------------------------------------------- item 11
def _broken_model_dir(tmp_path: Path, broken: str) -> Path:
    from moejax import demo

    source = Path(demo.ensure_demo_model())
    model = tmp_path / "model"
    model.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (model / name).write_bytes((source / name).read_bytes())
    (model / broken).write_text("{\n", encoding="utf-8")   # truncated: not JSON
    return model


@pytest.mark.parametrize("broken", ["config.json", "tokenizer.json"])
def test_a_broken_model_file_is_named(broken, tmp_path, capsys):
    """Before: a corrupted config.json gave "Expecting value: line 2 column 1" without the
    file's name; a corrupted tokenizer.json gave a bare traceback."""
    from serving import Scorer, Generator

    model = _broken_model_dir(tmp_path, broken)
    path = str(model / broken)
    with pytest.raises(ValueError, match="^" + re.escape(path) + ": "):
        Scorer(str(model))
    with pytest.raises(ValueError, match="^" + re.escape(path) + ": "):
        Generator(str(model))
    src = tmp_path / "in.jsonl"
    src.write_bytes(_good(1) + b"\n")
    for argv in (["score", str(src)], ["info"], ["generate", str(src)]):
        assert cli.main(argv + ["--model", str(model)]) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith(f"moejax: error: {path}: "), err
        assert err.count("\n") == 1, err
    if broken == "config.json":
        assert f"{path}: invalid JSON: Expecting" in err
    else:
        assert "not a valid Hugging Face tokenizer file" in err
    # serve in its own process: it installs signal handlers and runs a gRPC server.
    proc = _run_cli(["serve", "--port", "0", "--model", str(model)], stdout=subprocess.PIPE)
    out, err = (stream.decode() for stream in proc.communicate(timeout=180))
    assert proc.returncode == 2 and out.strip().isdigit(), (out, err)
    assert "Traceback" not in err and err.splitlines()[-1].startswith(
        f"moejax: error: {path}: "), err


def test_request_limits_and_prompt_sharing_are_command_options(tmp_path, capsys):
    """--max-text-bytes refuses a line's request before tokenizing it; --share-prompts and
    the limits reach the Scorer (``moejax info`` shows them)."""
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(json.dumps({"id": "a", "prompt": "Is it good?", "candidates": [" yes", " no"]})
                   + "\n" + json.dumps({"prompt": "x" * 101, "candidates": [" a"]}) + "\n")
    assert cli.main(["score", str(src), "-o", str(out), "--max-text-bytes", "100",
                     "--share-prompts", "false"]) == 0
    rows = _rows(out)
    assert rows[0]["error"] is None and len(rows[0]["logprobs"]) == 2
    assert rows[1]["error"] == ("line 2: prompt: the request's text (prompt and candidates) "
                                "is over the limit of 100 UTF-8 bytes (max_text_bytes)")
    capsys.readouterr()
    assert cli.main(["info", "--max-candidates", "7", "--share-prompts", "false"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["limits"]["max_candidates"] == 7 and info["share_prompts"] is False
    # the KV layout of the demo (grouped-query attention: keys and values per kv head)
    kv = info["kv_cache"]
    dims = kv["per_token_per_layer"]
    assert kv["stores"] == "per-head keys and values" and dims["key_dim"] == dims["value_dim"]
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[info["dtype"]]
    assert kv["bytes_per_token"] % (2 * dims["heads"] * dims["key_dim"] * itemsize) == 0
    assert info["model_type"] == "qwen3_moe" and info["dense_layers"] == []
