"""The circuit's gauge and the error counts tell the truth: shim_circuit_open clears when the traffic stops
going to Triton (a switch to legacy, an automatic rollback to 0%), and requests that time out in the shim's
own queue or are refused by an open circuit are counted in shim_backend_errors_total under their own codes."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from app import metrics
from app.batching import Batcher, Upstream
from app.errors import BackendTimeout, BackendUnavailable, CircuitOpen
from app.scores import Ranking
from app.settings import Mode
from tests.fakes import EchoBackend, item
from tests.unit.test_routing import ask, counter, make_router


def open_the_circuit(rig: object) -> None:
    rig.triton.down = True  # type: ignore[attr-defined]
    for _ in range(3):
        with pytest.raises(BackendUnavailable):
            ask(rig.router, 1.0)  # type: ignore[attr-defined]
    assert rig.router.breaker.state == "open"  # type: ignore[attr-defined]


def test_a_switch_to_legacy_clears_the_circuit_gauge_and_a_switch_back_shows_it_again(tmp_path: Path) -> None:
    rig = make_router(tmp_path, mode=Mode.TRITON)
    try:
        open_the_circuit(rig)
        assert counter(metrics.CIRCUIT_OPEN, "triton") == 1
        rig.router.flag.write({"mode": "legacy", "reason": "incident"}, updated_by="shim-traffic")
        assert counter(metrics.CIRCUIT_OPEN, "triton") == 0, "legacy sends nothing to Triton: nothing is kept away"
        assert ask(rig.router, 2.0) == (2.0, "legacy", None)
        assert counter(metrics.CIRCUIT_OPEN, "triton") == 0
        rig.router.flag.write({"mode": "triton"}, updated_by="shim-traffic")
        assert counter(metrics.CIRCUIT_OPEN, "triton") == 1, "still open, and Triton's traffic is back"
    finally:
        rig.router.close()


def test_an_automatic_rollback_clears_the_circuit_gauge(tmp_path: Path) -> None:
    rig = make_router(tmp_path, mode=Mode.CANARY, canary=100, fallback=True, auto_rollback=True)
    rig.triton.down = True
    try:
        for i in range(4):
            assert ask(rig.router, float(i))[1] == "legacy"
        assert rig.router.flag.current().canary_percent == 0
        assert rig.router.breaker.state == "open"  # 3 failures opened it; the rollback followed
        assert counter(metrics.CIRCUIT_OPEN, "triton") == 0, "a canary at 0% keeps no request away"
    finally:
        rig.router.close()


def test_refusals_of_an_open_circuit_are_counted_with_their_own_code(tmp_path: Path) -> None:
    rig = make_router(tmp_path, mode=Mode.TRITON)
    try:
        open_the_circuit(rig)
        refused = counter(metrics.BACKEND_ERRORS, "triton", "circuit_open")
        for _ in range(3):
            with pytest.raises(CircuitOpen):
                ask(rig.router, 1.0)
        assert counter(metrics.BACKEND_ERRORS, "triton", "circuit_open") == refused + 3
    finally:
        rig.router.close()


def test_a_timeout_in_the_shims_own_queue_is_counted_once_as_queue_timeout() -> None:
    backend = EchoBackend("queued")
    batcher = Batcher(backend, Upstream(), ranking=Ranking(5), max_delay_s=0.0, senders=1)
    backend.hang.set()  # the one sender is stuck in its call: the next request stays in the queue
    errors: list[Exception] = []

    def one(value: float) -> None:
        try:
            batcher.submit(item(value), f"r{value}", timeout_s=0.3)
        except BackendTimeout as e:
            errors.append(e)

    sent = threading.Thread(target=one, args=(1.0,))
    sent.start()
    while not backend.batches:  # the sender has taken the first request
        threading.Event().wait(0.01)
    queued = threading.Thread(target=one, args=(2.0,))
    queued.start()
    sent.join(timeout=10)
    queued.join(timeout=10)
    backend.hang.clear()
    batcher.close()
    assert len(errors) == 2
    assert counter(metrics.BACKEND_ERRORS, "queued", "queue_timeout") == 1
    assert counter(metrics.BACKEND_ERRORS, "queued", "backend_timeout") == 1  # sent, and no answer in time
