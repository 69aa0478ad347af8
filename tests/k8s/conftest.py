"""The pods' checks: only under `make k8s-test` (tools/k8s_test.py), never in `make test`.

They need podman and the images and .cache/k8s/play.yaml that tools/k8s_test.py makes first, so `pytest` skips
this folder at collection unless K8S_PODS=1 (which the driver sets). By hand, after a `make k8s-test` left the
images and the files: `K8S_PODS=1 .venv/bin/pytest tests/k8s` (as root, under `flock /tmp/docker.lock`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from tests.k8s.kubelet import Pods, wait_ready
from tools import k8s_test

collect_ignore_glob = [] if os.environ.get("K8S_PODS") == "1" else ["test_*.py"]


@pytest.fixture(scope="session")
def pods() -> Iterator[Pods]:
    """Every Deployment of deploy/k8s played as a pod (.cache/k8s/play.yaml); all of it removed afterwards."""
    played = Pods.load()
    k8s_test.remove_all(played.played)
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
    """The pods once every container passed its probes, as a kubelet runs them; what each probe answered."""
    return wait_ready(pods, [d["metadata"]["name"] for d in pods.deployments()], readiness_deadline_s(pods))


def readiness_deadline_s(pods: Pods) -> float:
    """How long the slowest container may take to start by its own startupProbe: pods wait on each other."""
    probes = [t.container["startupProbe"] for t in pods.targets() if "startupProbe" in t.container]
    budgets = [float(p.get("initialDelaySeconds", 0))
               + float(p.get("periodSeconds", 10)) * int(p.get("failureThreshold", 3)) for p in probes]
    return max(budgets, default=120.0)
