"""Traffic switching parts, at the Backend seam: buckets, the flag file, the breaker, shadow, fallback."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from app import metrics
from app.batching import Batcher, Upstream
from app.breaker import CircuitBreaker
from app.errors import BackendUnavailable
from app.routing import Guardrails, RequestContext, Router
from app.settings import Mode
from app.shadow import ShadowRunner, compare
from app.traffic import FlagNotWritable, InvalidTraffic, TrafficFlag, TrafficState, bucket
from tests.fakes import EchoBackend, image
from tests.support import ROOT, wait_until

KEYS = [f"user-{i}" for i in range(10_000)]


def test_buckets_are_deterministic_across_processes() -> None:
    mine = [bucket(k) for k in KEYS[:50]]
    code = "from app.traffic import bucket; print([bucket(f'user-{i}') for i in range(50)])"
    other = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert json.loads(other.stdout) == mine  # no per-process hash seed, unlike Python's hash()
    assert all(0 <= b < 100 for b in mine)


def test_ten_percent_of_ten_thousand_keys_is_ten_percent_and_raising_it_only_adds_keys() -> None:
    at_10 = {k for k in KEYS if bucket(k) < 10}
    at_30 = {k for k in KEYS if bucket(k) < 30}
    assert 8.5 <= len(at_10) / len(KEYS) * 100 <= 11.5, len(at_10)
    assert 28.5 <= len(at_30) / len(KEYS) * 100 <= 31.5, len(at_30)
    assert at_10 <= at_30, "raising the share moved a key away from Triton"


def test_flag_file_switches_keeps_the_last_good_state_and_falls_back_to_settings(tmp_path: Path) -> None:
    path = tmp_path / "traffic.json"
    flag = TrafficFlag(path, TrafficState(mode=Mode.TRITON), poll_s=0.01)
    assert (flag.current().mode, flag.current().source) == (Mode.TRITON, "env")

    state = flag.write({"mode": "canary", "canary_percent": 25, "reason": "ramp"}, updated_by="admin-api")
    assert (state.mode, state.canary_percent, state.source, state.updated_by) == (Mode.CANARY, 25, "flag-file",
                                                                                  "admin-api")
    other_worker = TrafficFlag(path, TrafficState(mode=Mode.TRITON), poll_s=0.01)
    assert other_worker.current() == state

    path.write_text("{not json")
    time.sleep(0.02)
    assert other_worker.current() == state, "a broken file must not change the mode"
    assert "ignored, last good state kept" in (other_worker.error or "")

    path.write_text(json.dumps({"mode": "legacy"}))
    time.sleep(0.02)
    assert other_worker.current().mode is Mode.LEGACY and other_worker.error is None

    path.unlink()
    time.sleep(0.02)
    assert other_worker.current().mode is Mode.TRITON and other_worker.current().source == "env"


@pytest.mark.parametrize("bad", [{"mode": "purple"}, {"canary_percent": 101}, {"canary_percent": "10"},
                                 {"shadow_percent": True}, {"colour": "red"}])
def test_invalid_updates_are_refused_with_a_reason(tmp_path: Path, bad: dict) -> None:
    flag = TrafficFlag(tmp_path / "t.json", TrafficState(mode=Mode.TRITON), poll_s=0.01)
    with pytest.raises(InvalidTraffic):
        flag.write(bad, updated_by="test")
    assert not (tmp_path / "t.json").exists()


def test_breaker_opens_refuses_probes_once_and_closes() -> None:
    breaker = CircuitBreaker("fake", failures=3, reset_s=0.2)
    for _ in range(3):
        assert breaker.allow()
        breaker.record_failure()
    assert breaker.state == "open" and not breaker.allow()
    time.sleep(0.25)
    assert breaker.allow(), "after the cool-down one probe goes through"
    assert not breaker.allow(), "only one probe at a time"
    breaker.record_failure()
    assert breaker.state == "open"
    time.sleep(0.25)
    assert breaker.allow()
    breaker.record_success()
    assert breaker.state == "closed" and breaker.allow() and breaker.allow()


def test_compare_tells_a_match_from_a_mismatch() -> None:
    logits = np.linspace(0, 5, 1000, dtype=np.float32)
    assert compare(logits, logits + 1e-7, k=5, tolerance=1e-3).matched
    shuffled = logits[::-1].copy()
    result = compare(logits, shuffled, k=5, tolerance=1e-3)
    assert not result.matched and not result.same_top1 and result.topk_overlap == 0


def make_router(tmp_path: Path, *, mode: Mode, fallback: bool = False, triton_delay_s: float = 0.0,
                auto_rollback: bool = False, canary: int = 0) -> tuple[Router, EchoBackend, EchoBackend]:
    upstream = Upstream()
    legacy, triton = EchoBackend("legacy"), EchoBackend("triton", delay_s=triton_delay_s)
    batchers = {name: Batcher(b, upstream, max_delay_s=0.001, senders=1, result_timeout_s=30)
                for name, b in (("legacy", legacy), ("triton", triton))}
    breaker = CircuitBreaker("triton", failures=3, reset_s=60)
    shadow = ShadowRunner(batchers["triton"], breaker, max_inflight=2, timeout_s=5, tolerance=1e-3, top_k=5,
                          logs_per_minute=5)
    flag = TrafficFlag(tmp_path / "traffic.json", TrafficState(mode=mode, canary_percent=canary), poll_s=0.01)
    router = Router(flag=flag, batchers=batchers, breaker=breaker, shadow=shadow, guardrails=Guardrails(
        fallback=fallback, auto_rollback=auto_rollback, rollback_error_rate=0.5, rollback_window_s=60,
        rollback_min_requests=4))
    return router, legacy, triton


def ask(router: Router, value: float, key: str = "k") -> tuple[float, str]:
    ctx = RequestContext(request_id=f"r{value}", routing_key=key)
    logits = router.infer(image(value), ctx, router.decide(ctx))
    return float(logits[0]), ctx.notes["backend"]


def counter(metric: object, *labels: str) -> float:
    child = metric.labels(*labels) if labels else metric  # type: ignore[attr-defined]
    return float(child._value.get())


def test_fallback_answers_from_legacy_and_counts(tmp_path: Path) -> None:
    router, _, triton = make_router(tmp_path, mode=Mode.TRITON, fallback=True)
    triton.down = True
    before = counter(metrics.FALLBACKS, "backend_unavailable")
    assert ask(router, 1.0) == (1.0, "legacy")
    assert counter(metrics.FALLBACKS, "backend_unavailable") == before + 1
    router.close()


def test_without_fallback_the_client_gets_the_error_and_the_breaker_opens(tmp_path: Path) -> None:
    router, _, triton = make_router(tmp_path, mode=Mode.TRITON)
    triton.down = True
    for _ in range(3):
        with pytest.raises(BackendUnavailable):
            ask(router, 1.0)
    calls = len(triton.batches)
    with pytest.raises(BackendUnavailable, match="circuit is open"):
        ask(router, 1.0)
    assert len(triton.batches) == calls, "an open circuit must not call Triton"
    assert counter(metrics.CIRCUIT_OPEN, "triton") == 1
    router.close()


def test_canary_sends_exactly_the_clients_below_the_share(tmp_path: Path) -> None:
    router, _, _ = make_router(tmp_path, mode=Mode.CANARY, canary=30)
    for key in KEYS[:40]:
        assert ask(router, 2.0, key)[1] == ("triton" if bucket(key) < 30 else "legacy")
    router.close()


def test_shadow_never_makes_the_client_wait_for_a_slow_triton(tmp_path: Path) -> None:
    router, _, _ = make_router(tmp_path, mode=Mode.SHADOW, triton_delay_s=1.0)
    skipped = counter(metrics.SHADOW_COMPARISONS, "skipped")
    started = time.monotonic()
    answers = [ask(router, float(i)) for i in range(1, 7)]
    assert time.monotonic() - started < 1.0, "clients waited for the shadow calls"
    assert answers == [(float(i), "legacy") for i in range(1, 7)]
    assert counter(metrics.SHADOW_COMPARISONS, "skipped") >= skipped + 4  # 2 slots for 6 requests
    matched = counter(metrics.SHADOW_COMPARISONS, "match")
    wait_until(lambda: counter(metrics.SHADOW_COMPARISONS, "match") >= matched + 2, 10, "the 2 shadow calls")
    router.close()


def test_auto_rollback_drops_the_canary_share_for_every_worker(tmp_path: Path) -> None:
    router, _, triton = make_router(tmp_path, mode=Mode.CANARY, canary=100, fallback=True, auto_rollback=True)
    triton.down = True
    for i in range(4):
        assert ask(router, float(i + 1))[1] == "legacy"  # fallback answers while the rollback trips
    state = json.loads((tmp_path / "traffic.json").read_text())
    assert state["canary_percent"] == 0 and state["updated_by"] == "auto-rollback"
    assert "automatic rollback: Triton failed 4 of the last 4" in state["reason"]
    calls = len(triton.batches)
    assert ask(router, 9.0) == (9.0, "legacy") and len(triton.batches) == calls
    router.close()


def test_a_configmap_style_flag_is_followed_and_a_read_only_one_is_refused_with_a_reason(tmp_path: Path) -> None:
    """Kubernetes mounts a ConfigMap as symlinks into a timestamped folder and swaps `..data` to update it."""
    mount = tmp_path / "traffic"
    mount.mkdir()

    def publish(version: str, body: dict) -> None:
        folder = mount / f"..{version}"
        folder.mkdir()
        (folder / "traffic.json").write_text(json.dumps(body))
        (mount / "..data_tmp").symlink_to(folder.name)
        (mount / "..data_tmp").rename(mount / "..data")  # atomic, as kubelet's AtomicWriter does

    publish("2026_01", {"mode": "triton"})
    (mount / "traffic.json").symlink_to("..data/traffic.json")
    flag = TrafficFlag(mount / "traffic.json", TrafficState(mode=Mode.LEGACY), poll_s=0.01)
    assert flag.current().mode is Mode.TRITON
    publish("2026_02", {"mode": "canary", "canary_percent": 5})
    time.sleep(0.02)
    assert (flag.current().mode, flag.current().canary_percent) == (Mode.CANARY, 5)

    read_only = TrafficFlag(Path("/proc/flask-triton-shim/traffic.json"), TrafficState(mode=Mode.LEGACY),
                            poll_s=0.01)  # /proc refuses new files even to root, as a ConfigMap mount does
    with pytest.raises(FlagNotWritable, match="change the ConfigMap instead"):
        read_only.write({"mode": "triton"}, updated_by="admin-api")
    assert read_only.current().mode is Mode.LEGACY


def test_auto_rollback_with_a_read_only_flag_rolls_back_the_worker_itself(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    router, _, triton = make_router(tmp_path, mode=Mode.CANARY, canary=100, fallback=True, auto_rollback=True)

    def refuse(*args: object, **kwargs: object) -> None:
        raise FlagNotWritable("read-only")

    monkeypatch.setattr(router.flag, "write", refuse)
    triton.down = True
    for i in range(4):
        ask(router, float(i + 1))
    state = router.flag.current()
    assert (state.canary_percent, state.source, state.updated_by) == (0, "local", "auto-rollback")
    router.close()
