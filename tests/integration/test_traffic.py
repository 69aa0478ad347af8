"""Traffic switching under real gunicorn workers against the real embedded Triton.

The routing rules themselves (fallback, breaker, shadow with a hung Triton, rollback, shim-traffic's
checks) are tested in-process in tests/unit; here: a switch by shim-traffic reaches every worker under load, and
shadow compares real Triton answers with real legacy answers.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from app.traffic import POLL_S, bucket
from devstack import EmbeddedTriton
from devstack.launch import ServedApp
from tests.conftest import shim_traffic, start_shim, stop_soon
from tests.support import encode, metric_sum, photo, scrape, wait_until

pytestmark = pytest.mark.triton
IMAGES = [encode(photo(320, 240, seed=300 + i), "JPEG") for i in range(8)]
FLAG = "traffic.json"


@dataclass
class Switchable:
    served: ServedApp
    flag_file: Path
    repo: Path

    @property
    def url(self) -> str:
        return self.served.url


@pytest.fixture(scope="module")
def switchable(triton: EmbeddedTriton, test_repo: Path, test_model_pt: Path,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[Switchable]:
    """2 workers, legacy loaded (fallback on), starting in triton mode; its flag file is served.flag_file."""
    tmp = tmp_path_factory.mktemp("switchable")
    served = start_shim(tmp, triton_url=triton.http_url, repo=test_repo, model_pt=test_model_pt,
                        flag_file=tmp / FLAG, fallback="true", mode="triton",
                        triton_timeout_s=60)  # 16 clients on in-process legacy models: a slow machine queues
    served.wait("/readyz")

    def legacy_loaded_everywhere() -> bool:  # readiness in triton mode does not wait for the fallback model
        return all(requests.get(served.url + "/readyz", timeout=10).json()["backends"]["legacy"]["ready"]
                   for _ in range(6))

    wait_until(legacy_loaded_everywhere, 180, "the legacy model in every worker")
    yield Switchable(served, tmp / FLAG, test_repo)
    stop_soon(served)


def switch(shim: Switchable, mode: str, *options: str) -> float:
    """shim-traffic set MODE [options]; the moment it returned."""
    shim_traffic(shim.flag_file, shim.repo, "set", mode, *options)
    return time.monotonic()


def test_a_switch_under_load_reaches_every_worker_and_fails_no_request(switchable: Switchable) -> None:
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
    plan = [(["legacy"], lambda key: "legacy"),
            (["canary", "--canary-percent", "50"], lambda key: "triton" if bucket(key) < 50 else "legacy"),
            (["triton"], lambda key: "triton")]
    try:
        wait_until(lambda: len(records) >= 16, 120, "the clients' first answers")
        for changes, expected in plan:
            switched = switch(switchable, *changes)

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


def wait_for_mode(shim: Switchable, mode: str, switched: float) -> None:
    """Every worker follows within the poll interval: wait until it has passed, then check a few answers."""
    wait_until(lambda: time.monotonic() > switched + 2 * POLL_S, 10, "the flag's poll interval")
    for _ in range(4):
        assert requests.get(shim.url + "/traffic", timeout=10).json()["mode"] == mode


def test_shadow_gives_legacy_answers_byte_for_byte_and_counts_matches(switchable: Switchable) -> None:
    wait_for_mode(switchable, "legacy", switch(switchable, "legacy"))
    legacy_bodies = [requests.post(switchable.url + "/predict", files={"image": data}, timeout=60).content
                     for data in IMAGES]
    before = scrape(switchable.url + "/metrics")
    wait_for_mode(switchable, "shadow", switch(switchable, "shadow", "--shadow-percent", "100"))
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
    switch(switchable, "triton")


