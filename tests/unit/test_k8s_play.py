"""make k8s-test's play-only changes and broken variants (tests/k8s/driver.py), checked without running a pod.

The pods themselves run under `make k8s-test` (tests/k8s). Here: what it plays differs from what kustomize
renders only where docs/testing.md ("Kubernetes in CI") says, and each broken variant changes exactly one thing.
"""

from __future__ import annotations

import copy
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.compose import driver as compose_test
from tests.k8s import driver as k8s_test

pytestmark = pytest.mark.unit

# Where a played manifest may differ from the rendered one (a path's keys, list indexes as "*").
ALLOWED = [
    ("Deployment", ("spec", "replicas")),
    ("Deployment", ("spec", "template", "spec", "hostAliases")),
    ("Deployment", ("spec", "template", "spec", "containers", "*", "image")),
    ("Deployment", ("spec", "template", "spec", "containers", "*", "imagePullPolicy")),
    ("Deployment", ("spec", "template", "spec", "containers", "*", "args")),  # the CI Triton's command only
    ("Deployment", ("spec", "template", "spec", "containers", "*", "ports", "*", "hostIP")),
    ("Deployment", ("spec", "template", "spec", "containers", "*", "ports", "*", "hostPort")),
    ("Deployment", ("spec", "template", "spec", "volumes", "*", "emptyDir")),
    ("Deployment", ("spec", "template", "spec", "volumes", "*", "secret")),
    ("Deployment", ("spec", "template", "spec", "volumes", "*", "hostPath")),
    # a subPath mount of a ConfigMap key -> its own volume (k8s_test.SUBPATH_VOLUME), a file of that key
    ("Deployment", ("spec", "template", "spec", "containers", "*", "volumeMounts", "*", "name")),
    ("Deployment", ("spec", "template", "spec", "containers", "*", "volumeMounts", "*", "subPath")),
    ("PersistentVolumeClaim", ("metadata", "annotations")),
]


@pytest.fixture(scope="module")
def rendered() -> list[dict[str, Any]]:
    """`kubectl kustomize deploy/k8s` (skipped where neither kubectl 1.27+ nor kustomize v5 is installed)."""
    try:
        k8s_test.kustomize_command()
    except compose_test.StageError as e:
        pytest.skip(str(e))
    return k8s_test.render()


