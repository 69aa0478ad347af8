"""Logs as one JSON object per line, each carrying the request ID of the request being served.

Lines below WARNING are written in batches, as nginx's `access_log ... buffer= flush=` does: one write a tenth of a
second (or per 64 KiB) instead of one per request, since each write gives up the GIL to a worker's other threads
(bench/RESULTS.md, "The log line and the request ID"). A warning or an error goes out at once, after the lines
before it; a worker that exits flushes (logging.shutdown), one killed outright loses at most FLUSH_S of lines.
"""

from __future__ import annotations

import contextvars
import json
import logging
import os
import sys
import threading
import time
import uuid
import weakref
from typing import Any, TextIO

REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)
_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}
FLUSH_S = 0.1  # the most a line below WARNING waits to be written
BUFFER_BYTES = 64 * 1024  # or until this much waits


class BufferedStreamHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """A StreamHandler whose lines below WARNING wait up to FLUSH_S (or BUFFER_BYTES) to be written together."""

    def __init__(self, stream: TextIO | None = None, flush_s: float = FLUSH_S) -> None:
        super().__init__(stream)
        self.flush_s = flush_s
        self._lines: list[str] = []
        self._size = 0
        self._flusher_pid: int | None = None
        _BUFFERED.add(self)

    def emit(self, record: logging.LogRecord) -> None:  # called under self.lock (Handler.handle)
        try:
            line = self.format(record) + self.terminator
        except Exception:
            self.handleError(record)
            return
        self._lines.append(line)
        self._size += len(line)
        if record.levelno >= logging.WARNING or self._size >= BUFFER_BYTES:
            self._write()
        elif self._flusher_pid != os.getpid():  # threads do not survive a fork: each worker starts its own
            self._flusher_pid = os.getpid()
            threading.Thread(target=self._flush_every, name="log-flusher", daemon=True).start()

    def flush(self) -> None:
        with self.lock:  # type: ignore[union-attr]
            self._write()

    def _write(self) -> None:
        if self._lines:
            text, self._lines, self._size = "".join(self._lines), [], 0
            try:
                self.stream.write(text)
                self.stream.flush()
            except Exception:  # a closed or full stream must not fail the request that logged
                pass

    def _flush_every(self) -> None:
        while self._flusher_pid == os.getpid():
            time.sleep(self.flush_s)
            self.flush()


_BUFFERED: weakref.WeakSet[BufferedStreamHandler] = weakref.WeakSet()


def _flush_before_fork() -> None:
    """A fork copies what waits: the parent writes it first, the child drops what another thread added since."""
    for handler in list(_BUFFERED):
        handler.flush()


def _drop_in_child() -> None:
    for handler in list(_BUFFERED):
        handler._lines, handler._size = [], 0


os.register_at_fork(before=_flush_before_fork, after_in_child=_drop_in_child)


class _RequestIds:
    """uuid4's 16 random bytes per ID, drawn 4 KiB at a time: one getrandom call for 256 requests instead of one
    each (a call gives up the GIL). A forked worker draws its own, so no two workers share an ID."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool, self._at = b"", 0
        os.register_at_fork(after_in_child=self._forget)

    def new(self) -> str:
        with self._lock:
            if self._at == len(self._pool):
                self._pool, self._at = os.urandom(4096), 0
            raw, self._at = self._pool[self._at:self._at + 16], self._at + 16
        return uuid.UUID(bytes=raw, version=4).hex

    def _forget(self) -> None:
        self._lock = threading.Lock()
        self._pool, self._at = b"", 0


new_request_id = _RequestIds().new


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
        handler = BufferedStreamHandler(sys.stderr)
        handler.setFormatter(JsonFormatter())
        root.addHandler(handler)
    logging.captureWarnings(True)  # torch's, Pillow's: through the same JSON handler, not as plain text


def gunicorn_logconfig(level: str) -> dict[str, Any]:
    """gunicorn's logconfig_dict: its own lines (master and workers) as JSON too, on stderr."""
    handler = {"class": "app.logs.BufferedStreamHandler", "formatter": "json", "stream": "ext://sys.stderr"}
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
