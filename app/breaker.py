"""A circuit breaker for one backend, shared by the request threads of a worker.

Written here rather than taken from pybreaker: pybreaker holds its lock for the whole guarded call
(danielfm/pybreaker#3; the PRs that removed it, #40/#41/#57/#77, were not merged), which would run one
Triton call at a time per worker and defeat batching; `circuitbreaker` takes no lock at all
(fabfuel/circuitbreaker#61). This one locks only its own state:

  closed     calls pass; `failures` consecutive failures open the circuit
  open       calls are refused for `reset_s`, or until probe_now() says the backend is back
  half-open  one probe call passes; its success closes the circuit, its failure opens it again

Time comes from `clock` (time.monotonic unless a test passes its own).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from app import metrics

log = logging.getLogger(__name__)
Clock = Callable[[], float]


class CircuitBreaker:
    CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"

    def __init__(self, name: str, *, failures: int, reset_s: float, clock: Clock = time.monotonic) -> None:
        self.name = name
        self._max_failures = failures
        self._reset_s = reset_s
        self._clock = clock
        self._state = self.CLOSED
        self._failures = 0
        self._opened_at = 0.0
        self._probing = False
        self._lock = threading.Lock()

    @property
    def state(self) -> str:
        with self._lock:
            if self._state == self.OPEN and self._clock() - self._opened_at >= self._reset_s:
                return self.HALF_OPEN  # the next allow() will let a probe through
            return self._state

    @property
    def is_open(self) -> bool:
        return self.state == self.OPEN

    def retry_in_s(self) -> float:
        return max(0.0, self._opened_at + self._reset_s - self._clock())

    def allow(self) -> bool:
        """May a call go to the backend now? In half-open, only one caller gets True (the probe)."""
        with self._lock:
            if self._state == self.CLOSED:
                return True
            if self._state == self.OPEN and self._clock() - self._opened_at >= self._reset_s:
                self._state, self._probing = self.HALF_OPEN, False
            if self._state == self.HALF_OPEN and not self._probing:
                self._probing = True
                return True
            return False

    def probe_now(self) -> None:
        """The backend answered a health check: let the next call probe it without waiting out reset_s."""
        with self._lock:
            if self._state == self.OPEN:
                self._state, self._probing = self.HALF_OPEN, False

    def record_success(self) -> None:
        with self._lock:
            self._failures = 0
            if self._state != self.CLOSED:
                self._state, self._probing = self.CLOSED, False
                log.info("circuit to %s closed: the probe succeeded", self.name)
                metrics.CIRCUIT_OPEN.labels(self.name).set(0)

    def record_failure(self, *, count: int = 1) -> None:
        """`count` failed calls (the requests of a failed batch each count)."""
        with self._lock:
            self._failures += count
            if self._state == self.HALF_OPEN or (self._state == self.CLOSED
                                                 and self._failures >= self._max_failures):
                self._state, self._probing, self._opened_at = self.OPEN, False, self._clock()
                log.warning("circuit to %s opened after %d consecutive failures; next probe in %.0f s",
                            self.name, self._failures, self._reset_s)
                metrics.CIRCUIT_OPEN.labels(self.name).set(1)
