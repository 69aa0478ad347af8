"""docker-compose.yml, up for real, checked from the host as a user would (run by `make compose-test`).

The stack is docker-compose.yml with tests/compose/ci.yml (the wheel's Triton serving the numpy stand-in
repository, no GPU reservation, local images); every request goes through the ports it publishes: port
5000 is nginx (the `proxy` service) in front of the shim, which is not published, and nor is Triton: it is
checked from the compose network (Prometheus, on Triton's network; the proxy, not on it); no process of the
stack holds a secret in its arguments. The tests run in this order and share one stack: the last one takes it down.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import socket
import subprocess
import time
from pathlib import Path

import pytest
import requests
import yaml

from devstack.waiting import http_status
from tests.compose.driver import COMPOSE_FILES, PROJECT, STANDIN_REPO, Stack
from tests.support import encode, photo, standin_answer, wait_until

if os.environ.get("COMPOSE_STACK") != "1":  # named on the command line, collect_ignore does not apply
    pytest.skip("the compose stack runs under `make compose-test` (COMPOSE_STACK=1)", allow_module_level=True)

SHIM = "http://127.0.0.1:5000"  # the proxy, as clients see it
PROXY_LIVENESS = "/proxy-healthz"  # nginx's own location (deploy/nginx/nginx.conf.template)
PROMETHEUS = "http://127.0.0.1:9090"
TRITON_PORTS = (8000, 8001, 8002)  # HTTP, gRPC, metrics: published nowhere
TOP_K = 5

# Run in a container that reaches Triton (`python -c TRITON_CALLS URL [KEY | @KEYFILE]`): Triton's APIs called
# with the key given (or none), as status codes.
TRITON_CALLS = """
import json, sys, urllib.error, urllib.request
base = sys.argv[1]
key = sys.argv[2] if len(sys.argv) > 2 else None
if key and key.startswith("@"):
    key = open(key[1:]).read().strip()
def call(method, path, key=None):
    headers = {"triton-admin-key": key} if key else {}
    request = urllib.request.Request(base + path, data=b"" if method == "POST" else None, headers=headers,
                                     method=method)
    try:
        return urllib.request.urlopen(request, timeout=10).status
    except urllib.error.HTTPError as e:
        return e.code
