"""Admission control: a full worker refuses at once, health never waits, CPU work goes in arrival order."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from app.admission import LARGE_BODY_BYTES, LARGE_SLOTS, RETRY_AFTER_S, Admission
from app.breaker import CircuitBreaker
from app.errors import Overloaded
from tests.support import FakeClock, wait_until
from tests.unit.test_api import make_app

pytestmark = pytest.mark.prod  # make test-prod runs these too: numpy 2, no torch, no Triton


def test_a_full_worker_refuses_at_once_with_retry_after(tmp_path: Path) -> None:
    app = make_app(tmp_path, max_pending=2)
    app.triton.hang.set()  # the admitted requests wait for Triton
    answers: list[int] = []
    held = [threading.Thread(target=lambda: answers.append(app.predict().status_code)) for _ in range(2)]
    for t in held:
        t.start()
    wait_until(lambda: app.flask.extensions["shim"].admission.pending == 2, 10, "two requests held")
    refused = app.predict()
    assert refused.status_code == 503 and refused.headers["Retry-After"] == str(RETRY_AFTER_S)
    assert refused.json["error"] == "overloaded" and set(refused.json) == {"error", "message"}
    assert app.client.get("/healthz").status_code == 200  # health answers while the worker is full
    assert app.client.get("/readyz").status_code == 503  # (Triton hangs: not ready, but it answers)
    app.triton.hang.clear()
    for t in held:
        t.join(timeout=30)
    assert answers == [200, 200]
    assert app.predict().status_code == 200, "room again once they are answered"
    app.flask.extensions["shim"].close()


def test_cpu_turns_are_handed_out_in_arrival_order() -> None:
    admission = Admission(max_pending=10, slots=1, retry_after_s=1)
    order: list[int] = []
    release = threading.Event()

    def first() -> None:
        with admission.turn():
            release.wait(10)
            order.append(0)

    def later(i: int) -> None:
        with admission.turn():
            order.append(i)

    threads = [threading.Thread(target=first)]
    threads[0].start()
    wait_until(lambda: admission._cpu._working == 1, 5, "the first turn")
    for i in range(1, 6):  # each waits behind the ones before it
        threads.append(threading.Thread(target=later, args=(i,)))
        threads[-1].start()
        wait_until(lambda n=i: len(admission._cpu._waiting) == n, 5, f"request {i} to queue")
    release.set()
    for t in threads:
        t.join(timeout=10)
    assert order == [0, 1, 2, 3, 4, 5]
    assert admission._cpu._working == 0 and not admission._cpu._waiting


def test_admit_counts_and_refuses_beyond_the_bound() -> None:
    admission = Admission(max_pending=1, slots=1, retry_after_s=2)
    with admission.admit():
        with pytest.raises(Overloaded) as refused, admission.admit():
            pass
        assert refused.value.headers() == {"Retry-After": "2"}
    with admission.admit():
        assert admission.pending == 1


def test_the_gunicorn_threads_leave_room_for_health_checks_beyond_the_bound() -> None:
    from app.settings import Settings

    assert Settings(max_pending=12).threads >= 12 + 2
    assert Settings().threads >= Settings().max_pending + 2


def test_an_open_circuit_probes_as_soon_as_the_backend_answers_its_health_check() -> None:
    healthy = threading.Event()
    calls: list[bool] = []

    def health() -> bool:
        calls.append(healthy.is_set())
        return healthy.is_set()

    breaker = CircuitBreaker("fake", failures=1, reset_s=3600, clock=FakeClock(), health=health,
                             health_interval_s=0.01)
    breaker.record_failure()
    assert breaker.state == "open"
    wait_until(lambda: len(calls) >= 3, 10, "a few health checks while it is down")
    assert breaker.state == "open", "not healthy yet: still open"
    healthy.set()
    wait_until(lambda: breaker.state == "half_open", 10, "the circuit to let a probe through")
    assert breaker.allow() and not breaker.allow()


def test_large_bodies_take_one_of_two_slots_and_small_ones_pass() -> None:
    admission = Admission(max_pending=10, slots=1, retry_after_s=1)
    inside: list[int] = []
    most = [0]
    lock = threading.Lock()
    release = threading.Event()

    def large(declared: int | None) -> None:
        with admission.large(declared):
            with lock:
                inside.append(1)
                most[0] = max(most[0], len(inside))
            release.wait(10)
            with lock:
                inside.pop()

    big = LARGE_BODY_BYTES + 1
    threads = [threading.Thread(target=large, args=(size,)) for size in (big, None, big)]  # None: chunked
    for t in threads:
        t.start()
    wait_until(lambda: len(inside) == LARGE_SLOTS, 10, "two large bodies inside")
    with admission.large(LARGE_BODY_BYTES):  # a small body never waits for them
        pass
    assert len(inside) == LARGE_SLOTS, "the third large body waits"
    release.set()
    for t in threads:
        t.join(timeout=10)
    assert most[0] == LARGE_SLOTS and not inside


def test_a_large_upload_waits_for_a_slot_and_is_answered(tmp_path: Path) -> None:
    """Through the app: a body over LARGE_BODY_BYTES (a JPEG padded after its end marker) takes a large slot
    and is answered as any upload is; while both slots are held, it waits instead of being read."""
    from tests.unit.test_api import JPEG

    app = make_app(tmp_path, max_pending=8)
    padded = JPEG + b"\0" * (LARGE_BODY_BYTES + 1)
    admission = app.flask.extensions["shim"].admission
    held = [admission._large.take() for _ in range(LARGE_SLOTS)]
    for slot in held:
        slot.__enter__()
    answers: list[int] = []
    waiting = threading.Thread(target=lambda: answers.append(app.predict(padded).status_code))
    waiting.start()
    wait_until(lambda: len(admission._large._waiting) == 1, 10, "the large upload to wait for a slot")
    assert app.predict().status_code == 200 and not answers  # a small one passes meanwhile
    for slot in held:
        slot.__exit__(None, None, None)
    waiting.join(timeout=30)
    assert answers == [200]
    app.flask.extensions["shim"].close()
