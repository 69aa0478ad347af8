"""Admission control of one worker: a bound on the /predict requests it holds, and their CPU work in order.

admit() refuses a request over `max_pending` at once (Overloaded, 503 + Retry-After): fast refusals, not a queue
that grows; turn() runs decoding `slots` at a time in arrival order, so the early requests of a burst finish early;
large() lets LARGE_SLOTS bodies over LARGE_BODY_BYTES in at once and trims malloc after each (app/malloc.py).
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Iterator

from app import malloc, metrics
from app.errors import Overloaded

DECODE_SLOTS = 2  # requests of a worker that decode and preprocess at once, in arrival order
RETRY_AFTER_S = 1  # what the 503 of a full worker tells clients to wait
LARGE_BODY_BYTES = 4 << 20  # a 640x480 photo is ~100 KB, a 12 MP phone photo 3-5 MB
LARGE_SLOTS = 2  # measured: the worst input's peak (bench/RESULTS.md, "Memory")


class _Slots:
    """`count` slots handed out first come, first served."""

    def __init__(self, count: int) -> None:
        self._count = count
        self._lock = threading.Lock()
        self._working = 0
        self._waiting: collections.deque[threading.Event] = collections.deque()

    @contextlib.contextmanager
    def take(self) -> Iterator[None]:
        with self._lock:
            if self._working < self._count and not self._waiting:
                self._working += 1
                mine = None
            else:
                mine = threading.Event()
                self._waiting.append(mine)
        if mine is not None:
            mine.wait()  # the slot is handed over by the request that leaves it: _working stays counted
        try:
            yield
        finally:
            with self._lock:
                if self._waiting:
                    self._waiting.popleft().set()
                else:
                    self._working -= 1


class Admission:
    def __init__(self, *, max_pending: int, slots: int = DECODE_SLOTS, retry_after_s: int = RETRY_AFTER_S) -> None:
        self.max_pending = max_pending
        self._retry_after_s = retry_after_s
        self._lock = threading.Lock()
        self._pending = 0
        self._cpu = _Slots(slots)
        self._large = _Slots(LARGE_SLOTS)

    @property
    def pending(self) -> int:
        return self._pending

    @contextlib.contextmanager
    def admit(self) -> Iterator[None]:
        with self._lock:
            if self._pending >= self.max_pending:
                metrics.REJECTED.labels("overloaded").inc()
                raise Overloaded(f"this worker holds {self.max_pending} requests already; retry in "
                                 f"{self._retry_after_s} s", retry_after_s=self._retry_after_s)
            self._pending += 1
        try:
            yield
        finally:
            with self._lock:
                self._pending -= 1

    def turn(self) -> contextlib.AbstractContextManager[None]:
        """One of the CPU slots, handed out first come, first served."""
        return self._cpu.take()

    @contextlib.contextmanager
    def large(self, declared_bytes: int | None) -> Iterator[None]:
        """Around reading and answering a body: one of LARGE_SLOTS if it is large (None: chunked, unknown)."""
        if declared_bytes is not None and declared_bytes <= LARGE_BODY_BYTES:
            yield
            return
        with self._large.take():
            try:
                yield
            finally:
                malloc.trim()
