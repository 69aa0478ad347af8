"""Traffic switching under real gunicorn workers against the real embedded Triton."""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from app.embedded_triton import EmbeddedTriton
from app.traffic import bucket
from tests.conftest import make_test_repo, start_shim, start_triton
from tests.support import encode, metric_max, metric_sum, photo, scrape, wait_until
from tools.launch import ServedApp

pytestmark = pytest.mark.triton
TOKEN = "test-admin-token-0123456789"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
IMAGES = [encode(photo(320, 240, seed=300 + i), "JPEG") for i in range(8)]


@pytest.fixture(scope="module")
def switchable(triton: EmbeddedTriton, test_repo: Path, test_model_pt: Path,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServedApp]:
    """2 workers, admin API on, legacy loaded (fallback on), starting in triton mode."""
    served = start_shim(tmp_path_factory.mktemp("switchable"), triton_url=triton.http_url, repo=test_repo,
                        model_pt=test_model_pt, admin_token=TOKEN, fallback="true", mode="triton")
    yield served.wait("/readyz")
    served.stop()


def switch(shim: ServedApp, **changes: object) -> float:
    answer = requests.put(shim.url + "/admin/traffic", json=changes, headers=ADMIN, timeout=10)
    assert answer.status_code == 200, answer.text
    return time.monotonic()


def test_unauthorized_admin_calls_change_nothing(switchable: ServedApp) -> None:
    before = requests.get(switchable.url + "/traffic", timeout=10).json()
    attempts = [({}, 401), ({"Authorization": "Bearer wrong-token-wrong-token"}, 403),
                ({"Authorization": f"Basic {TOKEN}"}, 401), ({"Authorization": TOKEN}, 401)]
    for headers, status in attempts:
        answer = requests.put(switchable.url + "/admin/traffic", json={"mode": "legacy"}, headers=headers, timeout=10)
        assert answer.status_code == status, (headers, answer.text)
        assert set(answer.json()) == {"error", "message"}
    for _ in range(6):  # whichever worker answers
        assert requests.get(switchable.url + "/traffic", timeout=10).json() == before


def test_admin_api_is_off_without_a_token(shim_triton: ServedApp) -> None:
    answer = requests.put(shim_triton.url + "/admin/traffic", json={"mode": "legacy"}, headers=ADMIN, timeout=10)
    assert answer.status_code == 403 and "SHIM_ADMIN_TOKEN" in answer.json()["message"]
    assert requests.get(shim_triton.url + "/traffic", timeout=10).json()["mode"] == "triton"


def test_a_switch_under_load_reaches_every_worker_and_fails_no_request(switchable: ServedApp) -> None:
    bound_s = 2.0
    stop = threading.Event()
    records: list[tuple[float, str, str]] = []  # (started, client key, backend that answered)
    failures: list[str] = []

    def client(index: int) -> None:
        session, key = requests.Session(), f"user-{index}"
        while not stop.is_set():
            started = time.monotonic()
            try:
                answer = session.post(switchable.url + "/predict", files={"image": IMAGES[index % 8]},
                                      headers={"X-User-Id": key}, timeout=60)
                body = answer.json()
                if answer.status_code != 200 or len(body["predictions"]) != 5:
                    failures.append(f"{answer.status_code} {answer.text[:200]}")
                records.append((started, key, answer.headers["X-Shim-Backend"]))
            except (requests.RequestException, ValueError, KeyError) as e:
                failures.append(repr(e))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    plan = [({"mode": "legacy"}, lambda key: "legacy"),
            ({"mode": "canary", "canary_percent": 50}, lambda key: "triton" if bucket(key) < 50 else "legacy"),
            ({"mode": "triton"}, lambda key: "triton")]
    try:
        time.sleep(2)
        for changes, expected in plan:
            switched = switch(switchable, **changes)

            wait_until(lambda s=switched: len(after(records, s + bound_s)) >= 32, 180, f"requests after {changes}")
            late = after(records, switched + bound_s)
            wrong = [(key, backend) for key, backend in late if backend != expected(key)]
            assert not wrong, f"{len(wrong)} of {len(late)} requests {bound_s} s after {changes} went elsewhere"
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
    assert failures == [], failures[:5]
    assert len(records) > 100


def after(records: list[tuple[float, str, str]], moment: float) -> list[tuple[str, str]]:
    """(client key, backend) of the finished requests that started after `moment`."""
    return [(key, backend) for started, key, backend in list(records) if started > moment]


def test_shadow_gives_legacy_answers_byte_for_byte_and_counts_matches(switchable: ServedApp) -> None:
    switch(switchable, mode="legacy")
    time.sleep(1)
    legacy_bodies = [requests.post(switchable.url + "/predict", files={"image": data}, timeout=60).content
                     for data in IMAGES]
    before = scrape(switchable.url + "/metrics")
    switch(switchable, mode="shadow", shadow_percent=100)
    time.sleep(1)
    for data, expected in zip(IMAGES, legacy_bodies, strict=True):
        answer = requests.post(switchable.url + "/predict", files={"image": data}, timeout=60)
        assert answer.headers["X-Shim-Backend"] == "legacy"
        assert answer.content == expected

    def compared() -> float:
        after = scrape(switchable.url + "/metrics")
        return sum(metric_sum(after, "shim_shadow_comparisons_total", result=r)
                   - metric_sum(before, "shim_shadow_comparisons_total", result=r) for r in ("match", "mismatch"))

    wait_until(lambda: compared() >= len(IMAGES), 30, "the shadow comparisons")
    after = scrape(switchable.url + "/metrics")
    assert metric_sum(after, "shim_shadow_comparisons_total", result="mismatch") == metric_sum(
        before, "shim_shadow_comparisons_total", result="mismatch"), "the same model on Triton must match"
    switch(switchable, mode="triton")


