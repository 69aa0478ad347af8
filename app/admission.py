"""Admission control of one worker: a bound on the /predict requests it holds, and their CPU work in order.

    admit()  at most `max_pending` /predict requests in this worker at once (decoding, queued, waiting
             for Triton); one more is refused at once with Overloaded (503 + Retry-After), so overload
             becomes fast refusals instead of a queue that grows without bound. The worker keeps more
             threads than that (app/settings.py: threads), so /healthz and /readyz always find one.
    turn()   decoding and preprocessing, `slots` requests at a time, in arrival order: a request that
             arrived earlier finishes its CPU work earlier, instead of every request of a burst sharing
             the cores and all finishing late.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Iterator

from app import metrics
from app.errors import Overloaded

DECODE_SLOTS = 2  # requests of a worker that decode and preprocess at once, in arrival order
RETRY_AFTER_S = 1  # what the 503 of a full worker tells clients to wait


class Admission:
    def __init__(self, *, max_pending: int, slots: int = DECODE_SLOTS, retry_after_s: int = RETRY_AFTER_S) -> None:
        self.max_pending = max_pending
        self._slots = slots
        self._retry_after_s = retry_after_s
        self._lock = threading.Lock()
        self._pending = 0
        self._working = 0
        self._waiting: collections.deque[threading.Event] = collections.deque()

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

    @contextlib.contextmanager
    def turn(self) -> Iterator[None]:
        """One of the CPU slots, handed out first come, first served."""
        with self._lock:
            if self._working < self._slots and not self._waiting:
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
