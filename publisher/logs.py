"""Structured logging: a short fixed message plus fields, printed as text or one JSON object.

Modules log with `log.info("map held", extra={"map": ..., "reason": ...})`; both formats show the
same fields, so text is readable and JSON is greppable by field. A field whose value is None is
left out of both.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime

# Attributes every LogRecord has; anything else on a record came from `extra`.
_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}


def _fields(record: logging.LogRecord) -> dict[str, object]:
    # A field that is None says nothing (`namespace=None` for all namespaces reads as a value).
    return {k: v for k, v in vars(record).items() if k not in _STANDARD and v is not None}


def _timestamp(record: logging.LogRecord) -> str:
    return datetime.fromtimestamp(record.created, UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "time": _timestamp(record),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        entry.update(_fields(record))
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        fields = " ".join(f"{k}={json.dumps(v, default=str) if isinstance(v, str) and (' ' in v or not v) else v}" for k, v in _fields(record).items())
        line = f"{_timestamp(record)} {record.levelname.lower():7} {record.getMessage()}" + (f" {fields}" if fields else "")
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def configure(log_format: str, level: str) -> None:
    """Send every log record to stderr in `log_format` (text or json) at `level` and above."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # kubernetes_asyncio and aiohttp log per request at info; keep their warnings only.
    for noisy in ("kubernetes_asyncio", "aiohttp.access"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
