"""Logging of the ``moejax`` commands (serving/logs.py): timestamped text or JSON lines,
the request id where a call gives one, and every log call in the code base formattable
(``-v`` turns on records that a wrong placeholder count would crash on)."""

from __future__ import annotations

import ast
import io
import json
import logging
import os
import re
from pathlib import Path

import pytest

from serving.cli import build_parser
from serving.logs import JsonFormatter, TextFormatter, configure_logging

ROOT = Path(__file__).resolve().parent.parent
LEVELS = {"debug", "info", "warning", "error", "exception", "critical"}
TIME = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z"


def record(message: str, *args, request_id=None, exc=None) -> logging.LogRecord:
    made = logging.LogRecord("moejax.test", logging.INFO, "x.py", 1, message, args, exc)
    if request_id is not None:
        made.request_id = request_id
    return made


def test_text_lines_carry_a_utc_timestamp_and_the_request_id():
    line = TextFormatter().format(record("scored %d of %s", 3, "x", request_id="r-7"))
    assert re.fullmatch(TIME + r" INFO moejax\.test: scored 3 of x \[request r-7\]", line)
    try:
        raise ValueError("boom")
    except ValueError:
        import sys

        failed = TextFormatter().format(record("failed", exc=sys.exc_info()))
    assert failed.splitlines()[0].endswith("failed") and "ValueError: boom" in failed


def test_json_lines_are_one_object_each():
    entry = json.loads(JsonFormatter().format(record("a \"quoted\"\nline %s", "é",
                                                     request_id=12)))
    assert set(entry) == {"time", "level", "logger", "message", "request_id"}
    assert re.fullmatch(TIME, entry["time"])
    assert (entry["level"], entry["logger"], entry["message"], entry["request_id"]) == (
        "INFO", "moejax.test", "a \"quoted\"\nline é", "12")
    assert "request_id" not in json.loads(JsonFormatter().format(record("plain")))


def test_configure_logging_and_the_command_line_option():
    stream = io.StringIO()
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    try:
        # As logging.basicConfig: a process that set up its own logging keeps it.
        assert root.handlers and configure_logging(verbose=True, stream=stream) is None
        configure_logging(verbose=True, log_format="json", stream=stream, force=True)
        logging.getLogger("moejax.engine").info("compiled %s", "T=64", extra={"request_id": "q"})
        logging.getLogger("moejax.engine").debug("not shown at -v")
        (line,) = stream.getvalue().splitlines()
        assert json.loads(line)["request_id"] == "q"
        configure_logging(verbose=False, stream=stream, force=True)
        assert root.level == logging.WARNING and len(root.handlers) == 1
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
    with pytest.raises(ValueError, match="log format"):
        configure_logging(log_format="xml")
    parser = build_parser()
    assert parser.parse_args(["--log-format", "json", "info"]).log_format == "json"
    assert parser.parse_args(["info", "--log-format", "json"]).log_format == "json"
    assert parser.parse_args(["info"]).log_format == "text"
    assert parser.parse_args(["router", "--upstream", "a:1", "--log-format", "json"]
                             ).log_format == "json"


def _log_calls(tree: ast.AST):
    """(line, format string, positional argument count) of each ``x.<level>("...", ...)``."""
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in LEVELS and node.args):
            continue
        first = node.args[0]
        if not (isinstance(first, ast.Constant) and isinstance(first.value, str)):
            continue
        if any(isinstance(a, ast.Starred) for a in node.args):
            continue
        yield node.lineno, first.value, len(node.args) - 1


def test_every_log_call_in_the_code_formats():
    """Each log call whose message is a literal is formatted at debug level, with as many
    arguments as it passes: a wrong placeholder count fails here, not under ``-v``."""
    checked, failures = 0, []
    for package in ("moejax", "serving", "kernels_pallas", "benchmarks"):
        for path in sorted((ROOT / package).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=os.fspath(path))
            for line, message, count in _log_calls(tree):
                made = logging.LogRecord("check", logging.DEBUG, os.fspath(path), line,
                                         message, (1,) * count if count else None, None)
                try:
                    made.getMessage()
                    checked += 1
                except (TypeError, ValueError, KeyError) as exc:
                    failures.append(f"{path.relative_to(ROOT)}:{line}: {exc}")
    assert not failures, "\n".join(failures)
    assert checked > 50        # the scan found the code base's log calls