print(json.dumps({
    "ready": call("GET", "/v2/models/resnet50/ready"),
    "shm_status": call("GET", "/v2/systemsharedmemory/status", key),
    "shm_register": call("POST", "/v2/systemsharedmemory/region/x/register", key),
    "unload": call("POST", "/v2/repository/models/no-such-model/unload", key),  # a name Triton does not serve
    "repository": call("POST", "/v2/repository/index", key),
    "trace": call("GET", "/v2/trace/setting", key),
    "logging": call("GET", "/v2/logging", key),
}))
"""


def predict(data: bytes, name: str = "test.jpg") -> requests.Response:
    return requests.post(f"{SHIM}/predict", files={"image": (name, data)}, timeout=30)


def test_up_wait_reached_healthy_through_the_real_healthchecks(stack: Stack) -> None:
    declared = yaml.safe_load(COMPOSE_FILES[0].read_text())["services"]["triton"]["healthcheck"]["test"]
    triton, shim, proxy = stack.inspect("triton"), stack.inspect("shim"), stack.inspect("proxy")
    for name, container in [("triton", triton), ("shim", shim), ("proxy", proxy)]:
        assert container["State"]["Health"]["Status"] == "healthy", (name, container["State"])
    assert triton["Config"]["Healthcheck"]["Test"] == declared  # docker-compose.yml's own check
    # The proxy's: docker-compose.yml's, as compose interpolates it ($$ -> $), nginx's own location.
    written = yaml.safe_load(COMPOSE_FILES[0].read_text())["services"]["proxy"]["healthcheck"]["test"]
    assert proxy["Config"]["Healthcheck"]["Test"] == [arg.replace("$$", "$") for arg in written]
    assert PROXY_LIVENESS in " ".join(proxy["Config"]["Healthcheck"]["Test"])
    assert "/healthz" in " ".join(shim["Config"]["Healthcheck"]["Test"])  # the Dockerfile's HEALTHCHECK
    assert not triton["HostConfig"].get("DeviceRequests"), "the CI override must drop the GPU reservation"


def test_tritons_ports_are_published_nowhere_and_nothing_answers_on_the_host(stack: Stack) -> None:
    assert not stack.inspect("triton")["HostConfig"].get("PortBindings"), "Triton's ports are published"
    for port in TRITON_PORTS:  # free before the stack started (tests/compose/driver.py's first stage)
        with socket.socket() as sock, pytest.raises(OSError):
            sock.settimeout(2)
            sock.connect(("127.0.0.1", port))


def test_from_a_container_that_is_not_the_shim_triton_is_unreachable_or_its_admin_apis_closed(stack: Stack) -> None:
    """The proxy is not on Triton's network: it cannot even resolve it. Prometheus is (it scrapes port 8002):
    from there the model-repository, trace, logging and shared-memory APIs answer 403 (closed to everyone: no
    key exists), and Triton goes on serving."""
    reach = stack.compose("exec", "-T", "proxy", "bash", "-c", "exec 3<>/dev/tcp/triton/8000", check=False)
    assert reach.returncode != 0, "the proxy reaches Triton"
    without = json.loads(stack.exec("prometheus", "python", "-c", TRITON_CALLS, "http://triton:8000"))
    assert {without[k] for k in ("unload", "repository", "trace", "logging")} == {403}, without
    assert without["ready"] == 200 and without["shm_status"] == 403, without
    reach = stack.compose("exec", "-T", "prometheus", "python", "-c",
                          "import socket; socket.create_connection(('triton', 8001), timeout=3)", check=False)
    assert reach.returncode != 0, "Triton serves gRPC"
    assert predict(encode(photo(64, 48))).status_code == 200


def test_no_process_of_the_stack_has_a_secret_in_its_arguments(stack: Stack) -> None:
    """`ps -eo args` on the host, which sees every container's processes as any of its users does: no key of
    Triton's (only the closed restriction, which holds none)."""
    listing = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True).stdout
    tritons = [line for line in listing.splitlines() if "--model-repository=/models" in line]
    assert tritons, "Triton's process is not in the listing"
    for line in listing.splitlines():
        for restriction in re.findall(r"--(?:http-restricted-api|grpc-restricted-protocol)=(\S+)", line):
            assert restriction.endswith(":closed:api=closed"), line


def test_clients_reach_the_shim_only_through_the_proxy(stack: Stack) -> None:
    assert not stack.inspect("shim")["HostConfig"].get("PortBindings"), "the shim must not be published"
    bindings = stack.inspect("proxy")["HostConfig"]["PortBindings"]
    assert [b["HostPort"] for b in bindings["8080/tcp"]] == ["5000"], bindings
    alive = requests.get(SHIM + PROXY_LIVENESS, timeout=10)
    assert alive.status_code == 200 and alive.json() == {"status": "ok"}
    ready = requests.get(f"{SHIM}/readyz", timeout=10)
    assert ready.status_code == 200 and ready.json()["ready"] is True, ready.text
    assert ready.headers["Server"] == "nginx"  # server_tokens off: no version
    answer = requests.post(f"{SHIM}/predict", files={"image": ("t.jpg", encode(photo(64, 48)))},
                           headers={"X-Request-ID": "compose-test-1"}, timeout=30)
    assert answer.status_code == 200 and answer.headers["X-Request-ID"] == "compose-test-1", answer.text
    logged = [json.loads(line.split(" ", 1)[1]) for line in stack.compose("logs", "--no-color", "--no-log-prefix",
              "--timestamps", "proxy").stdout.splitlines() if '"compose-test-1"' in line]
    assert logged and logged[-1]["upstream_status"] == "200" and logged[-1]["status"] == 200, logged


