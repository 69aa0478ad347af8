"""What operators watch, live: every metric the dashboard, alerts and adapter rules use must be in a scrape of
the shim under gunicorn (behind deploy/nginx's nginx, as deployed, whose answers the shim counts) and of a real
Triton (except the GPU families a CPU Triton cannot export, checked against Triton's docs); nginx's own
refusals in the shim's metrics; counts across workers, request IDs, JSON logs. The files themselves are
checked in tests/unit/test_observability_files.py."""

from __future__ import annotations

import json
import os
import signal
import socket
import uuid
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from app.settings import Settings
from devstack import EmbeddedTriton, promtext, proxy
from devstack.launch import ServedApp
from tests.conftest import start_shim, stop_soon
from tests.deploy_support import (
    adapter_query,
    adapter_rules,
    expressions,
    nginx_or_skip,
    parse_selectors,
)
from tests.support import encode, photo, wait_until

# Triton's GPU metrics as its documentation lists them (triton-inference-server/server,
# docs/user_guide/metrics.md, "GPU Metrics" table). Triton without a GPU (as in make test) exports none.
TRITON_DOCUMENTED_GPU_METRICS = {
    "nv_gpu_power_usage", "nv_gpu_power_limit", "nv_energy_consumption",
    "nv_gpu_utilization", "nv_gpu_memory_total_bytes", "nv_gpu_memory_used_bytes",
}
# The one list of exceptions: GPU-only metrics the dashboard, alerts and adapter rules use.
GPU_ONLY = {"nv_gpu_utilization", "nv_gpu_memory_used_bytes"}
PROMETHEUS_SYNTHETIC = {"up"}  # series Prometheus writes for each target itself: never in a scrape
TARGET_LABELS = {"job", "instance"}  # labels Prometheus adds to every scraped series
SEED_PANEL = 'sum(rate(nv_inference_request_success{model="resnet50"}[1m])) by (model)'


def scrape(url: str) -> dict[str, set[str]]:
    """Sample names in a scrape, names as exposed (Triton's counters have no _total), with their label names."""
    return promtext.label_names(promtext.scrape(url))


def predict(base_url: str, jpeg: bytes, request_ids: Iterable[str]) -> list[requests.Response]:
    def one(request_id: str) -> requests.Response:
        return requests.post(base_url + "/predict", files={"image": ("photo.jpg", jpeg)},
                             headers={"X-Request-ID": request_id}, timeout=120)

    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, request_ids))


@pytest.fixture(scope="module")
def behind_nginx(triton: EmbeddedTriton, test_repo: Path, test_model_pt: Path,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServedApp, proxy.Proxy]]:
    """The shim as deployed behind nginx: SHIM_PROXY_HOPS=1 and nginx's access log counted (SHIM_PROXY_LOG_ADDRESS)."""
    nginx_or_skip()
    folder = tmp_path_factory.mktemp("behind-nginx")
    address = f"127.0.0.1:{proxy.free_udp_port()}"
    served = start_shim(folder, triton_url=triton.http_url, repo=test_repo, model_pt=test_model_pt, mode="triton",
                        proxy_log_address=address, proxy_hops=1).wait("/readyz")
    front = proxy.Proxy(folder / "nginx", f"127.0.0.1:{served.port}", settings=Settings(proxy_log_address=address))
    yield served, front.wait()
    front.stop()
    stop_soon(served)