def test_shadow_counts_mismatches_when_triton_serves_another_version(tmp_path: Path, test_model_pt: Path) -> None:
    from tools.export_model import build_model, save_torchscript

    repo = make_test_repo(tmp_path / "repo", test_model_pt)
    save_torchscript(build_model("resnet18", None, seed=1), repo / "resnet50" / "2" / "model.pt",
                     {"arch": "resnet18", "seed": 1})
    triton = start_triton(repo, tmp_path / "cache")  # serves version 2: other weights than the legacy model
    shim = start_shim(tmp_path, triton_url=triton.http_url, repo=repo, model_pt=test_model_pt, mode="shadow",
                      workers=1)
    try:
        shim.wait("/readyz")
        for data in IMAGES:
            assert requests.post(shim.url + "/predict", files={"image": data}, timeout=60).status_code == 200
        wait_until(lambda: metric_sum(scrape(shim.url + "/metrics"), "shim_shadow_comparisons_total",
                                      result="mismatch") >= len(IMAGES) - 1, 30, "mismatches to be counted")
        assert "shadow mismatch" in shim.log()
    finally:
        shim.stop()
        triton.stop()


def test_shadow_with_a_dead_or_silent_triton_costs_clients_nothing(tmp_path: Path, test_repo: Path,
                                                                   test_model_pt: Path) -> None:
    import socket

    with socket.socket() as silent:  # accepts connections and never answers: the worst kind of down
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        shim = start_shim(tmp_path, triton_url=f"127.0.0.1:{silent.getsockname()[1]}", repo=test_repo,
                          model_pt=test_model_pt, mode="legacy", workers=1, admin_token=TOKEN,
                          shadow_timeout_s=3, triton_timeout_s=3)
        try:
            shim.wait("/readyz")
            session = requests.Session()

            def latencies() -> list[float]:
                out = []
                for data in IMAGES * 3:
                    started = time.monotonic()
                    answer = session.post(shim.url + "/predict", files={"image": data}, timeout=60)
                    out.append(time.monotonic() - started)
                    assert answer.status_code == 200 and answer.headers["X-Shim-Backend"] == "legacy"
                return out

            latencies()  # warm
            by_mode: dict[str, list[float]] = {"legacy": [], "shadow": []}
            for _ in range(3):  # alternating rounds: both modes see the same (noisy, shared) machine
                for mode in by_mode:
                    switch(shim, mode=mode)
                    time.sleep(1)
                    by_mode[mode] += latencies()
            legacy_mode, shadow_mode = (statistics.median(by_mode[m]) for m in ("legacy", "shadow"))
            assert shadow_mode < legacy_mode * 1.2 + 0.02, (legacy_mode, shadow_mode)
            samples = scrape(shim.url + "/metrics")
            assert metric_sum(samples, "shim_shadow_comparisons_total", result="skipped") > 0
        finally:
            shim.stop()


def test_fallback_keeps_every_request_answered_while_triton_stops_and_the_breaker_shows_it(
        tmp_path: Path, test_model_pt: Path) -> None:
    repo = make_test_repo(tmp_path / "repo", test_model_pt)
    triton = start_triton(repo, tmp_path / "cache")
    shim = start_shim(tmp_path, triton_url=triton.http_url, repo=repo, model_pt=test_model_pt, mode="triton",
                      fallback="true", breaker_reset_s=1, triton_timeout_s=5)
    stop, answered, failures = threading.Event(), [], []

    def client(index: int) -> None:
        session = requests.Session()
        while not stop.is_set():
            try:
                answer = session.post(shim.url + "/predict", files={"image": IMAGES[index % 8]}, timeout=60)
                (answered if answer.status_code == 200 else failures).append(answer.headers.get("X-Shim-Backend"))
            except requests.RequestException as e:
                failures.append(repr(e))

    try:
        shim.wait("/readyz")
        with ThreadPoolExecutor(16) as pool:
            for i in range(16):
                pool.submit(client, i)
            wait_until(lambda: answered.count("triton") >= 16, 60, "Triton to answer under load")
            triton.stop()
            stopped_at = len(answered)
            wait_until(lambda: answered[stopped_at:].count("legacy") >= 32, 60, "legacy to take over")
            assert metric_max(scrape(shim.url + "/metrics"), "shim_circuit_open", backend="triton") == 1
            triton = EmbeddedTriton(triton.config).start()
            resumed_at = len(answered)
            wait_until(lambda: answered[resumed_at:].count("triton") >= 32, 60, "Triton to answer again")
            stop.set()
        samples = scrape(shim.url + "/metrics")
        assert failures == [], failures[:5]
        assert metric_sum(samples, "shim_fallbacks_total") > 0
        assert metric_max(samples, "shim_circuit_open", backend="triton") == 0, "the breaker closed again"
    finally:
        stop.set()
        shim.stop()
        triton.stop()
