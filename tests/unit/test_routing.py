"""The router at the Backend seam (fakes): modes, fallback, the breaker, shadow, rollback, readiness."""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from app import metrics
from app.batching import Batcher, Upstream
from app.breaker import CircuitBreaker
from app.errors import BackendUnavailable, CircuitOpen, FlagNotWritable, InvalidImage
from app.images import Upload
from app.rollback import AutoRollback
from app.routing import RequestContext, Router
from app.scores import Ranking
from app.settings import Mode
from app.shadow import ShadowRunner, compare
from app.traffic import TrafficFlag, TrafficState, bucket
from tests.fakes import EchoBackend, image
from tests.support import FakeClock, wait_until

pytestmark = pytest.mark.prod  # make test-prod runs these too: numpy 2, no torch, no Triton

KEYS = [f"user-{i}" for i in range(200)]


@dataclass
class Rig:
    router: Router
    legacy: EchoBackend
    triton: EchoBackend
    clock: FakeClock
    flag_path: Path


def make_router(tmp_path: Path, *, mode: Mode, fallback: bool = False, auto_rollback: bool = False,
                canary: int = 0, timeout_s: float = 30.0, turn: Any = contextlib.nullcontext) -> Rig:
    clock = FakeClock()
    upstream = Upstream()
    legacy, triton = EchoBackend("legacy"), EchoBackend("triton")
    batchers = {name: Batcher(b, upstream, ranking=Ranking(5), max_delay_s=0.001, senders=1)
                for name, b in (("legacy", legacy), ("triton", triton))}
    breaker = CircuitBreaker("triton", failures=3, reset_s=60, clock=clock)
    shadow = ShadowRunner(batchers["triton"], breaker, max_inflight=2, timeout_s=5, tolerance=1e-3, top_k=5,
                          logs_per_minute=5)
    flag_path = tmp_path / "traffic.json"
    flag = TrafficFlag(flag_path, TrafficState(mode=mode, canary_percent=canary), poll_s=60, clock=clock)
    rollback = AutoRollback(flag, error_rate=0.5, window_s=60, min_requests=4, clock=clock) if auto_rollback else None
    router = Router(flag=flag, batchers=batchers, breaker=breaker, shadow=shadow, fallback=fallback,
                    timeout_s=timeout_s, rollback=rollback, turn=turn)
    return Rig(router, legacy, triton, clock, flag_path)


def ask(router: Router, value: float, key: str = "k") -> tuple[float, str, str | None]:
    ctx = RequestContext(request_id=f"r{value}", routing_key=key)
    decision, upload = router.decide(ctx), image(value)
    routed = router.infer(upload, router.prepare(upload, decision), ctx, decision)
    return float(routed.ranked.outputs[0]), routed.backend, routed.fallback_reason


def counter(metric: object, *labels: str) -> float:
    child = metric.labels(*labels) if labels else metric  # type: ignore[attr-defined]
    return float(child._value.get())


def test_breaker_opens_refuses_probes_once_and_closes() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker("fake", failures=3, reset_s=10, clock=clock)
    for _ in range(3):
        assert breaker.allow()
        breaker.record_failure()
    assert breaker.state == "open" and not breaker.allow()
    clock.advance(9.9)
    assert not breaker.allow(), "still cooling down"
    clock.advance(0.1)
    assert breaker.allow(), "after the cool-down one probe goes through"
    assert not breaker.allow(), "only one probe at a time"
    breaker.record_failure()
    assert breaker.state == "open"
    breaker.probe_now()  # a health check saw the backend answer: no need to wait out the cool-down
    assert breaker.allow() and not breaker.allow()
    breaker.record_success()
    assert breaker.state == "closed" and breaker.allow() and breaker.allow()


