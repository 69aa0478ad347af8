"""Readiness checks of Triton, shared by the threads of a worker: at most one waits on Triton at a time.

/readyz is unauthenticated, and a hung Triton would hold every thread that checks for its whole deadline; so one
thread checks and the others get the latest answer at once, with its age. A "ready" answer is not repeated once
the check under way is past its deadline, nor when it was older than the deadline when that check began. When the
latest answer says nothing of now (none yet, or a "ready" from before a quiet spell), up to WAITERS callers wait
for the check under way, within its deadline: two probers (a kubelet and a blackbox exporter) get the same answer,
while a flood holds at most WAITERS more threads for at most the deadline.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from app.backends.base import Readiness

Clock = Callable[[], float]
DEADLINE_S = 1.0  # /readyz answers within about this, 503 when Triton does not
WAITERS = 2  # callers per worker that may wait for the check under way instead of an answer that says nothing


@dataclass(frozen=True)
class Checked:
    readiness: Readiness  # its age_s says how old it is: 0 when this caller ran the check itself
    fresh: bool  # this caller ran the check


class SharedCheck:
    def __init__(self, check: Callable[[], Readiness], *, deadline_s: float = DEADLINE_S,
                 clock: Clock = time.monotonic, waiters: int = WAITERS) -> None:
        self._check = check
        self._deadline_s = deadline_s
        self._clock = clock
        self._running = threading.Lock()  # held by the one thread that waits on Triton
        self._max_waiters = waiters
        self._lock = threading.Lock()  # guards what follows
        self._done = threading.Condition(self._lock)  # notified when a check ends
        self._checks = 0  # checks ended so far
        self.waiting = 0  # callers waiting for the check under way now
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
                    self._checks += 1
                    self._done.notify_all()
                self._running.release()
        self._wait_if_the_latest_says_nothing_of_now()
        return Checked(self._latest_answer(), fresh=False)

    def _before_a_quiet_spell(self, latest: Readiness, at: float, since: float | None) -> bool:
        """A "ready" older than the deadline when the check under way began says nothing of now."""
        return latest.ready and since is not None and since - at > self._deadline_s

    def _wait_if_the_latest_says_nothing_of_now(self) -> None:
        """No answer yet, or one from before a quiet spell: wait for the check under way (up to WAITERS callers),
        within its deadline."""
        with self._done:
            since, latest = self._since, self._latest
            if since is None or self.waiting >= self._max_waiters:
                return
            if latest is not None and not self._before_a_quiet_spell(latest, self._latest_at, since):
                return
            checks = self._checks
            self.waiting += 1
            try:
                self._done.wait_for(lambda: self._checks != checks,
                                    timeout=max(0.0, since + self._deadline_s - self._clock()))
            finally:
                self.waiting -= 1

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
        if self._before_a_quiet_spell(latest, at, since):
            # A "ready" from before a quiet spell says nothing of now (a worker that nobody probed while Triton
            # hung): only the check under way can tell.
            return Readiness(False, f"a readiness check of Triton is under way; its last answer is {age:.1f} s "
                                    f"old", age_s=age)
        return replace(latest, age_s=age)