def differences(a: Any, b: Any, path: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """The paths (list indexes as "*") where two documents differ, down to the first differing key."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b)) for d in differences(a.get(k), b.get(k), (*path, k))]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for x, y in zip(a, b, strict=True) for d in differences(x, y, (*path, "*"))]
    return [] if a == b else [path]


def allowed(kind: str, path: tuple[str, ...]) -> bool:
    return any(kind == k and path[:len(prefix)] == prefix for k, prefix in ALLOWED)


def test_what_is_played_differs_from_the_rendered_manifests_only_where_the_docs_say(
        rendered: list[dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    objects = rendered
    monkeypatch.setattr(k8s_test, "SECRET_DIRS", tmp_path / "secrets")  # where secret volumes' files go
    monkeypatch.setattr(k8s_test, "SUBPATH_DIRS", tmp_path / "subpath")  # and subPath mounts' files
    try:
        stack_config = compose_test.Stack().config()
    except (compose_test.StageError, FileNotFoundError, subprocess.TimeoutExpired) as e:
        pytest.skip(f"needs `docker compose config` (make compose-test installs Compose v2): {e}")
    assert stack_config["services"]
    played, plan, needed = k8s_test.play_version(objects, stack=compose_test.Stack(), network="n",
                                                 subnet="10.99.0.0/24", model_repository=tmp_path)
    assert [(o["kind"], o["metadata"]["name"]) for o in played] == [(o["kind"], o["metadata"]["name"]) for o in objects]
    for before, after in zip(objects, played, strict=True):
        after = without_subpath_volumes(after)
        wrong = [p for p in differences(before, after) if not allowed(before["kind"], p)]
        assert not wrong, f"{before['kind']} {before['metadata']['name']} changed at {wrong}"
    deployments = k8s_test.of_kind(played, "Deployment")
    assert all(d["spec"].get("replicas", 1) == 1 for d in deployments)  # none where an HPA owns the count
    containers = [c for d in deployments for c in k8s_test.pod_spec(d)["containers"]]
    assert all(c["imagePullPolicy"] == "Never" and c["image"] in plan.images.values() for c in containers)
    assert all(p["hostIP"] == "127.0.0.1" for c in containers for p in c.get("ports", []))
    assert set(needed) <= set(stack_config["services"])
    assert len(plan.changes) >= 5 and all(len(change) > 40 for change in plan.changes)  # each says why
    # No pod needs a Secret the user creates: Triton holds no key, the shim none either.
    assert plan.user_secrets == {}


def test_only_secrets_the_user_creates_and_no_optional_ones_are_made_for_the_run() -> None:
    def deployment(*env: dict[str, Any]) -> dict[str, Any]:
        return {"kind": "Deployment", "metadata": {"name": "d"},
                "spec": {"template": {"spec": {"containers": [{"name": "c", "env": list(env)}]}}}}

    def ref(name: str, key: str, **extra: Any) -> dict[str, Any]:
        return {"name": f"E_{key}", "valueFrom": {"secretKeyRef": {"name": name, "key": key, **extra}}}

    held = {"kind": "Secret", "metadata": {"name": "shipped"}, "data": {}}
    objects = [held, deployment(ref("mine", "b"), ref("mine", "a"), ref("shipped", "x"),
                                ref("off", "y", optional=True), {"name": "PLAIN", "value": "1"})]
    assert k8s_test.user_secrets(objects) == {"mine": ["a", "b"]}


def without_subpath_volumes(played: dict[str, Any]) -> dict[str, Any]:
    """A played Deployment less the volumes that k8s_test adds for subPath mounts (checked on their own)."""
    if played["kind"] != "Deployment":
        return played
    copy = {**played, "spec": {**played["spec"], "template": {**played["spec"]["template"]}}}
    spec = copy["spec"]["template"]["spec"] = dict(played["spec"]["template"]["spec"])
    spec["volumes"] = [v for v in spec["volumes"] if not v["name"].startswith(k8s_test.SUBPATH_VOLUME)]
    return copy


def test_a_subpath_mount_of_a_configmap_key_becomes_that_file_with_the_volumes_mode(
        rendered: list[dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """podman 4.3 ignores subPath (the proxy's trusted-proxies.envsh would be a folder, which nginx's entrypoint
    skips): the played pod binds the ConfigMap's key, as a file, where the manifest mounts it."""
    monkeypatch.setattr(k8s_test, "SUBPATH_DIRS", tmp_path)
    deployments = [copy.deepcopy(d) for d in k8s_test.of_kind(rendered, "Deployment")]
    configmaps = k8s_test.of_kind(rendered, "ConfigMap")
    mounts = {(d["metadata"]["name"], c["name"], m["mountPath"]): m["subPath"] for d in deployments
              for c in k8s_test.pod_spec(d)["containers"] for m in c.get("volumeMounts", []) if "subPath" in m}
    assert mounts, "deploy/k8s mounts no ConfigMap key by subPath: this test has nothing to check"
    for d in deployments:
        volumes = {v["name"]: v for v in k8s_test.pod_spec(d).get("volumes", [])}
        k8s_test.subpath_mounts(d, configmaps)
        spec = k8s_test.pod_spec(d)
        for c in spec["containers"]:
            for m in c.get("volumeMounts", []):
                key = mounts.get((d["metadata"]["name"], c["name"], m["mountPath"]))
                if key is None:
                    continue
                assert "subPath" not in m
                (volume,) = [v for v in spec["volumes"] if v["name"] == m["name"]]
                path = Path(volume["hostPath"]["path"])
                assert volume["hostPath"]["type"] == "File" and path.name == key
                (source,) = [v["configMap"] for v in volumes.values() if "configMap" in v
                             and key in k8s_test.named(configmaps, "ConfigMap", v["configMap"]["name"])["data"]]
                assert path.read_text() == k8s_test.named(configmaps, "ConfigMap", source["name"])["data"][key]
                assert path.stat().st_mode & 0o777 == source.get("defaultMode", 0o644)


@pytest.mark.parametrize("mutation", k8s_test.MUTATIONS)
def test_each_broken_variant_changes_one_thing_in_the_entry_pod(rendered: list[dict[str, Any]], mutation: str) -> None:
    objects = rendered
    mutated, what = k8s_test.mutate(objects, mutation)
    changed = [(before["kind"], p) for before, after in zip(objects, mutated, strict=True)
               for p in differences(before, after)]
    assert len(changed) == 1, changed
    kind, path = changed[0]
    assert kind == "Deployment" and path[:4] == ("spec", "template", "spec", "containers")
    assert {"path", "args", "command", "name"} & set(path), path
    assert "mutant" in what.rsplit(" ", 1)[-1].lower(), what  # the checks must name it: tests/k8s looks for it
    (entry,) = [d for d in k8s_test.of_kind(objects, "Deployment") if d["metadata"]["name"] == k8s_test.ENTRY]
    assert path in {p for p in differences(entry, k8s_test.named(mutated, "Deployment", k8s_test.ENTRY))}
