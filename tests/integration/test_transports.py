"""Every transport to the real Triton gives today's logits; shared memory is cleaned up and falls back."""

from __future__ import annotations

import json
import logging
import os
import signal
import urllib.request
from pathlib import Path

import numpy as np
import pytest

from app.backends import shm
from app.backends.triton import TritonBackend
from app.preprocess import ImageSpec, decode, prepare
from devstack import EmbeddedTriton
from devstack.launch import ServedApp
from tests.conftest import start_shim
from tests.support import encode, photo, wait_until

SPEC = ImageSpec()
IMAGES = [prepare(decode(encode(photo(640, 480, seed=40 + i), "JPEG"), SPEC), SPEC, fp32=False) for i in range(5)]


def backend(url: str, transport: str) -> TritonBackend:
    return TritonBackend(url=url, model="resnet50", version="", connect_timeout_s=1, network_timeout_s=60,
                         readiness_timeout_s=5, image_shape=SPEC.shape, classes=1000, max_batch_size=32,
                         transport=transport)


def registered(triton: EmbeddedTriton) -> list[str]:
    with urllib.request.urlopen(f"http://{triton.http_url}/v2/systemsharedmemory/status", timeout=10) as answer:
        return [r["name"] for r in json.loads(answer.read())]


def files(prefix: str) -> list[str]:
    return sorted(p.name for p in shm.SHM_DIR.glob(prefix + "*"))


def owner_prefix(pid: int, *, not_in: set[str] = frozenset()) -> str:  # type: ignore[assignment]
    """The region prefix of the owner (a backend) that process `pid` made, from its lock file."""
    (token,) = [t for t, info in shm.owners().items() if info.get("pid") == pid and t not in not_in]
    return f"{shm.PREFIX}_{token}_"


@pytest.fixture(scope="module")
def today(triton: EmbeddedTriton) -> np.ndarray:
    """What the shim sent before transports existed: FP32 tensors in the HTTP body."""
    b = backend(triton.http_url, "http")
    try:
        return b.infer(IMAGES, [f"r{i}" for i in range(len(IMAGES))])
    finally:
        b.close()


@pytest.mark.parametrize("transport", ["shm", "uint8", "uint8-shm", "auto"])
def test_each_transport_gives_todays_logits(triton: EmbeddedTriton, today: np.ndarray, transport: str) -> None:
    b = backend(triton.http_url, transport)
    try:
        state = b.ready()
        assert state.ready, state.detail
        logits = b.infer(IMAGES, [f"r{i}" for i in range(len(IMAGES))])
        alone = b.infer(IMAGES[:1], ["one"])
    finally:
        b.close()
    assert np.abs(logits - today).max() <= 1e-5, np.abs(logits - today).max()
    assert np.abs(alone - today[:1]).max() <= 1e-5
    want = {"shm": "shm", "uint8": "uint8", "uint8-shm": "uint8-shm", "auto": "shm"}[transport]
    assert b.transport == want, state.detail
    assert f"transport {want}" in state.detail


def test_auto_sends_tensors_when_triton_normalises_on_a_cpu_and_says_why(triton: EmbeddedTriton) -> None:
    b = backend(triton.http_url, "auto")
    try:
        detail = b.ready().detail
    finally:
        b.close()
    assert "tensors: normalize would normalise them on KIND_CPU" in detail, detail
    assert "shared memory: Triton maps this host's /dev/shm" in detail, detail


def test_shared_memory_is_registered_once_and_gone_after_close(triton: EmbeddedTriton) -> None:
    others = set(shm.owners())
    b = backend(triton.http_url, "shm")
    for _ in range(3):  # reused across requests: one pair of regions for this thread
        b.infer(IMAGES[:2], ["a", "b"])
    prefix = owner_prefix(os.getpid(), not_in=others)
    mine = [n for n in registered(triton) if n.startswith(prefix)]
    assert len(mine) == 2 and len(files(prefix)) == 2, (mine, files(prefix))
    b.close()
    assert [n for n in registered(triton) if n.startswith(prefix)] == []
    assert files(prefix) == [] and not (shm.SHM_DIR / f"{prefix[:-1]}{shm.LOCK_SUFFIX}").exists()


def test_a_region_triton_cannot_open_falls_back_to_http_and_says_so(
        triton: EmbeddedTriton, today: np.ndarray, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """As with a Triton on another host: the file the shim maps is not one Triton can see."""
    real_create = shm.create

    def invisible(name: str, size: int, mode: int) -> shm.Region:
        region = real_create(name, size, mode)
        (shm.SHM_DIR / name).unlink()  # still mapped here, gone from /dev/shm
        return region

    monkeypatch.setattr(shm, "create", invisible)
    b = backend(triton.http_url, "shm")
    with caplog.at_level(logging.ERROR, logger="app.backends.triton"):
        logits = b.infer(IMAGES, [f"r{i}" for i in range(len(IMAGES))])
        b.infer(IMAGES[:1], ["again"])
    b.close()
    assert np.abs(logits - today).max() <= 1e-5
    assert b.transport == "http"
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "sending over HTTP" in errors[0], errors  # said once, not per batch


def test_a_killed_worker_leaves_no_shared_memory_behind(triton: EmbeddedTriton, test_repo: Path,
                                                        test_model_pt: Path, tmp_path: Path) -> None:
    served: ServedApp = start_shim(tmp_path, triton_url=triton.http_url, repo=test_repo, model_pt=test_model_pt,
                                   transport="shm", workers=1)
    try:
        served.wait("/readyz")
        import requests

        for _ in range(3):
            assert requests.post(served.url + "/predict", files={"image": encode(photo(320, 240))},
                                 timeout=60).status_code == 200
        (worker,) = workers(served)
        prefix = owner_prefix(worker)
        assert files(prefix) and any(n.startswith(prefix) for n in registered(triton))
        os.kill(worker, signal.SIGKILL)  # its lock goes with it: gunicorn's master can take it, and clean up
        wait_until(lambda: not files(prefix[:-1]) and not any(n.startswith(prefix) for n in registered(triton)),
                   60, "the master to remove the dead worker's regions and lock file")
        served.wait("/readyz")  # a new worker serves, with regions of its own
        assert requests.post(served.url + "/predict", files={"image": encode(photo(320, 240))},
                             timeout=60).status_code == 200
        (new_worker,) = workers(served)
        new_prefix = owner_prefix(new_worker)
        assert files(new_prefix)
    finally:
        served.stop()
    assert files(new_prefix[:-1]) == [] and not any(n.startswith(new_prefix) for n in registered(triton))


def workers(served: ServedApp) -> list[int]:
    pid = served.process.pid
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