def test_nginx_passes_the_client_on_alone_never_what_it_wrote_in_x_forwarded_for(stack: Stack) -> None:
    answer = requests.post(f"{SHIM}/predict", files={"image": ("t.jpg", encode(photo(64, 48)))}, timeout=30,
                           headers={"X-Forwarded-For": "203.0.113.9", "X-Request-ID": "compose-test-xff"})
    assert answer.status_code == 200, answer.text
    logged = [json.loads(line.split(" ", 1)[1]) for line in stack.compose("logs", "--no-color", "--no-log-prefix",
              "--timestamps", "proxy").stdout.splitlines() if '"compose-test-xff"' in line]
    assert logged and logged[-1]["forwarded_for"] == "203.0.113.9", logged
    assert logged[-1]["client"] == logged[-1]["peer"] != "203.0.113.9"  # no trusted proxy: the peer is the client


def test_the_seeds_client_gets_the_contracts_answer(stack: Stack, tmp_path: Path) -> None:
    labels = (STANDIN_REPO / "resnet50" / "labels.txt").read_text().splitlines()
    # A PNG already 256 pixels high: no resampling, so the expected tensor does not depend on Pillow builds.
    path = tmp_path / "test.png"
    path.write_bytes(encode(photo(300, 256), "PNG"))
    with path.open("rb") as image:  # the seed's client, unchanged
        answer = requests.post(f"{SHIM}/predict", files={"image": image}, timeout=30)
    assert answer.status_code == 200, answer.text
    assert answer.headers["X-Request-ID"] and answer.headers["X-Shim-Backend"] == "triton"
    body = answer.json()
    assert list(body) == ["model", "predictions"] and body["model"] == "resnet50"
    expected = standin_answer(path.read_bytes(), labels)
    assert [(p["class_id"], p["label"]) for p in body["predictions"]] == [(p["class_id"], p["label"]) for p in expected]
    for got, want in zip(body["predictions"], expected, strict=True):
        assert list(got) == ["label", "class_id", "score"]
        assert got["score"] == pytest.approx(want["score"], rel=1e-5, abs=1e-9)
    # A photo as clients send them: another answer, the same one every time.
    jpeg = encode(photo(640, 480, seed=3))
    first, again = predict(jpeg), predict(jpeg)
    assert first.status_code == again.status_code == 200, first.text
    assert first.json() == again.json() != body
    scores = [p["score"] for p in first.json()["predictions"]]
    assert len(scores) == TOP_K and scores == sorted(scores, reverse=True) and 0 < scores[0] <= 1


@pytest.mark.parametrize(("files", "status", "code"), [
    ({"image": ("notes.txt", b"this is not an image")}, 400, "invalid_image"),
    ({"image": ("empty.jpg", b"")}, 400, "empty_image"),
    ({"file": ("test.jpg", b"\xff\xd8\xff")}, 400, "missing_image"),
])
def test_a_bad_upload_gets_its_4xx(stack: Stack, files: dict[str, tuple[str, bytes]], status: int,
                                   code: str) -> None:
    answer = requests.post(f"{SHIM}/predict", files=files, timeout=30)
    assert answer.status_code == status, answer.text
    assert answer.json()["error"] == code and answer.json()["message"]
    assert requests.get(f"{SHIM}/predict", timeout=30).status_code == 405


def test_the_shim_runs_as_a_non_root_user(stack: Stack) -> None:
    uids = dict(line.split(":", 1) for line in stack.exec("shim", "cat", "/proc/1/status").splitlines() if ":" in line)
    assert uids["Uid"].split() == ["10001"] * 4, uids["Uid"]  # real, effective, saved, filesystem: gunicorn's master
    top = stack.compose("top", "shim").stdout.splitlines()
    processes = [line.split()[0] for line in top[2:] if line.strip()]  # container name, header, then one per process
    assert len(processes) >= 2, top  # the master and its workers
    assert not {"root", "0"} & set(processes), top


