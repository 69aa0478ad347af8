"""Automatic canary rollback: when Triton fails too large a share of one worker's canary requests over a
window, the canary share goes to 0 for every worker (through the flag file), with the reason. A flag file the shim
cannot write (a ConfigMap) is the operator's: the rollback is logged and counted for them to act.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from app import metrics
from app.errors import FlagNotWritable
from app.settings import Mode
from app.traffic import TrafficFlag

log = logging.getLogger(__name__)
Clock = Callable[[], float]
ERROR_RATE = 0.2  # the share of a window's canary requests Triton may fail
WINDOW_S = 60.0
MIN_REQUESTS = 20  # canary requests in the window before its rate counts


class ErrorWindow:
    """Outcomes of Triton calls over the last `window_s` seconds, in one worker."""

    def __init__(self, window_s: float, clock: Clock = time.monotonic) -> None:
        self._window_s = window_s
        self._clock = clock
        self._events: deque[tuple[float, bool]] = deque()
        self._lock = threading.Lock()

    def record(self, ok: bool) -> tuple[int, int]:
        """Add one outcome; return (failures, calls) within the window."""
        now = self._clock()
        with self._lock:
            self._events.append((now, ok))
            while self._events and now - self._events[0][0] > self._window_s:
                self._events.popleft()
            failures = sum(1 for _, good in self._events if not good)
            return failures, len(self._events)

    def clear(self) -> None:
        with self._lock:
            self._events.clear()


class AutoRollback:
    def __init__(self, flag: TrafficFlag, *, error_rate: float = ERROR_RATE, window_s: float = WINDOW_S,
                 min_requests: int = MIN_REQUESTS, clock: Clock = time.monotonic) -> None:
        self._flag = flag
        self._error_rate = error_rate
        self._window_s = window_s
        self._min_requests = min_requests
        self._errors = ErrorWindow(window_s, clock)

    def record(self, *, ok: bool) -> None:
        """One Triton outcome of a canary request; rolls back when the error rate crosses the threshold."""
        state = self._flag.current()
        if state.mode is not Mode.CANARY or state.canary_percent == 0:
            return
        failures, calls = self._errors.record(ok)
        if calls < self._min_requests or failures / calls < self._error_rate:
            return
        reason = (f"automatic rollback: Triton failed {failures} of the last {calls} canary requests in "
                  f"{self._window_s:.0f} s ({failures / calls:.0%} >= {self._error_rate:.0%}); "
                  f"canary share {state.canary_percent}% -> 0%")
        self._errors.clear()
        log.error("%s", reason)
        metrics.ROLLBACKS.inc()
        try:
            self._flag.write({"canary_percent": 0, "reason": reason}, updated_by="auto-rollback")
        except FlagNotWritable as e:  # a read-only (ConfigMap) flag: one source of traffic, the operator's
            log.error("%s; set the canary share to 0 in the ConfigMap", e.message)