def test_a_probe_that_never_reports_lets_the_next_one_through_after_the_cool_down() -> None:
    clock = FakeClock()
    breaker = CircuitBreaker("fake", failures=1, reset_s=10, clock=clock)
    breaker.record_failure()
    clock.advance(10)
    assert breaker.allow(), "the probe"
    clock.advance(9.9)
    assert not breaker.allow(), "its outcome may still come"
    clock.advance(0.1)
    assert breaker.allow(), "a probe lost without an outcome must not hold the circuit half-open for ever"


def test_a_probe_that_raises_a_bug_reopens_the_circuit(tmp_path: Path) -> None:
    rig = make_router(tmp_path, mode=Mode.TRITON)
    breaker = rig.router.breaker
    for _ in range(3):
        breaker.record_failure()
    rig.clock.advance(60)
    batcher = rig.router._batchers["triton"]

    def bug(*args: object, **kwargs: object) -> None:
        raise ZeroDivisionError("a bug above the backend")

    batcher.submit = bug  # type: ignore[method-assign]
    with pytest.raises(ZeroDivisionError):
        ask(rig.router, 1.0)
    assert breaker.state == "open", "the probe's outcome was recorded, as a failure"
    rig.router.close()


def test_a_probe_answered_with_the_uploads_own_error_closes_the_circuit(tmp_path: Path) -> None:
    """Triton answered (its decoder refused the upload, and Pillow could not read it either): Triton is fine."""
    rig = make_router(tmp_path, mode=Mode.TRITON)
    for _ in range(3):
        rig.router.breaker.record_failure()
    rig.clock.advance(60)
    real_infer = rig.triton.infer
    rig.triton.infer = lambda items, ids: [InvalidImage("unreadable") for _ in items]  # type: ignore[method-assign]
    with pytest.raises(InvalidImage):
        ask(rig.router, 1.0)
    assert rig.router.breaker.state == "closed"
    rig.triton.infer = real_infer  # type: ignore[method-assign]
    assert ask(rig.router, 2.0) == (2.0, "triton", None)
    rig.router.close()


def test_a_failed_batch_counts_one_failure_per_request() -> None:
    breaker = CircuitBreaker("fake", failures=5, reset_s=10, clock=FakeClock())
    breaker.record_failure(count=4)
    assert breaker.state == "closed"
    breaker.record_failure(count=4)
    assert breaker.state == "open"


def test_compare_tells_a_match_from_a_mismatch() -> None:
    logits = np.linspace(0, 5, 1000, dtype=np.float32)
    assert compare(logits, logits + 1e-7, k=5, tolerance=1e-3).matched
    shuffled = logits[::-1].copy()
    result = compare(logits, shuffled, k=5, tolerance=1e-3)
    assert not result.matched and not result.same_top1 and result.topk_overlap == 0


def test_each_mode_answers_from_its_backend(tmp_path: Path) -> None:
    for mode, backend in ((Mode.LEGACY, "legacy"), (Mode.TRITON, "triton"), (Mode.SHADOW, "legacy")):
        rig = make_router(tmp_path / mode.value, mode=mode)
        assert ask(rig.router, 3.0) == (3.0, backend, None)
        rig.router.close()


def test_fallback_answers_from_legacy_and_says_why(tmp_path: Path) -> None:
    rig = make_router(tmp_path, mode=Mode.TRITON, fallback=True)
    rig.triton.down = True
    before = counter(metrics.FALLBACKS, "backend_unavailable")
    assert ask(rig.router, 1.0) == (1.0, "legacy", "backend_unavailable")
    assert counter(metrics.FALLBACKS, "backend_unavailable") == before + 1
    rig.router.close()


def test_fallback_prepares_the_upload_for_legacy_inside_the_decode_bound(tmp_path: Path) -> None:
    """While Triton is down every pending request falls back at once: their decodes must wait their turn."""
    held: list[bool] = []
    inside = threading.local()

    @contextlib.contextmanager
    def turn() -> Iterator[None]:
        inside.held = True
        try:
            yield
        finally:
            inside.held = False

    rig = make_router(tmp_path, mode=Mode.TRITON, fallback=True, turn=turn)
    real_prepare = rig.legacy.prepare

    def prepare(upload: Upload) -> Any:
        held.append(getattr(inside, "held", False))
        return real_prepare(upload)

    rig.legacy.prepare = prepare  # type: ignore[method-assign]
    rig.triton.down = True
    assert ask(rig.router, 4.0) == (4.0, "legacy", "backend_unavailable")
    assert held == [True], "legacy's decode ran outside admission.turn()"
    rig.router.close()


