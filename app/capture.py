"""Keep a bounded sample of accepted uploads, to replay them later (shim-report). Off by default.

Only answered uploads; at most `per_minute` files per worker and minute and `max_bytes` in the folder (the oldest
go first); each written under a temporary name, then renamed. A folder that cannot be written fails no request.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

from app import metrics

log = logging.getLogger(__name__)
MAGIC = ((b"\xff\xd8", "jpg"), (b"\x89PNG", "png"), (b"GIF8", "gif"), (b"BM", "bmp"), (b"II*\x00", "tif"),
         (b"MM\x00*", "tif"))
Clock = Callable[[], float]
PER_MINUTE = 60  # files kept per worker and minute
MAX_MB = 1024.0  # the folder's size; the oldest files go first


def extension(data: bytes) -> str:
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "webp"
    return next((ext for magic, ext in MAGIC if data.startswith(magic)), "img")


class Capture:
    def __init__(self, folder: Path, *, per_minute: int = PER_MINUTE, max_bytes: int = int(MAX_MB * 1024 * 1024),
                 clock: Clock = time.monotonic) -> None:
        self.folder = folder
        self._per_minute = per_minute
        self._max_bytes = max_bytes
        self._clock = clock
        self._recent: deque[float] = deque()
        self._lock = threading.Lock()
        self._complained = -60.0

    def offer(self, data: bytes, request_id: str) -> bool:
        """Keep this upload if the rate allows; True when it was written."""
        if not self._take_turn():
            metrics.CAPTURED.labels("skipped").inc()
            return False
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S.%fZ")
        name = f"{stamp}-{request_id}.{extension(data)}"
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            temporary = self.folder / f".{uuid.uuid4().hex}.tmp"
            temporary.write_bytes(data)
            os.replace(temporary, self.folder / name)
            self._trim()
        except OSError as e:
            with contextlib.suppress(OSError, UnboundLocalError):
                temporary.unlink(missing_ok=True)
            metrics.CAPTURED.labels("error").inc()
            self._complain(e)
            return False
        metrics.CAPTURED.labels("kept").inc()
        return True

    def _take_turn(self) -> bool:
        now = self._clock()
        with self._lock:
            while self._recent and now - self._recent[0] >= 60:
                self._recent.popleft()
            if len(self._recent) >= self._per_minute:
                return False
            self._recent.append(now)
            return True

    def _trim(self) -> None:
        """The oldest files go until the folder holds at most max_bytes (names sort by time)."""
        files = sorted(p for p in self.folder.iterdir() if p.is_file() and not p.name.startswith("."))
        sizes = [p.stat().st_size for p in files]
        total = sum(sizes)
        for path, size in zip(files, sizes, strict=True):
            if total <= self._max_bytes:
                break
            with contextlib.suppress(FileNotFoundError):  # another worker trimmed it first
                path.unlink()
            total -= size

    def _complain(self, error: OSError) -> None:
        now = self._clock()
        if now - self._complained >= 60:
            self._complained = now
            log.error("cannot keep captured uploads in %s: %s (requests are not affected)", self.folder, error)
