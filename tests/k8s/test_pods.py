"""deploy/k8s's Deployments, played as pods by podman and checked as a kubelet would (run by `make k8s-test`).

The pods are .cache/k8s/play.yaml: `kubectl kustomize deploy/k8s` with the play-only changes that
tests/k8s/driver.py lists (local images, one replica, ports on 127.0.0.1, Services as hostAliases, the CI
Triton's command, a local model repository, emptyDirs as a kubelet makes them). Names, ports, paths, probes,
env and commands come from that file, never from here. The tests run in this order and share the pods; the
last one stops them.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from typing import Any

import pytest
import requests

from tests.k8s import driver as k8s_test
from tests.k8s.conftest import check_pod, names_read
from tests.k8s.driver import ENTRY, MUTATIONS, named, of_kind, pod_port, pod_spec, podman, selects
from tests.k8s.kubelet import (
    PROBES,
    Pods,
    check_env_names,
    check_started_as_written,
    describe,
    expected_env,
    fail_if_not_running,
    stop_pod,
)
from tests.support import encode, photo, standin_answer, wait_until

if os.environ.get("K8S_PODS") != "1":  # named on the command line, collect_ignore does not apply
    pytest.skip("the pods run under `make k8s-test` (K8S_PODS=1)", allow_module_level=True)


def client_url(pods: Pods, path: str) -> str:
    """Where the Service that selects the entry pod sends a client: its targetPort on the pod, as kube-proxy does."""
    deployment = pods.deployment(ENTRY)
    (service,) = [s for s in of_kind(pods.played, "Service") if selects(s, deployment)]
    (port,) = service["spec"]["ports"]
    return pods.url(ENTRY, pod_port(deployment, port.get("targetPort", port["port"])), path)


def test_every_probe_as_written_succeeds_as_a_kubelet_runs_it(pods: Pods, ready: dict[str, str]) -> None:
    written = [describe(t, kind) for t in pods.targets() for kind in PROBES if kind in t.container]
    assert written and sorted(ready) == sorted(written), ready
    print("\n".join(f"{probe}: {answer}" for probe, answer in ready.items()))


def test_every_container_runs_its_own_command_env_user_and_security_context(pods: Pods, ready: dict[str, str]) -> None:
    for target in pods.targets():
        check_started_as_written(pods, target)


def test_every_env_name_is_one_the_containers_program_reads(pods: Pods, ready: dict[str, str]) -> None:
    asked = [t.label for t in pods.targets() if names_read(pods, t) is not None]
    assert asked, "no container's program was asked which env names it reads"
    for target in pods.targets():
        check_env_names(pods, target, names_read)


def test_the_shim_reaches_triton_by_its_service_name_from_its_pod(pods: Pods, ready: dict[str, str]) -> None:
    shim = pods.target(ENTRY, ENTRY)
    address = expected_env(shim.container)["SHIM_TRITON_URL"]
    host = address.split(":")[0]
    assert any(s["metadata"]["name"] == host for s in of_kind(pods.played, "Service")), f"{address}: no such Service"
    code = f"import urllib.request; print(urllib.request.urlopen('http://{address}/v2/health/ready', timeout=5).status)"
    assert pods.exec(shim, "python", "-c", code).stdout.strip() == "200"
    ready_answer = requests.get(client_url(pods, "/readyz"), timeout=10).json()
    assert ready_answer["ready"] is True and address in json.dumps(ready_answer), ready_answer


def test_tritons_admin_apis_are_closed_and_no_process_has_a_secret_in_its_arguments(pods: Pods,
                                                                                    ready: dict[str, str]) -> None:
    """The Triton pod holds no key: its model-repository API answers 403 to every request (closed), and the
    host's `ps -eo args`, which lists every pod's processes as any user of a node sees them, shows no
    restriction but the closed one and no key of a Secret."""
    (name,) = [d["metadata"]["name"] for d in pods.deployments() if d["metadata"]["name"] != ENTRY]
    (target,) = pods.targets(name)
    (port,) = [p["containerPort"] for p in target.container["ports"] if p.get("name") == "http"]
    refused = requests.post(pods.url(name, port, "/v2/repository/index"), timeout=10)
    assert refused.status_code == 403 and "closed:api" in refused.text, refused.text
    secrets = [pods.exec(t, "sh", "-c", f"printenv {e['name']} || true").stdout.strip() for t in pods.targets()
               for e in t.container.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})]  # optional: unset
    listing = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True).stdout
    assert "--model-repository=/models" in listing, "Triton's process is not in the listing"
    for line in listing.splitlines():
        for restriction in re.findall(r"--(?:http-restricted-api|grpc-restricted-protocol)=(\S+)", line):
            assert restriction.endswith(":closed:api=closed"), line
        assert not [v for v in secrets if v and v in line], "a Secret's value is in a process's arguments"


def app_url(pods: Pods, path: str) -> str:
    """gunicorn's own port on the entry pod (what Prometheus scrapes): /traffic is not on the public port."""
    deployment = pods.deployment(ENTRY)
    return pods.url(ENTRY, pod_port(deployment, "app"), path)