# Run in the shim's container (`python -c INSIDE_SHIM METHOD PATH [JSON BODY] [TOKEN]`): gunicorn's own port,
# which serves what the public port does not (/metrics, /traffic). Prints status, then body.
INSIDE_SHIM = """
import sys, urllib.error, urllib.request
method, path = sys.argv[1], sys.argv[2]
body = sys.argv[3].encode() if len(sys.argv) > 3 and sys.argv[3] else None
headers = {"Content-Type": "application/json"}
if len(sys.argv) > 4:
    headers["Authorization"] = "Bearer " + sys.argv[4]
request = urllib.request.Request("http://127.0.0.1:5000" + path, data=body, method=method, headers=headers)
try:
    with urllib.request.urlopen(request, timeout=10) as answer:
        print(answer.status); print(answer.read().decode())
except urllib.error.HTTPError as e:
    print(e.code); print(e.read().decode())
"""


def inside_shim(stack: Stack, method: str, path: str, body: object = None, token: str = "") -> tuple[int, str]:
    args = [method, path, json.dumps(body) if body is not None else "", *([token] if token else [])]
    status, _, text = stack.exec("shim", "python", "-c", INSIDE_SHIM, *args).partition("\n")
    return int(status), text


def exposed(stack: Stack, name: str, **labels: str) -> float:
    """The sum of a series' samples as the shim's /metrics exposes them (the name as written, no parser
    renaming), read on gunicorn's port as Prometheus does: the public port does not serve it."""
    status, text = inside_shim(stack, "GET", "/metrics")
    assert status == 200, text
    total = 0.0
    for match in re.finditer(rf"^{name}\{{([^}}]*)\}} (\S+)", text, re.M):
        if all(f'{k}="{v}"' in match.group(1) for k, v in labels.items()):
            total += float(match.group(2))
    return total


def prometheus_value(query: str) -> float:
    result = requests.get(f"{PROMETHEUS}/api/v1/query", params={"query": query}, timeout=10).json()
    return sum(float(r["value"][1]) for r in result["data"]["result"])


def test_the_shims_metrics_and_tritons_metrics_port_answer(stack: Stack) -> None:
    """Triton's metrics port is on the compose network only: read through Prometheus, which scrapes it."""
    assert predict(encode(photo(64, 48))).status_code == 200
    assert exposed(stack, "shim_requests_total", backend="triton") >= 1
    assert exposed(stack, "shim_proxy_responses_total", path="/predict", status="200", reason="") >= 1
    queries = [f'sum({name}{{model="resnet50"}})' for name in ("nv_inference_count", "nv_inference_request_success")]
    wait_until(lambda: all(prometheus_value(q) >= 1 for q in queries), 90,
               "Prometheus to have scraped nv_inference_count and nv_inference_request_success from triton:8002")


def test_prometheus_scrapes_the_shim_and_triton(stack: Stack) -> None:
    def up() -> dict[str, str]:
        result = requests.get(f"{PROMETHEUS}/api/v1/query", params={"query": "up"}, timeout=10).json()
        return {r["metric"]["job"]: r["value"][1] for r in result["data"]["result"]}

    wait_until(lambda: up() == {"shim": "1", "triton": "1"}, 90, "Prometheus: up == 1 for jobs shim and triton")
    groups = requests.get(f"{PROMETHEUS}/api/v1/rules", timeout=10).json()["data"]["groups"]
    assert sum(len(g["rules"]) for g in groups) > 0, "deploy/prometheus/alerts.yml was not loaded"


