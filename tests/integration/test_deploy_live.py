"""The deploy files against the real things: the shim image's files serve /predict, the Kubernetes probes
hit endpoints that answer on a real shim, nginx and Triton, the Triton image matches the server tested."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from app.settings import Settings
from devstack import EmbeddedTriton, proxy
from devstack.launch import ServedApp, free_port
from tests.deploy_support import (
    K8S,
    compose,
    container,
    dockerfile_instructions,
    env_of,
    k8s_object,
    nginx_or_skip,
    probe,
    run,
    yaml_docs,
)
from tests.support import ROOT, encode, photo, wait_until

# The NGC image that ships each Triton server release the tests run (nvidia-pytriton's wheel). Triton's
# numbering: NGC YY.MM <-> 2.N.0, one a month (22.12 is v2.29.0, so 24.10 is v2.51.0).
NGC_RELEASE_OF = {"2.51.0": "24.10"}


def stages(path: Path) -> dict[str, list[tuple[str, str]]]:
    """A Dockerfile's instructions by stage name ("FROM image AS name"; unnamed: "final")."""
    found: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] = []
    for op, args in dockerfile_instructions(path):
        if op == "FROM":
            words = args.split()
            current = found.setdefault(words[2] if len(words) == 3 and words[1].upper() == "AS" else "final", [])
        current.append((op, args))
    return found


def copy_like_docker(steps: list[tuple[str, str]], dest_root: Path) -> None:
    """Carry out a stage's COPY instructions from the build context (the repository) into dest_root."""
    workdir = Path("/")
    for op, args in steps:
        if op == "WORKDIR":
            workdir = Path(args)
        if op != "COPY" or args.startswith("--from"):
            continue
        *sources, dest = args.split()
        target = dest_root / (workdir / dest).relative_to("/")
        for src in sources:
            into = target / Path(src).name if dest.endswith("/") or len(sources) > 1 else target
            into.parent.mkdir(parents=True, exist_ok=True)
            if (ROOT / src).is_dir():
                shutil.copytree(ROOT / src, into, ignore=shutil.ignore_patterns("__pycache__"))
            else:
                shutil.copy(ROOT / src, into)


@pytest.mark.triton
def test_the_files_the_shim_image_copies_are_enough_to_serve_predict(tmp_path: Path, triton: EmbeddedTriton,
                                                                     test_repo: Path) -> None:
    """No docker here: stage what the Dockerfile copies, install it as its build stage does (a wheel of
    the copied sources, not this checkout), start gunicorn from the runtime stage's files, and serve."""
    dockerfile = stages(ROOT / "Dockerfile")
    copy_like_docker(dockerfile["build"], tmp_path / "build")
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    assert run(*pip, "wheel", "--no-deps", "--no-build-isolation", "-w", wheels, tmp_path / "build/src").returncode == 0
    assert run(*pip, "install", "--no-deps", "--target", site, *wheels.glob("*.whl")).returncode == 0
    copy_like_docker(dockerfile["runtime"], tmp_path / "image")
    workdir = tmp_path / "image" / "srv" / "shim"
    workdir.mkdir(parents=True, exist_ok=True)  # the Dockerfile's WORKDIR: docker makes it
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHIM_") and k != "PROMETHEUS_MULTIPROC_DIR"}
    env.update(PYTHONPATH=str(site), SHIM_PORT=str(port), SHIM_WORKERS="1",
               SHIM_TRITON_URL=triton.http_url, SHIM_MODE="triton",
               SHIM_MODEL_REPOSITORY=str(test_repo))  # the image's /models (the Dockerfile's ENV)
    where = subprocess.run([sys.executable, "-c", "import app; print(app.__file__)"], cwd=workdir, env=env,
                           capture_output=True, text=True, check=True).stdout
    assert where.startswith(str(site)), f"app was imported from {where}, not from the staged image"
    log = tmp_path / "shim.log"
    with log.open("wb") as out:
        server = subprocess.Popen([sys.executable, "-m", "gunicorn", "-c", "python:app.gunicorn_conf"],
                                  cwd=workdir, env=env,
                                  stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until(lambda: ready(url) or server.poll() is not None, 90, "the staged shim's /readyz")
        assert server.poll() is None, log.read_text()
        answer = requests.post(url + "/predict", files={"image": ("p.jpg", encode(photo(64, 48)))}, timeout=60)
        assert answer.status_code == 200 and len(answer.json()["predictions"]) == 5, answer.text
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=30)


def ready(url: str) -> bool:
    try:
        return requests.get(url + "/readyz", timeout=5).status_code == 200
    except requests.ConnectionError:
        return False


@pytest.mark.triton
def test_the_triton_image_is_the_ngc_release_of_the_server_the_tests_run(triton: EmbeddedTriton) -> None:
    server = requests.get(f"http://{triton.http_url}/v2", timeout=10).json()
    release = NGC_RELEASE_OF.get(server["version"])
    assert release, f"the wheel's Triton is {server['version']}: add its NGC release to NGC_RELEASE_OF"
    image = f"nvcr.io/nvidia/tritonserver:{release}-py3"
    assert f"ARG TRITON_IMAGE={image}" in (ROOT / "docker" / "triton.Dockerfile").read_text()
    assert compose()["services"]["triton"]["image"].endswith(f":{release}")
    assert container(k8s_object("Deployment", "triton"))["image"].endswith(f":{release}")
    (kustomization,) = yaml_docs(K8S / "kustomization.yaml")
    assert {"name": "flask-triton-shim/triton", "newName": "flask-triton-shim/triton", "newTag": release} \
        in kustomization["images"]