def test_predict_answers_through_the_pods_nginx_as_the_service_routes_it(pods: Pods, ready: dict[str, str]) -> None:
    data = encode(photo(64, 48))
    answer = requests.post(client_url(pods, "/predict"), files={"image": ("k8s.jpg", data)}, timeout=30)
    assert answer.status_code == 200, answer.text
    labels = (k8s_test.MODEL_REPOSITORY / "resnet50" / "labels.txt").read_text().splitlines()
    got = answer.json()["predictions"]
    expected = standin_answer(data, labels)
    assert [p["class_id"] for p in got] == [p["class_id"] for p in expected], (got, expected)
    assert [p["score"] for p in got] == pytest.approx([p["score"] for p in expected], abs=1e-5)
    # It went through nginx: the proxy container's JSON access log has it.
    (proxy,) = [t for t in pods.targets(ENTRY) if t.container["name"] != ENTRY]
    assert "/predict" in pods.logs(proxy, tail=20), pods.logs(proxy, tail=20)


def flag_volume(pods: Pods) -> tuple[str, str, dict[str, Any]]:
    """The ConfigMap behind the shim's SHIM_FLAG_FILE: (the podman volume holding it, the file's key, the ConfigMap)."""
    shim = pods.target(ENTRY, ENTRY)
    flag_file = expected_env(shim.container)["SHIM_FLAG_FILE"]
    folder, key = flag_file.rsplit("/", 1)
    (mount,) = [m for m in shim.container["volumeMounts"] if m["mountPath"].rstrip("/") == folder]
    (volume,) = [v for v in pod_spec(pods.deployment(ENTRY))["volumes"] if v["name"] == mount["name"]]
    configmap = named(pods.played, "ConfigMap", volume["configMap"]["name"])
    return volume["configMap"]["name"], key, configmap


def test_the_traffic_configmap_switches_the_shim_without_a_restart(pods: Pods, ready: dict[str, str]) -> None:
    """As `kubectl apply` of a changed ConfigMap does: the kubelet swaps the mounted file (atomically), the
    workers follow it, no container restarts."""
    volume, key, configmap = flag_volume(pods)
    before = json.loads(configmap["data"][key])
    assert requests.get(client_url(pods, "/traffic"), timeout=10).status_code == 404  # not public
    traffic = requests.get(app_url(pods, "/traffic"), timeout=10).json()
    assert {k: traffic[k] for k in before} == before and traffic["source"] == "flag-file", traffic
    started = {t.name: pods.inspect(t)["State"]["StartedAt"] for t in pods.targets(ENTRY)}
    switch = {**before, "shadow_percent": (before.get("shadow_percent", 0) + 50) % 100, "reason": "k8s-test switch"}
    mountpoint = podman("volume", "inspect", volume, "--format", "{{.Mountpoint}}").stdout.strip()
    staged = f"{mountpoint}/..{key}.k8s-test"
    with open(staged, "w") as out:
        out.write(json.dumps(switch))
    os.chmod(staged, 0o644)
    os.replace(staged, f"{mountpoint}/{key}")

    def every_worker_follows() -> bool:  # several requests: the pod's workers each answer some
        answers = [requests.get(app_url(pods, "/traffic"), timeout=10).json() for _ in range(8)]
        return all({k: a[k] for k in switch} == switch and a["source"] == "flag-file" for a in answers)

    wait_until(every_worker_follows, 30, "every worker of the shim to follow the ConfigMap's new flag")
    for target in pods.targets(ENTRY):
        assert fail_if_not_running(pods, target)["State"]["StartedAt"] == started[target.name], target.label


@pytest.mark.parametrize("mutation", MUTATIONS)
def test_a_broken_manifest_fails_these_checks(pods: Pods, ready: dict[str, str], mutation: str) -> None:
    """The entry pod replayed with one mistake (tests/k8s/driver.py mutate): the checks above must fail on it, and
    say what is wrong. `tests/k8s/driver.py --mutate` runs a whole make k8s-test on such manifests."""
    mutated, what = k8s_test.mutate(pods.played, mutation)
    broken = Pods(mutated, pods.plan)
    replay(broken, f"mutant-{mutation}")
    with pytest.raises(AssertionError) as failure:
        check_pod(broken, ENTRY)
    message = str(failure.value)
    token = what.rsplit(" ", 1)[-1]  # the mutated path, command or env name
    assert token in message, f"the checks failed, but not on {what}:\n{message}"
    print(f"\n{mutation}: {what} -> {message.splitlines()[0][:300]}")


def test_the_real_pod_plays_again_and_passes(pods: Pods, ready: dict[str, str]) -> None:
    replay(pods, "entry")
    check_pod(pods, ENTRY)


def replay(pods: Pods, name: str) -> None:
    """The entry Deployment alone (with the ConfigMaps it mounts), its old pod removed first."""
    objects = [*of_kind(pods.played, "ConfigMap"), pods.deployment(ENTRY)]
    k8s_test.play(k8s_test.dump(objects, k8s_test.CACHE / f"{name}.yaml"), pods.plan, [ENTRY], replace=True)


def test_the_pods_stop_within_their_termination_grace_period(pods: Pods, ready: dict[str, str]) -> None:
    for deployment in pods.deployments():
        name = deployment["metadata"]["name"]
        grace = float(pod_spec(deployment).get("terminationGracePeriodSeconds", 30))
        started = time.monotonic()
        took, codes = stop_pod(pods, name)
        assert time.monotonic() - started < grace, f"{name} took {took:.1f} s, more than its {grace:.0f} s"
        killed = {c: code for c, code in codes.items() if code in (137, -9)}
        assert not killed, f"{name}: {killed} were killed after {took:.1f} s, not stopped by their stop signal"
        print(f"\n{name}: stopped in {took:.1f} s of {grace:.0f} s; exit codes {codes}")