def test_a_traffic_switch_lands_on_the_volume_and_survives_a_shim_restart(stack: Stack) -> None:
    switch = {"mode": "triton", "shadow_percent": 50, "reason": "compose-test"}
    # Not on the public port: nginx answers 404 and passes nothing on; gunicorn's own port serves GET /traffic.
    assert requests.put(f"{SHIM}/traffic", timeout=10).status_code == 404
    assert requests.put(f"{SHIM}/traffic", json=switch, timeout=10).status_code == 413  # no body read there
    assert requests.get(f"{SHIM}/traffic", timeout=10).status_code == 404
    assert requests.get(f"{SHIM}/metrics", timeout=10).status_code == 404
    assert inside_shim(stack, "PUT", "/traffic", switch)[0] == 405  # read-only over HTTP
    printed = json.loads(stack.exec("shim", "shim-traffic", "set", "triton", "--shadow-percent", "50",
                                    "--reason", "compose-test"))
    flag_file = json.loads(stack.exec("shim", "cat", "/var/run/shim/traffic.json"))
    assert {k: flag_file[k] for k in switch} == switch == {k: printed[k] for k in switch}
    assert flag_file["updated_by"].startswith("shim-traffic")
    container = stack.inspect("shim")
    (mount,) = [m for m in container["Mounts"] if m["Destination"] == "/var/run/shim"]
    assert (mount["Type"], mount["Name"]) == ("volume", f"{PROJECT}_shim-traffic")

    stack.compose("restart", "shim", timeout=120)
    stack.wait_healthy("shim", 120)
    stack.wait_healthy("proxy", 60)  # restarted with the shim (depends_on: restart: true), or never stopped
    wait_until(lambda: http_status(SHIM + PROXY_LIVENESS) == 200, 30, "the proxy to answer")
    restarted = stack.inspect("shim")
    assert restarted["Id"] == container["Id"] and restarted["State"]["StartedAt"] != container["State"]["StartedAt"]
    traffic = json.loads(inside_shim(stack, "GET", "/traffic")[1])
    assert {k: traffic[k] for k in switch} == switch, traffic
    assert traffic["source"] == "flag-file", traffic
    assert predict(encode(photo(64, 48))).status_code == 200


def test_triton_restarting_gives_503s_then_recovery_without_a_shim_restart(stack: Stack) -> None:
    shim_before = stack.inspect("shim")
    image = encode(photo(64, 48))
    assert predict(image).status_code == 200
    seen: list[tuple[int, str, str]] = []
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        restart = pool.submit(stack.compose, "restart", "triton", timeout=180)
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            answer = predict(image)
            body = answer.json()
            seen.append((answer.status_code, body.get("error", ""), body.get("message", "")))
            if restart.done() and answer.status_code == 200 and any(s == 503 for s, _, _ in seen):
                break
            time.sleep(0.2)
        restart.result()
    statuses = [s for s, _, _ in seen]
    assert (503, "backend_unavailable") in {(s, code) for s, code, _ in seen}, f"no 503 while Triton restarted: {seen}"
    assert statuses[-1] == 200, f"no recovery within 240 s: {seen[-10:]}"
    # Every failure is the contract's 503 (never a 500, nor a 502 or 504 from a half-started Triton).
    assert {(s, code) for s, code, _ in seen if s != 200} == {(503, "backend_unavailable")}, failures(seen)
    shim_after = stack.inspect("shim")
    assert (shim_after["Id"], shim_after["State"]["StartedAt"], shim_after["RestartCount"]) == \
        (shim_before["Id"], shim_before["State"]["StartedAt"], shim_before["RestartCount"]), "the shim restarted"
    stack.wait_healthy("triton", 120)


def failures(seen: list[tuple[int, str, str]]) -> str:
    """One line per kind of failure (numbers blanked: "next probe in 3 s")."""
    kinds = sorted({(s, code, re.sub(r"\b\d+\b", "N", message)) for s, code, message in seen if s != 200})
    return "\n".join(f"{s} {code}: {message}" for s, code, message in kinds)


def test_down_v_leaves_no_container_network_or_volume(stack: Stack) -> None:
    before = stack.leftovers()
    assert before["containers"] and before["networks"] and before["volumes"], before
    stack.down()
    assert stack.leftovers() == {"containers": [], "networks": [], "volumes": []}
