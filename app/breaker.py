"""A circuit breaker for one backend, shared by the request threads of a worker.

Not pybreaker: it holds its lock for the whole guarded call (danielfm/pybreaker#3), one Triton call at a time per
worker, which defeats batching; this one locks only its own state. While open, one thread for the breaker's whole
life asks `health` every `health_interval_s`, so that a backend that comes back is used within about a second (a
thread per opening would leave a tritonclient client behind each time). Time comes from `clock`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)
Clock = Callable[[], float]
FAILURES = 5  # consecutive Triton failures that open the circuit
RESET_S = 10.0  # how long the circuit stays open before one probe request


class CircuitBreaker:
    CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"

    def __init__(self, name: str, *, failures: int = FAILURES, reset_s: float = RESET_S, clock: Clock = time.monotonic,
                 health: Callable[[], bool] | None = None, health_interval_s: float = 0.5) -> None:
        self.name = name
        self._health = health
        self._health_interval_s = health_interval_s
        self._watcher: threading.Thread | None = None
        self.on_change: Callable[[], None] = lambda: None
        self._max_failures = failures
        self._reset_s = reset_s
        self._clock = clock
        self._state = self.CLOSED
        self._failures = 0
        self._opened_at = 0.0
        self._probing = False
        self._probe_at = 0.0
        self._closed = False
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # the watcher waits on it between openings

    @property
    def state(self) -> str:
        with self._lock:
            if self._state == self.OPEN and self._clock() - self._opened_at >= self._reset_s:
                return self.HALF_OPEN  # the next allow() will let a probe through
            return self._state

    def retry_in_s(self) -> float:
        return max(0.0, self._opened_at + self._reset_s - self._clock())

    def allow(self) -> bool:
        """May a call go to the backend now? In half-open, only one caller gets True (the probe)."""
        with self._lock:
            if self._state == self.CLOSED:
                return True
            if self._state == self.OPEN and self._clock() - self._opened_at >= self._reset_s:
                self._state, self._probing = self.HALF_OPEN, False
            if self._state == self.HALF_OPEN and (not self._probing or self._clock() - self._probe_at >= self._reset_s):
                self._probing, self._probe_at = True, self._clock()
                return True
            return False

    def probe_now(self) -> None:
        """The backend answered a health check: let the next call probe it without waiting out reset_s."""
        with self._lock:
            if self._state != self.OPEN:
                return
            self._state, self._probing = self.HALF_OPEN, False
            self._changed.notify_all()
        self.on_change()

    def record_success(self) -> None:
        with self._lock:
            self._failures = 0
            if self._state == self.CLOSED:
                return
            self._state, self._probing = self.CLOSED, False
            self._changed.notify_all()
        log.info("circuit to %s closed: the probe succeeded", self.name)
        self.on_change()

    def record_failure(self, *, count: int = 1) -> None:
        """`count` failed calls (the requests of a failed batch each count)."""
        with self._lock:
            self._failures += count
            if not (self._state == self.HALF_OPEN or (self._state == self.CLOSED
                                                      and self._failures >= self._max_failures)):
                return
            self._state, self._probing, self._opened_at = self.OPEN, False, self._clock()
            failures = self._failures
            self._watch()
            self._changed.notify_all()
        log.warning("circuit to %s opened after %d consecutive failures; next probe in %.0f s",
                    self.name, failures, self._reset_s)
        self.on_change()

    def close(self) -> None:
        """Stop the health watcher (the worker is shutting down)."""
        with self._lock:
            self._closed = True
            self._changed.notify_all()

    def _watch(self) -> None:
        """Start the health watcher the first time the circuit opens (called with the lock held)."""
        if self._health is not None and self._watcher is None:
            self._watcher = threading.Thread(target=self._watch_health, name=f"breaker-{self.name}", daemon=True)
            self._watcher.start()

    def _cooling(self) -> bool:
        """Open and still within the cool-down (called with the lock held)."""
        return self._state == self.OPEN and self._clock() - self._opened_at < self._reset_s

    def _watch_health(self) -> None:
        assert self._health is not None
        while True:
            with self._lock:
                while not self._cooling() and not self._closed:
                    self._changed.wait()
                if self._closed:
                    return
                self._changed.wait(self._health_interval_s)  # a change (or close) wakes it early
                if not self._cooling() or self._closed:
                    continue
            try:
                healthy = self._health()
            except Exception:  # the watcher's outermost frame: a failing check is a "not yet"
                log.exception("the health check of %s failed", self.name)
                healthy = False
            if healthy:
                log.info("%s answers its health check again: the next call probes it", self.name)
                self.probe_now()
