"""One thread per worker waits on Triton for readiness; the others get the latest answer at once, with its
age, or, when that answer says nothing of now, a few of them wait for the check under way. The breaker's
health watcher is one thread for the breaker's life, however often it opens."""

from __future__ import annotations

import threading

from app.backends.base import Readiness
from app.breaker import CircuitBreaker
from app.readiness import Checked, SharedCheck
from tests.support import FakeClock, wait_until


class SlowCheck:
    """A readiness check that blocks until released, and counts how many threads are inside it at once."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.inside = 0
        self.most_inside = 0
        self.answer = Readiness(True, "triton is ready")
        self._lock = threading.Lock()

    def __call__(self) -> Readiness:
        with self._lock:
            self.inside += 1
            self.most_inside = max(self.most_inside, self.inside)
        self.release.wait(30)
        with self._lock:
            self.inside -= 1
        return self.answer


def test_while_one_thread_checks_the_others_get_the_latest_answer_at_once_with_its_age() -> None:
    clock, check = FakeClock(), SlowCheck()
    shared = SharedCheck(check, deadline_s=1.0, clock=clock, waiters=0)  # none waits for the first check
    first = threading.Thread(target=shared)
    first.start()
    wait_until(lambda: check.inside == 1, 10, "the first check to start")
    answers = [shared() for _ in range(20)]  # would block here if each caller checked for itself
    assert check.most_inside == 1
    assert all(not a.fresh and not a.readiness.ready for a in answers)
    assert "first readiness check" in answers[0].readiness.detail
    check.release.set()
    first.join(timeout=10)

    check.release.clear()
    clock.advance(0.5)
    second = threading.Thread(target=shared)
    second.start()
    wait_until(lambda: check.inside == 1, 10, "the second check to start")
    clock.advance(0.4)
    latest = shared()
    assert latest.readiness.ready and latest.readiness.age_s == 0.9 and not latest.fresh
    clock.advance(0.7)  # the check under way has now waited 1.1 s, past its deadline: "ready" is not repeated
    stale = shared().readiness
    assert not stale.ready and "has waited 1.1 s for Triton" in stale.detail, stale
    check.release.set()
    second.join(timeout=10)
    mine = shared()
    assert mine.fresh and mine.readiness.ready and mine.readiness.age_s == 0.0


def test_a_ready_answer_from_before_a_quiet_spell_is_not_repeated_while_a_check_is_under_way() -> None:
    """A worker nobody probed for a while (Triton may have hung since): only the check under way can tell, so two
    callers wait for it and get its answer; a third, beyond WAITERS, gets the 503 at once."""
    clock, check = FakeClock(), SlowCheck()
    shared = SharedCheck(check, deadline_s=5.0, clock=clock, waiters=2)
    check.release.set()
    assert shared().readiness.ready
    check.release.clear()
    clock.advance(40.0)
    under_way = threading.Thread(target=shared)
    under_way.start()
    wait_until(lambda: check.inside == 1, 10, "the check to start")
    waited: list[Checked] = []
    waiters = [threading.Thread(target=lambda: waited.append(shared())) for _ in range(2)]
    for thread in waiters:
        thread.start()
    wait_until(lambda: shared.waiting == 2, 10, "two callers to wait for the check under way")
    clock.advance(0.2)
    meanwhile = shared()  # would wait too if the waiters were not bounded
    assert not meanwhile.fresh and not meanwhile.readiness.ready, meanwhile
    assert "under way; its last answer is 40.2 s old" in meanwhile.readiness.detail
    assert not waited and check.inside == 1 and shared.waiting == 2  # it answered while the two still waited
    check.answer = Readiness(False, "model 'resnet50' is not ready")
    check.release.set()
    for thread in (under_way, *waiters):
        thread.join(timeout=10)
    assert [(c.fresh, c.readiness.ready, c.readiness.detail, c.readiness.age_s) for c in waited] == \
        [(False, False, "model 'resnet50' is not ready", 0.0)] * 2


def test_a_caller_waits_for_the_check_under_way_no_longer_than_its_deadline() -> None:
    """Triton hangs: a waiter gives up when the check's deadline passes (real time here: deadline 0.3 s) and
    answers 503 while the check itself still waits."""
    check = SlowCheck()
    shared = SharedCheck(check, deadline_s=0.3)
    under_way = threading.Thread(target=shared)
    under_way.start()
    try:
        wait_until(lambda: check.inside == 1, 10, "the first check to start")
        waited = shared()
        assert not waited.readiness.ready and "first readiness check" in waited.readiness.detail, waited
        assert check.inside == 1 and shared.waiting == 0
    finally:
        check.release.set()
        under_way.join(timeout=10)


def test_a_hundred_open_and_recover_cycles_use_one_health_watcher_thread() -> None:
    watchers: set[threading.Thread] = set()  # the objects, not their idents (a new thread may reuse one)

    def health() -> bool:
        watchers.add(threading.current_thread())
        return True

    breaker = CircuitBreaker("cycled", failures=1, reset_s=60, health=health, health_interval_s=0.001)
    try:
        for cycle in range(100):
            breaker.record_failure()
            wait_until(lambda: breaker.state == "half_open", 10, f"the watcher to see it healthy ({cycle})",
                       interval_s=0.001)
            assert breaker.allow()
            breaker.record_success()
        threads = [t for t in threading.enumerate() if t.name == "breaker-cycled"]
        assert len(threads) == 1 and len(watchers) == 1, (threads, watchers)
    finally:
        breaker.close()
    wait_until(lambda: not any(t.name == "breaker-cycled" for t in threading.enumerate()), 10, "the watcher to stop")
