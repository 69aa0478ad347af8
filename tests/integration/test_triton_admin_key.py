"""Triton with its model-repository, shared-memory, trace and logging APIs behind an admin key (Triton's
--http-restricted-api / --grpc-restricted-protocol), as `make run` starts it: without the key, unload and
shared memory are refused; with it, the shim's shared memory transport works and a load succeeds.

Triton serves modelrepo/standin.py's numpy models (a few seconds to start, no torch).
"""

from __future__ import annotations

import json
import secrets
import shutil
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from app.backends import shm
from app.backends.triton import TritonBackend
from devstack import EmbeddedTriton, EmbeddedTritonConfig
from devstack.__main__ import parse_args
from tests.conftest import start_shim
from tests.support import ROOT, encode, free_ports, photo

pytestmark = pytest.mark.triton
KEY = secrets.token_hex(16)
HEADER = "triton-admin-key"


@pytest.fixture(scope="module")
def locked(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedTriton]:
    from modelrepo.standin import write_standin_repo

    tmp = tmp_path_factory.mktemp("locked-triton")
    http, grpc, metrics = free_ports(3)
    config = EmbeddedTritonConfig(model_repository=write_standin_repo(tmp / "triton_repo"), cache_dir=tmp / "cache",
                                  http_port=http, grpc_port=grpc, metrics_port=metrics, admin_key=KEY,
                                  startup_timeout_s=240)
    server = EmbeddedTriton(config).start()
    yield server
    server.stop(graceful=False)


def call(triton: EmbeddedTriton, method: str, path: str, key: str | None = None) -> tuple[int, str]:
    request = urllib.request.Request(f"http://{triton.http_url}{path}", method=method,
                                     data=b"" if method == "POST" else None, headers={HEADER: key} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return answer.status, answer.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_without_the_key_unload_and_shared_memory_are_refused_and_inference_stays_open(
        locked: EmbeddedTriton) -> None:
    for method, path in [("POST", "/v2/repository/models/resnet50/unload"), ("GET", "/v2/systemsharedmemory/status"),
                         ("POST", "/v2/repository/index"), ("GET", "/v2/trace/setting"), ("GET", "/v2/logging")]:
        status, body = call(locked, method, path)
        assert status == 403 and "restricted" in body, (path, status, body)
        assert call(locked, method, path, key="x" * 32)[0] == 403, f"{path}: a wrong key"
    assert call(locked, "GET", "/v2/models/resnet50/ready")[0] == 200  # still loaded
    assert call(locked, "GET", "/v2/models/resnet50/config")[0] == 200  # what the shim reads needs no key
    assert KEY not in repr(locked.config)


def test_with_the_key_a_load_succeeds(locked: EmbeddedTriton) -> None:
    status, body = call(locked, "POST", "/v2/repository/models/resnet50/load", key=KEY)
    assert status == 200, body
    assert call(locked, "GET", "/v2/models/resnet50/ready")[0] == 200


def test_the_shim_needs_the_key_for_shared_memory_and_says_so(locked: EmbeddedTriton) -> None:
    backend = TritonBackend(url=locked.http_url, model="resnet50", version="", connect_timeout_s=1,
                            network_timeout_s=30, readiness_timeout_s=10, image_shape=(3, 224, 224), classes=1000,
                            max_batch_size=8, transport="shm")
    try:
        state = backend.ready()
    finally:
        backend.close()
    assert state.ready and backend.transport == "http", state.detail  # still serves, over HTTP
    assert "SHIM_TRITON_ADMIN_KEY" in state.detail, state.detail


def test_the_shim_with_the_key_from_a_file_sends_through_shared_memory_and_cleans_up(
        locked: EmbeddedTriton, test_model_pt: Path, tmp_path: Path) -> None:
    from modelrepo.export import write_labels

    labels = tmp_path / "repo" / "resnet50" / "labels.txt"
    labels.parent.mkdir(parents=True)
    write_labels("resnet50", labels)
    shutil.copy(ROOT / "triton_repo" / "resnet50" / "model.toml", labels.parent)  # the description beside them
    secret = tmp_path / "triton-admin-key"
    secret.write_text(KEY + "\n")
    served = start_shim(tmp_path, triton_url=locked.http_url, repo=labels.parent.parent, model_pt=test_model_pt,
                        mode="triton", transport="shm", workers=1, triton_admin_key_file=secret)
    try:
        served.wait("/readyz")
        ready = requests.get(served.url + "/readyz", timeout=30).json()
        assert ready["transport"] == "shm", ready
        for seed in range(3):
            answer = requests.post(served.url + "/predict", files={"image": encode(photo(320, 240, seed=seed))},
                                   timeout=60)
            assert answer.status_code == 200, answer.text
        status, body = call(locked, "GET", "/v2/systemsharedmemory/status", key=KEY)
        assert status == 200 and any(shm.owner_of(r["name"]) for r in json.loads(body)), body
    finally:
        served.stop()
    _, body = call(locked, "GET", "/v2/systemsharedmemory/status", key=KEY)
    assert not [r["name"] for r in json.loads(body) if shm.owner_of(r["name"])], "unregistered at exit, with the key"
    assert KEY not in served.log_path.read_text(), "the key must never reach the log"


def test_the_cli_reads_the_key_from_a_file_and_refuses_an_empty_one(tmp_path: Path) -> None:
    from devstack import EmbeddedTritonError

    secret = tmp_path / "key"
    secret.write_text(KEY + "\n")
    assert parse_args(["--admin-key-file", str(secret)]).admin_headers == {HEADER: KEY}
    secret.write_text("")
    with pytest.raises(EmbeddedTritonError, match="is empty"):
        parse_args(["--admin-key-file", str(secret)])
    with pytest.raises(EmbeddedTritonError, match="at least 16 characters"):
        EmbeddedTritonConfig(model_repository=tmp_path, admin_key="short")