def test_without_fallback_the_client_gets_the_error_and_the_breaker_opens(tmp_path: Path) -> None:
    rig = make_router(tmp_path, mode=Mode.TRITON)
    rig.triton.down = True
    for _ in range(3):
        with pytest.raises(BackendUnavailable) as raised:
            ask(rig.router, 1.0)
        assert raised.value.backend == "triton"
    calls = len(rig.triton.batches)
    with pytest.raises(CircuitOpen, match="circuit is open"):
        ask(rig.router, 1.0)
    assert len(rig.triton.batches) == calls, "an open circuit must not call Triton"
    assert counter(metrics.CIRCUIT_OPEN, "triton") == 1
    rig.triton.down = False
    rig.clock.advance(60)
    assert ask(rig.router, 2.0) == (2.0, "triton", None), "the probe after the cool-down closes the circuit"
    assert counter(metrics.CIRCUIT_OPEN, "triton") == 0
    rig.router.close()


def test_canary_sends_exactly_the_clients_below_the_share(tmp_path: Path) -> None:
    rig = make_router(tmp_path, mode=Mode.CANARY, canary=30)
    for key in KEYS[:40]:
        assert ask(rig.router, 2.0, key)[1] == ("triton" if bucket(key) < 30 else "legacy")
    rig.router.close()


def test_shadow_never_makes_the_client_wait_for_a_hung_triton(tmp_path: Path) -> None:
    rig = make_router(tmp_path, mode=Mode.SHADOW)
    rig.triton.hang.set()  # accepts and never answers, until released
    skipped = counter(metrics.SHADOW_COMPARISONS, "skipped")
    matched = counter(metrics.SHADOW_COMPARISONS, "match")
    answers = [ask(rig.router, float(i)) for i in range(1, 7)]  # would block here if clients waited for Triton
    assert answers == [(float(i), "legacy", None) for i in range(1, 7)]
    assert counter(metrics.SHADOW_COMPARISONS, "skipped") == skipped + 4  # 2 slots for 6 requests
    rig.triton.hang.clear()
    wait_until(lambda: counter(metrics.SHADOW_COMPARISONS, "match") >= matched + 2, 10, "the 2 shadow calls")
    rig.router.close()


