"""Logs as one JSON object per line, each carrying the request ID of the request being served."""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time
from typing import Any

REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)
_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "pid": record.process,  # which gunicorn worker wrote the line
        }
        request_id = getattr(record, "request_id", None) or REQUEST_ID.get()
        if request_id:
            entry["request_id"] = request_id
        entry.update({k: v for k, v in vars(record).items() if k not in _STANDARD and k != "request_id"})
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure_logging(level: str) -> None:
    """JSON lines on stderr for the root logger, warnings included; idempotent (create_app may run again)."""
    root = logging.getLogger()
    root.setLevel(level.upper())
    if not any(isinstance(h.formatter, JsonFormatter) for h in root.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(JsonFormatter())
        root.addHandler(handler)
    logging.captureWarnings(True)  # torch's, Pillow's: through the same JSON handler, not as plain text


def gunicorn_logconfig(level: str) -> dict[str, Any]:
    """gunicorn's logconfig_dict: its own lines (master and workers) as JSON too, on stderr."""
    handler = {"class": "logging.StreamHandler", "formatter": "json", "stream": "ext://sys.stderr"}
    logger = {"level": level.upper(), "handlers": ["json"], "propagate": False}
    # No access log: the app writes one line per /predict with its request ID; probes would be noise.
    access = {**logger, "level": "WARNING"}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"json": {"()": JsonFormatter}},
        "handlers": {"json": handler},
        "loggers": {"gunicorn.error": logger, "gunicorn.access": access, "py.warnings": logger},
        "root": {"level": level.upper(), "handlers": ["json"]},
    }