@pytest.mark.triton
def test_every_metric_the_dashboard_alerts_and_adapter_use_is_exported(behind_nginx: tuple[ServedApp, proxy.Proxy],
                                                                       triton: EmbeddedTriton) -> None:
    shim, front = behind_nginx
    answers = predict(front.url, encode(photo(320, 240, seed=5)), [f"scrape-{i}" for i in range(4)])
    assert [a.status_code for a in answers] == [200] * 4
    wait_until(lambda: proxy_count(shim, "/predict", "200", "") >= 4, 10, "nginx's answers in the shim's /metrics")
    scraped = {**scrape(shim.url + "/metrics"), **scrape(triton.metrics_url)}
    queries = {**expressions(), **{f"adapter rule {r['name']['as']}": adapter_query(r) for r in adapter_rules()}}
    gpu_used: set[str] = set()
    for where, expr in queries.items():
        selectors, grouping = parse_selectors(expr)
        metrics = {s.metric for s in selectors}
        gpu_used |= metrics & GPU_ONLY
        for selector in selectors:
            if selector.metric in GPU_ONLY | PROMETHEUS_SYNTHETIC:
                continue
            assert selector.metric in scraped, f"{where}: {selector.metric} is in no scrape of the shim or Triton"
            extra = selector.labels - scraped[selector.metric] - TARGET_LABELS - {"namespace", "pod"}
            assert not extra, f"{where}: {selector.metric} has no label {sorted(extra)}"
        if not metrics & (GPU_ONLY | PROMETHEUS_SYNTHETIC):
            available = set().union(*(scraped[m] for m in metrics)) | TARGET_LABELS | {"namespace", "pod"}
            assert grouping <= available, f"{where}: grouped by {sorted(grouping - available)}, which no series has"
    # The exceptions are exactly the GPU metrics in use, documented by Triton and absent without a GPU.
    assert gpu_used == GPU_ONLY
    assert GPU_ONLY <= TRITON_DOCUMENTED_GPU_METRICS
    assert not GPU_ONLY & set(scraped)
    assert {m for m in scraped if m.startswith("nv_inference_")}, "Triton's scrape has no inference metrics"


def proxy_count(shim: ServedApp, path: str, status: str, reason: str) -> float:
    return promtext.total(promtext.scrape(shim.url + "/metrics"), "shim_proxy_responses_total", path=path,
                          status=status, reason=reason)


def raw_answer(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(data)
        sock.settimeout(10)
        return sock.recv(65536)


def exporter_pids(master: int) -> list[int]:
    """The master's `python -m app.proxy_log` processes (app/gunicorn_conf.py's Supervisor: a thread starts them)."""
    tasks = Path(f"/proc/{master}/task").iterdir()
    children = [pid for task in tasks for pid in (task / "children").read_text().split()]
    return [int(pid) for pid in children if b"app.proxy_log" in Path(f"/proc/{pid}/cmdline").read_bytes()]


@pytest.mark.triton
def test_nginx_refusals_show_in_the_shims_metrics_and_survive_the_counter_restarting(
        behind_nginx: tuple[ServedApp, proxy.Proxy]) -> None:
    """nginx answers these itself and the shim never sees them: an upload declared over the limit (413), a
    broken chunked body (400 invalid_body). Each is counted once with its reason, as nginx logged it; the
    counting process, killed, is started again by gunicorn's master and the counts go on from where they were."""
    shim, front = behind_nginx
    head = "POST /predict HTTP/1.1\r\nHost: x\r\nContent-Type: multipart/form-data; boundary=x\r\n"
    oversize = (head + f"Content-Length: {200 << 20}\r\n\r\n").encode()
    broken = (head + "Transfer-Encoding: chunked\r\n\r\n").encode() + b"ZZZ\r\nxx\r\n0\r\n\r\n"
    keys = [("/predict", "413", "too_large"), ("/predict", "400", "invalid_body"), ("/predict", "200", "")]
    before = {key: proxy_count(shim, *key) for key in keys}

    def sent() -> None:
        assert raw_answer(front.port, oversize).startswith(b"HTTP/1.1 413")
        assert raw_answer(front.port, broken).startswith(b"HTTP/1.1 400")
        (answer,) = predict(front.url, encode(photo(64, 48)), [uuid.uuid4().hex])
        assert answer.status_code == 200

    def counted(since: dict[tuple[str, str, str], float]) -> bool:
        return all(proxy_count(shim, *key) - since[key] == 1 for key in keys)

    sent()
    wait_until(lambda: counted(before), 10, "one 413 too_large, one 400 invalid_body and one 200 in /metrics")
    logged = [(e["status"], e["refusal"]) for e in front.access_log() if e["path"] == "/predict"][-3:]
    # In any order: nginx logs each connection when it is done with it (a 413's may linger after its answer).
    assert sorted(logged) == [(200, ""), (400, "invalid_body"), (413, "too_large")], logged
    (pid,) = exporter_pids(shim.process.pid)
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: exporter_pids(shim.process.pid) not in ([], [pid]), 15, "the master to start the counter again")
    # Lines sent before the new process has bound its socket are lost (nginx sends over UDP, to no one): send
    # until one is counted, then the counts go on, the dead process's included.
    total = proxy_count(shim, *keys[0])

    def one_more_counted() -> bool:
        assert raw_answer(front.port, oversize).startswith(b"HTTP/1.1 413")
        return proxy_count(shim, *keys[0]) > total

    wait_until(one_more_counted, 20, "a 413 counted by the new process", interval_s=0.5)
    again = {key: proxy_count(shim, *key) for key in keys}
    assert again[keys[0]] >= before[keys[0]] + 2  # the killed process's count is still in the sum
    sent()
    wait_until(lambda: counted(again), 10, "the three answers counted by the new process")


