"""The pods' checks: only under `make k8s-test` (tests/k8s/driver.py), never in `make test`.

They need podman and the images and .cache/k8s/play.yaml that tests/k8s/driver.py makes first, so `pytest` skips
this folder at collection unless K8S_PODS=1 (which the driver sets). By hand, after a `make k8s-test` left the
images and the files: `K8S_PODS=1 .venv/bin/pytest tests/k8s` (as root, under `flock /tmp/docker.lock`).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator

import pytest

from tests.k8s import driver as k8s_test
from tests.k8s.kubelet import Pods, Target, check_env_names, check_started_as_written, expected_env, wait_ready
from tests.support import wait_until

collect_ignore_glob = [] if os.environ.get("K8S_PODS") == "1" else ["test_*.py"]


@pytest.fixture(scope="session")
def pods() -> Iterator[Pods]:
    """Every Deployment of deploy/k8s played as a pod (.cache/k8s/play.yaml); all of it removed afterwards."""
    played = Pods.load()
    k8s_test.remove_all(played.played, secret_files=False)
    if k8s_test.ensure_network() != played.plan.subnet:
        pytest.exit("podman gave the network another subnet than .cache/k8s/plan.json's: run make k8s-test", 1)
    try:
        k8s_test.play(k8s_test.PLAY_FILE, played.plan)
        yield played
    finally:
        played.save_logs(k8s_test.LOGS / "pods.log")
        k8s_test.remove_all(played.played)


@pytest.fixture(scope="session")
def ready(pods: Pods) -> dict[str, str]:
    """The pods once every container passed its probes, as a kubelet runs them; what each probe answered. The
    cheap checks of each container come first, so that a broken manifest fails on what is wrong with it."""
    names = [d["metadata"]["name"] for d in pods.deployments()]
    for name in names:
        check_containers(pods, name)
    return wait_ready(pods, names, readiness_deadline_s(pods))


def readiness_deadline_s(pods: Pods) -> float:
    """How long the slowest container may take to start by its own startupProbe: pods wait on each other."""
    probes = [t.container["startupProbe"] for t in pods.targets() if "startupProbe" in t.container]
    budgets = [float(p.get("initialDelaySeconds", 0))
               + float(p.get("periodSeconds", 10)) * int(p.get("failureThreshold", 3)) for p in probes]
    return max(budgets, default=120.0)


def names_read(pods: Pods, target: Target) -> set[str] | None:
    """The env names a container's program reads, asked of the program in the container where it can say:
    the shim's Settings (SHIM_*), and the proxy's template and the scripts its entrypoint sources, with the
    entrypoint's NGINX_ENVSUBST_* (PROXY_*).
    Names outside the program's prefix are not judged; None: nothing to ask."""
    env = expected_env(target.container)
    if any(name.startswith("SHIM_") for name in env):
        code = ("import dataclasses, json; from app.settings import PREFIX, Settings; print(json.dumps("
                "[PREFIX + f.name.upper() for f in dataclasses.fields(Settings)] + [PREFIX + 'BACKEND']))")
        known = set(json.loads(pods.exec(target, "python", "-c", code).stdout))
        return known | {name for name in env if not name.startswith("SHIM_")}
    if any(name.startswith("PROXY_") for name in env):
        folder = '"${NGINX_ENVSUBST_TEMPLATE_DIR:-/etc/nginx/templates}"'
        # the templates, and the scripts the entrypoint sources before it renders them (trusted-proxies.envsh)
        templates = pods.exec(target, "sh", "-c", f"cat {folder}/*.template && for f in /docker-entrypoint.d/*.envsh; "
                                                "do [ ! -f \"$f\" ] || cat \"$f\"; done")
        used = set(re.findall(r"\$\{?(PROXY_[A-Z0-9_]+)", templates.stdout))
        entrypoint = {"NGINX_ENVSUBST_TEMPLATE_DIR", "NGINX_ENVSUBST_OUTPUT_DIR", "NGINX_ENVSUBST_FILTER",
                      "NGINX_ENVSUBST_TEMPLATE_SUFFIX"}  # the official image's 20-envsubst-on-templates.sh
        return used | entrypoint | {name for name in env if not name.startswith(("PROXY_", "NGINX_"))}
    return None


def check_pod(pods: Pods, deployment: str) -> dict[str, str]:
    """Everything a kubelet would find wrong with the pod, cheapest first (check_containers), then its probes."""
    check_containers(pods, deployment)
    return wait_ready(pods, [deployment], readiness_deadline_s(pods))


def check_containers(pods: Pods, deployment: str) -> None:
    """Every container of the pod running its command, env, user and security context; env names its program
    reads."""
    for target in pods.targets(deployment):
        def started(t: Target = target) -> bool:
            return bool(pods.inspect(t)["State"]["Status"] != "created")

        wait_until(started, 30, f"{target.label} to start")
        check_started_as_written(pods, target)
        check_env_names(pods, target, names_read)
