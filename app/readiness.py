"""Readiness checks of Triton, shared by the threads of a worker: at most one waits on Triton at a time.

/readyz is unauthenticated, and a hung Triton would hold every thread that checks for its whole deadline; so one
thread checks and the others get the latest answer at once, with its age. A "ready" answer is not repeated once
the check under way is past its deadline, nor when it was older than the deadline when that check began.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from app.backends.base import Readiness

Clock = Callable[[], float]
DEADLINE_S = 1.0  # /readyz answers within about this, 503 when Triton does not


@dataclass(frozen=True)
class Checked:
    readiness: Readiness  # its age_s says how old it is: 0 when this caller ran the check itself
    fresh: bool  # this caller ran the check


class SharedCheck:
    def __init__(self, check: Callable[[], Readiness], *, deadline_s: float = DEADLINE_S,
                 clock: Clock = time.monotonic) -> None:
        self._check = check
        self._deadline_s = deadline_s
        self._clock = clock
        self._running = threading.Lock()  # held by the one thread that waits on Triton
        self._lock = threading.Lock()  # guards what follows
        self._latest: Readiness | None = None
        self._latest_at = 0.0
        self._since: float | None = None  # when the check under way started

    def __call__(self) -> Checked:
        if self._running.acquire(blocking=False):
            try:
                with self._lock:
                    self._since = self._clock()
                result = self._check()
                with self._lock:
                    self._latest, self._latest_at = result, self._clock()
                return Checked(result, fresh=True)
            finally:
                with self._lock:
                    self._since = None
                self._running.release()
        return Checked(self._latest_answer(), fresh=False)

    def _latest_answer(self) -> Readiness:
        with self._lock:
            latest, at, since = self._latest, self._latest_at, self._since
        now = self._clock()
        if latest is None:
            return Readiness(False, "the first readiness check of Triton is under way")
        age = round(now - at, 3)
        waited = now - since if since is not None else 0.0
        if latest.ready and waited > self._deadline_s:
            return Readiness(False, f"a readiness check has waited {waited:.1f} s for Triton (its last answer, "
                                    f"{age:.1f} s ago, was: {latest.detail})", age_s=age)
        if latest.ready and since is not None and since - at > self._deadline_s:
            # A "ready" from before a quiet spell says nothing of now (a worker that nobody probed while Triton
            # hung): only the check under way can tell.
            return Readiness(False, f"a readiness check of Triton is under way; its last answer is {age:.1f} s "
                                    f"old", age_s=age)
        return replace(latest, age_s=age)