def test_shadow_counts_a_mismatch_when_triton_answers_otherwise(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    rig = make_router(tmp_path, mode=Mode.SHADOW)
    original = rig.triton.infer
    monkeypatch.setattr(rig.triton, "infer", lambda batch, ids: original(batch, ids)[:, ::-1].copy())
    mismatched = counter(metrics.SHADOW_COMPARISONS, "mismatch")
    assert ask(rig.router, 5.0)[1] == "legacy"
    wait_until(lambda: counter(metrics.SHADOW_COMPARISONS, "mismatch") == mismatched + 1, 10, "the comparison")
    rig.router.close()


def test_auto_rollback_drops_the_canary_share_for_every_worker(tmp_path: Path) -> None:
    rig = make_router(tmp_path, mode=Mode.CANARY, canary=100, fallback=True, auto_rollback=True)
    rig.triton.down = True
    for i in range(4):
        assert ask(rig.router, float(i + 1))[1] == "legacy"  # fallback answers while the rollback trips
    state = json.loads(rig.flag_path.read_text())
    assert state["canary_percent"] == 0 and state["updated_by"] == "auto-rollback"
    assert "automatic rollback: Triton failed 4 of the last 4" in state["reason"]
    calls = len(rig.triton.batches)
    assert ask(rig.router, 9.0) == (9.0, "legacy", None) and len(rig.triton.batches) == calls
    rig.router.close()


def test_failures_older_than_the_window_do_not_roll_back(tmp_path: Path) -> None:
    rig = make_router(tmp_path, mode=Mode.CANARY, canary=100, fallback=True, auto_rollback=True)
    rig.triton.down = True
    for i in range(2):
        ask(rig.router, float(i + 1))
    rig.clock.advance(61)  # those two fall out of the 60 s window
    rig.triton.down = False
    rig.router.breaker.record_success()
    for i in range(3):
        assert ask(rig.router, float(i + 10))[1] == "triton"
    assert not rig.flag_path.exists(), "2 old failures and 3 new successes are not 50% of the window"
    rig.router.close()


def test_auto_rollback_with_a_read_only_flag_leaves_the_share_to_the_operator_and_says_so(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A ConfigMap is the one source of traffic: no worker overrides it on its own; the rollback is logged."""
    from app import metrics

    rig = make_router(tmp_path, mode=Mode.CANARY, canary=100, fallback=True, auto_rollback=True)
    before = metrics.ROLLBACKS._value.get()

    def refuse(*args: object, **kwargs: object) -> None:
        raise FlagNotWritable("read-only")

    monkeypatch.setattr(rig.router.flag, "write", refuse)
    rig.triton.down = True
    with caplog.at_level(logging.ERROR, logger="app.rollback"):
        for i in range(4):
            assert ask(rig.router, float(i + 1))[1] == "legacy"  # fallback answers meanwhile
    assert rig.router.flag.current().canary_percent == 100
    assert metrics.ROLLBACKS._value.get() == before + 1
    assert any("set the canary share to 0 in the ConfigMap" in r.getMessage() for r in caplog.records)
    rig.router.close()


@pytest.mark.parametrize(("mode", "canary", "fallback", "triton_up", "ready"), [
    (Mode.LEGACY, 0, False, False, True),
    (Mode.SHADOW, 0, False, False, True),  # shadow never makes a client wait for Triton
    (Mode.TRITON, 0, False, True, True),
    (Mode.TRITON, 0, False, False, False),
    (Mode.TRITON, 0, True, False, True),  # legacy answers what Triton cannot
    (Mode.CANARY, 10, False, False, False),  # the canary share would get 503s
    (Mode.CANARY, 10, True, False, True),
    (Mode.CANARY, 0, False, False, True),  # nobody is routed to Triton
    (Mode.CANARY, 10, False, True, True),
])
def test_readiness_follows_the_backends_that_answer_the_modes_clients(
        tmp_path: Path, mode: Mode, canary: int, fallback: bool, triton_up: bool, ready: bool) -> None:
    rig = make_router(tmp_path, mode=mode, canary=canary, fallback=fallback)
    rig.triton.down = not triton_up
    report = rig.router.readiness()
    assert report.ready is ready, report
    if mode is not Mode.LEGACY:
        assert report.backends["triton"].ready is triton_up
    rig.router.close()


def test_readiness_seeing_triton_back_lets_the_next_request_probe_at_once(tmp_path: Path) -> None:
    rig = make_router(tmp_path, mode=Mode.TRITON)
    rig.triton.down = True
    for _ in range(3):
        with pytest.raises(BackendUnavailable):
            ask(rig.router, 1.0)
    assert rig.router.breaker.state == "open"
    rig.triton.down = False
    assert rig.router.readiness().ready
    assert ask(rig.router, 4.0) == (4.0, "triton", None), "no need to wait out the 60 s cool-down"


def test_requests_of_a_hung_triton_get_504_at_their_deadline(tmp_path: Path) -> None:
    rig = make_router(tmp_path, mode=Mode.TRITON, timeout_s=0.2)
    rig.triton.hang.set()
    errors: list[Exception] = []

    def one() -> None:
        try:
            ask(rig.router, 1.0)
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=one) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    rig.triton.hang.clear()
    assert len(errors) == 4 and all(e.__class__.__name__ == "BackendTimeout" for e in errors), errors
    rig.router.close()