def requests_total(url: str) -> float:
    return promtext.total(promtext.scrape(url + "/metrics"), "shim_requests_total")


def logged(served: ServedApp, request_ids: set[str]) -> list[dict[str, object]]:
    """The lines of these requests, once every one has been written: lines below WARNING are written in batches
    within app/logs.py's FLUSH_S, not with each answer."""
    found: list[dict[str, object]] = []

    def all_there() -> bool:
        found[:] = [line for line in log_lines(served) if line.get("request_id") in request_ids]
        return {line["request_id"] for line in found} == request_ids

    wait_until(all_there, 10, f"the log lines of {len(request_ids)} requests")
    return found


def log_lines(served: ServedApp) -> list[dict[str, object]]:
    lines = []
    for line in served.log_path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                lines.append(json.loads(line))
            except ValueError:
                continue
    return lines


@pytest.mark.triton
def test_the_request_counter_counts_every_request_whichever_worker_answered(shim_triton: ServedApp) -> None:
    jpeg = encode(photo(320, 240, seed=7))
    before = requests_total(shim_triton.url)
    sent: list[str] = []
    workers: set[object] = set()
    for _ in range(4):  # the kernel hands connections to either worker: a few rounds reach both
        ids = [f"count-{uuid.uuid4().hex}" for _ in range(40)]
        assert {a.status_code for a in predict(shim_triton.url, jpeg, ids)} == {200}
        sent += ids
        mine = set(ids)
        workers |= {line["pid"] for line in logged(shim_triton, mine)}
        if len(workers) == 2:
            break
    assert requests_total(shim_triton.url) - before == len(sent)
    assert len(workers) == 2, f"one worker answered all {len(sent)} requests: {workers}"


@pytest.mark.triton
def test_a_client_request_id_comes_back_and_is_in_the_log_line_of_its_request(shim_triton: ServedApp) -> None:
    request_id = f"client-{uuid.uuid4().hex}"
    (answer,) = predict(shim_triton.url, encode(photo(200, 150, seed=3)), [request_id])
    assert answer.status_code == 200 and answer.headers["X-Request-ID"] == request_id
    lines = logged(shim_triton, {request_id})
    assert [line["message"] for line in lines] == ["POST /predict 200"], lines
    assert lines[0]["status"] == 200 and isinstance(lines[0]["pid"], int)


@pytest.mark.triton
def test_every_line_the_shim_writes_is_json_gunicorns_and_warnings_included(shim_legacy: ServedApp,
                                                                             shim_triton: ServedApp) -> None:
    loggers = set()
    for served in (shim_legacy, shim_triton):
        for line in served.log_path.read_text().splitlines():
            entry = json.loads(line)  # a plain-text line fails here
            assert {"ts", "level", "logger", "message", "pid"} <= set(entry), entry
            loggers.add(entry["logger"])
    assert "gunicorn.error" in loggers, loggers  # the master's and workers' own lines
    assert "py.warnings" in loggers, loggers  # torch's FutureWarning when the legacy model loads
