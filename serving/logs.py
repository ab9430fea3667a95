"""How the ``moejax`` commands log: a timestamp on every line, as text or as JSON.

``text`` (the default) is one line a record: an ISO 8601 UTC time with milliseconds, the
level, the logger and the message. ``json`` is one JSON object a line, for log shippers:
``time``, ``level``, ``logger``, ``message``, and ``request_id`` when the call passed one
(``log.info("...", extra={"request_id": rid})``), plus ``exception`` with the traceback
when the record carries one. Both go to stderr, leaving stdout to the commands' output.
"""

from __future__ import annotations

import datetime
import json
import logging
import sys
from typing import TextIO

LOG_FORMATS = ("text", "json")


def _utc_time(record: logging.LogRecord) -> str:
    moment = datetime.datetime.fromtimestamp(record.created, tz=datetime.timezone.utc)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


class TextFormatter(logging.Formatter):
    """``2026-11-29T13:44:49.123Z INFO moejax.engine: message`` (+ the traceback)."""

    def format(self, record: logging.LogRecord) -> str:
        line = f"{_utc_time(record)} {record.levelname} {record.name}: {record.getMessage()}"
        request_id = getattr(record, "request_id", None)
        if request_id is not None:
            line += f" [request {request_id}]"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object a line (the module docstring)."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {"time": _utc_time(record), "level": record.levelname,
                 "logger": record.name, "message": record.getMessage()}
        request_id = getattr(record, "request_id", None)
        if request_id is not None:
            entry["request_id"] = str(request_id)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def configure_logging(verbose: bool = False, log_format: str = "text",
                      stream: TextIO | None = None, force: bool = False
                      ) -> logging.Handler | None:
    """Send every record of INFO (``verbose``) or WARNING and above to ``stream`` (default
    stderr) in ``log_format``; returns the handler. As ``logging.basicConfig``, nothing is
    changed (None is returned) when the root logger already has handlers, i.e. when the
    process that calls the ``moejax`` command in-process configured its own logging,
    unless ``force`` (then they are replaced)."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {LOG_FORMATS}, got {log_format!r}")
    root = logging.getLogger()
    if root.handlers and not force:
        return None
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(logging.INFO if verbose else logging.WARNING)
    return handler


__all__ = ("LOG_FORMATS", "JsonFormatter", "TextFormatter", "configure_logging")