@pytest.mark.triton
def test_probes_hit_endpoints_that_answer_on_the_real_shim_proxy_and_triton(shim_triton: ServedApp,
                                                                            triton: EmbeddedTriton,
                                                                            tmp_path: Path) -> None:
    """The shim pod's probes: readiness through nginx (deploy/nginx's configuration, in front of a real shim),
    start-up and liveness on gunicorn itself, nginx's own liveness; Triton's on the real Triton."""
    deployment = k8s_object("Deployment", "shim")
    shim, front, server = container(deployment), container(deployment, "proxy"), container(k8s_object("Deployment",
                                                                                                      "triton"))
    proxy_port = int(env_of(front)["PROXY_PORT"])
    assert "readinessProbe" not in shim  # the proxy's /readyz answers for both containers
    assert probe(shim, "startupProbe") == probe(shim, "livenessProbe") == ("/healthz", Settings().port)
    assert probe(front, "readinessProbe") == ("/readyz", proxy_port)
    assert probe(front, "livenessProbe") == (proxy.LIVENESS, proxy_port)
    assert probe(server, "readinessProbe") == ("/v2/health/ready", 8000)
    assert probe(server, "livenessProbe")[0] == "/v2/health/live"
    for kind in ("startupProbe", "livenessProbe"):
        assert requests.get(shim_triton.url + probe(shim, kind)[0], timeout=10).status_code == 200
    nginx = proxy_in_front_of(shim_triton, tmp_path)
    try:
        for kind in ("readinessProbe", "livenessProbe"):
            answer = requests.get(nginx.url + probe(front, kind)[0], timeout=10)
            assert answer.status_code == 200 and answer.headers["Server"] == "nginx", (kind, answer.text)
    finally:
        nginx.stop()
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert requests.get(f"http://{triton.http_url}{probe(server, kind)[0]}", timeout=10).status_code == 200


def proxy_in_front_of(shim: ServedApp, folder: Path) -> proxy.Proxy:
    """deploy/nginx's nginx in front of a running shim."""
    nginx_or_skip()
    return proxy.Proxy(folder / "nginx", f"127.0.0.1:{shim.port}").wait()


def raw_exchange(port: int, head: bytes, timeout_s: float = 8.0) -> tuple[bytes, float, float]:
    """Send a request head (and no body) on a new connection: what came back until nginx closed it, when its
    first byte came and when nginx closed (seconds from the start)."""
    started, first = time.monotonic(), 0.0
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as sock:
        sock.sendall(head)
        data = b""
        with contextlib.suppress(TimeoutError, ConnectionResetError):
            while chunk := sock.recv(65536):
                first = first or time.monotonic() - started
                data += chunk
    return data, first, time.monotonic() - started


def test_the_public_port_serves_the_api_only_and_takes_a_body_on_predict_only(shim_triton: ServedApp,
                                                                             tmp_path: Path) -> None:
    """Through deploy/nginx's nginx: /metrics and /traffic are not served on the public port
    (gunicorn's port still serves them: Prometheus scrapes there); every path but /predict answers a declared
    body with 413 at once, without reading it (a 16 MB Content-Length, nothing sent after the head) and
    without passing it on; the probes and /openapi.json are served."""
    nginx = proxy_in_front_of(shim_triton, tmp_path)
    try:
        for path in ("/metrics", "/traffic", "/nope"):
            answer = requests.get(nginx.url + path, timeout=10)
            assert answer.status_code == 404 and answer.json()["error"] == "not_found", (path, answer.text)
            assert requests.get(shim_triton.url + path, timeout=10).status_code != 404 or path == "/nope", path
        assert requests.put(nginx.url + "/traffic", timeout=10).status_code == 404
        for path in ("/healthz", "/readyz", "/openapi.json"):
            assert requests.get(nginx.url + path, timeout=10).status_code == 200, path
        for path in ("/metrics", "/healthz", "/readyz", "/openapi.json", "/x", "/traffic"):
            head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
                    "Content-Length: 16000000\r\n\r\n").encode()
            data, first, closed = raw_exchange(nginx.port, head)
            assert data.startswith(b"HTTP/1.1 413") and b'"too_large"' in data, (path, data[:200])
            assert first < 1.5, f"{path}: nginx waited {first:.1f} s for a body it refuses"
            # The connection ends after lingering_timeout (2 s) of silence: what is sent is discarded, unstored.
            assert closed < 4, f"{path}: nginx held the refused connection for {closed:.1f} s"
        chunked = b"POST /healthz HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
        assert raw_exchange(nginx.port, chunked)[0].startswith(b"HTTP/1.1 413")
        logged = [e for e in nginx.access_log() if e["method"] == "POST"]
        assert logged and not [e for e in logged if e["upstream"]], "a refused body was passed to gunicorn"
        assert {e["refusal"] for e in nginx.access_log() if e["status"] == 404} == {"not_found"}
    finally:
        nginx.stop()
