"""docker-compose.yml, the Dockerfiles, deploy/k8s and deploy/nginx, checked by the real validators.

No server, docker engine or cluster runs here: each file is validated by the tool its format has (the
Compose specification's schema, hadolint, the Kubernetes schemas, nginx -t), each validator is shown to
reject a broken copy, and what the files promise (ports, probes, settings, limits) is checked against the
shim's code. tests/integration/test_deploy_live.py checks the rest against a real shim, nginx and Triton.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from app.readiness import DEADLINE_S as READINESS_DEADLINE_S
from app.settings import Settings
from devstack import proxy
from devstack.launch import free_port
from tests.deploy_support import (
    COMPOSE,
    DOCKERFILES,
    K8S,
    adapter_query,
    adapter_rules,
    compose,
    container,
    containers,
    dockerfile_instructions,
    env_of,
    k8s_manifests,
    k8s_object,
    k8s_objects,
    nginx_or_skip,
    parse_selectors,
    restricted_groups,
    run,
    series_name,
    tool,
    yaml_docs,
)
from tests.support import ROOT

K8S_VERSIONS = ["1.29", "1.37"]  # the oldest Kubernetes still commonly run, the newest the validator ships
SETTINGS_VARS = {f"SHIM_{f.name.upper()}" for f in dataclasses.fields(Settings)}


def shim_env() -> dict[str, str]:
    return {str(k): str(v) for k, v in compose()["services"]["shim"]["environment"].items()}


def test_compose_file_validates_against_the_compose_specification() -> None:
    result = run(tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", COMPOSE)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_compose_check_rejects_a_misspelt_key_and_a_wrong_gpu_reservation(tmp_path: Path) -> None:
    text = COMPOSE.read_text()
    broken = tmp_path / "docker-compose.yml"
    broken.write_text(text.replace("shm_size:", "shm_sizes:").replace("capabilities: [gpu]", "capabilities: gpu"))
    result = run(tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", broken)
    assert result.returncode != 0
    assert "shm_sizes" in result.stdout and "capabilities" in result.stdout, result.stdout


def test_compose_runs_triton_on_a_gpu_with_the_repository_read_only_and_hot_reload() -> None:
    triton = compose()["services"]["triton"]
    (gpu,) = triton["deploy"]["resources"]["reservations"]["devices"]
    assert gpu["driver"] == "nvidia" and gpu["capabilities"] == ["gpu"]
    assert "./triton_repo:/models:ro" in triton["volumes"]
    args = triton["command"]
    assert args[:1] == ["tritonserver"]  # no script in front: nothing read from files onto the command line
    assert {"--model-repository=/models", "--model-control-mode=poll", "--allow-grpc=false"} <= set(args)
    assert set(triton["expose"]) == {"8000", "8002"}
    size = re.fullmatch(r"(\d+)(gb|mb)", triton["shm_size"])
    assert size and int(size.group(1)) * (1024 if size.group(2) == "gb" else 1) >= 256, triton["shm_size"]
    assert "/v2/health/ready" in " ".join(triton["healthcheck"]["test"])


def test_compose_shim_waits_for_a_healthy_triton_and_its_flag_switches_without_a_rebuild() -> None:
    services = compose()["services"]
    shim, env = services["shim"], shim_env()
    assert shim["build"]["context"] == "."
    assert env["SHIM_TRITON_URL"] == "triton:8000"
    assert "ports" not in shim and shim["expose"][0] == str(Settings().port)  # clients come through the proxy
    assert shim["depends_on"]["triton"]["condition"] == "service_healthy"
    # The mode comes from the environment, and the flag file lies on a named volume the image prepared.
    assert env["SHIM_MODE"].startswith("${SHIM_MODE")
    flag_dir = str(Path(env["SHIM_FLAG_FILE"]).parent)
    assert any(v.split(":")[0] in compose()["volumes"] and v.split(":")[1] == flag_dir for v in shim["volumes"])
    assert f"mkdir -p {flag_dir}" in (ROOT / "Dockerfile").read_text()
    # Torch in the compose image by default: legacy, shadow and canary need it.
    assert shim["build"]["args"]["WITH_LEGACY"].startswith("${SHIM_WITH_LEGACY:-1}")


def test_compose_passes_only_settings_the_shim_knows() -> None:
    unknown = set(shim_env()) - SETTINGS_VARS
    assert not unknown, f"not SHIM_* settings of app/settings.py: {sorted(unknown)}"


# --- Triton reachable by the shim alone, its admin APIs behind a key (issue 18) ----------------------------

RESTRICTED = {"model-repository", "shared-memory", "trace", "logging"}  # what no client of Triton may call


def test_compose_publishes_no_triton_port_and_only_the_shim_and_prometheus_share_its_network() -> None:
    services, networks = compose()["services"], compose()["networks"]
    triton = services["triton"]
    assert "ports" not in triton, "Triton's ports are published"
    assert triton["networks"] == ["inference"] and networks["inference"]["internal"] is True
    on_inference = {name for name, s in services.items() if "inference" in s.get("networks", [])}
    assert on_inference == {"triton", "shim", "prometheus"}, on_inference
    # Everything but the one-shots joins named networks only: no service lands on a shared default network.
    assert {name for name, s in services.items() if "networks" not in s} == {"model-export"}
    assert services["proxy"]["networks"] == ["edge"] and set(services["shim"]["networks"]) == {"edge", "inference"}
    published = {name for name, s in services.items() if s.get("ports")}
    assert published == {"proxy", "prometheus", "grafana"}, published


CLOSED_HEADER = "closed:api"  # a ':' ends a header's name: no HTTP request can carry this one


def closed_apis(args: list[str]) -> set[str]:
    """The APIs a Triton command line closes (restricted to CLOSED_HEADER); fails on any other restriction."""
    groups = restricted_groups(" ".join(args))
    assert not groups["grpc"] and "--allow-grpc=false" in args, "gRPC is served: the shim speaks HTTP only"
    assert {header for header, _ in groups["http"].values()} == {CLOSED_HEADER}, groups  # no key anywhere
    return set().union(*groups["http"])


def test_no_secret_is_on_tritons_command_line_in_compose_what_needed_a_key_is_closed_or_absent() -> None:
    """tritonserver takes restricted-API keys on its command line only, which every user of the host reads
    (`ps`, /proc/*/cmdline): compose gives it none. Poll mode (Triton refuses load/unload there), no gRPC,
    the model-repository, trace, logging and shared-memory APIs closed (the shim sends its tensors in the
    HTTP body)."""
    services = compose()["services"]
    for name in ("triton",):
        assert closed_apis(services[name]["command"]) == RESTRICTED
        assert "--model-control-mode=poll" in services[name]["command"]
    text = COMPOSE.read_text() + CPU_OVERRIDE.read_text() + CI_OVERRIDE.read_text()
    assert "triton-keys" not in text and "admin-key" not in text and "ADMIN_KEY" not in text
    assert not {k for k in shim_env() if "ADMIN_KEY" in k}  # the shim sends Triton no key either
    assert "group_add" not in services["triton"] and "ipc" not in services["shim"]  # nothing shared with the shim


def test_kubernetes_gives_triton_no_secret_and_closes_what_needed_one() -> None:
    triton = container(k8s_object("Deployment", "triton"))
    assert closed_apis(triton["args"]) == RESTRICTED  # no pod shares Triton's /dev/shm: shared memory closed too
    assert "--model-control-mode=poll" in triton["args"]
    assert not [e for e in triton.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})]
    assert "grpc" not in {p["name"] for p in triton["ports"]}
    assert not [o for o in k8s_objects() if o["kind"] == "Secret"], "a secret value is committed"


def test_the_deployment_docs_ask_for_no_triton_key() -> None:
    """docs/production.md names neither compose's key volume nor the Kubernetes Secret, both gone (it links
    docs/triton-admin.md, which says why)."""
    text = (ROOT / "docs" / "production.md").read_text().replace("(triton-admin.md)", "")
    assert "triton-keys" not in text and "triton-admin" not in text and "TRITON_ADMIN_KEY" not in text


def test_compose_profiles_and_mounted_files() -> None:
    services = compose()["services"]
    assert services["prometheus"]["profiles"] == ["monitoring"] and services["grafana"]["profiles"] == ["monitoring"]
    export = services["model-export"]
    assert export["profiles"] == ["export"] and export["build"]["args"]["WITH_LEGACY"] == "1"
    assert export["entrypoint"][0] == "shim-export"  # a console script of the installed project
    for name, service in services.items():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (ROOT / source).exists(), f"{name} mounts {source}, which is not in the repository"


def test_dockerfiles_pass_hadolint() -> None:
    result = run(tool("hadolint"), *DOCKERFILES)
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr


def test_hadolint_rejects_a_root_image_with_unpinned_packages(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nUSER root\nRUN pip install flask\n")
    result = run(tool("hadolint"), bad)
    assert result.returncode != 0
    assert {"DL3007", "DL3002", "DL3013"} <= set(re.findall(r"DL\d{4}", result.stdout)), result.stdout


def test_the_shim_image_copies_sources_that_exist_and_that_dockerignore_lets_through() -> None:
    ignored = [p for p in (ROOT / ".dockerignore").read_text().splitlines() if p and not p.startswith("#")]
    assert {".venv", ".cache", "triton_repo/*/[0-9]*/model.pt"} <= set(ignored)
    copies = [args.split() for op, args in dockerfile_instructions(ROOT / "Dockerfile") if op == "COPY"]
    sources = [src for words in copies if not words[0].startswith("--from") for src in words[:-1]]
    assert "app" in sources
    for src in sources:
        assert (ROOT / src).exists(), src
        assert not any(fnmatch.fnmatch(src, pattern) for pattern in ignored), f"{src} is excluded by .dockerignore"


def test_the_shim_image_runs_gunicorn_as_non_root_with_a_healthcheck() -> None:
    steps = dockerfile_instructions(ROOT / "Dockerfile")
    last = {op: args for op, args in steps}  # the runtime stage's, as the image keeps them
    assert last["USER"].split(":")[0] not in {"0", "root"}
    assert last["ENTRYPOINT"] == '["shim-serve"]'
    assert "/healthz" in last["HEALTHCHECK"] and "curl" not in last["HEALTHCHECK"]
    assert ("ARG", "WITH_LEGACY=0") in steps  # the slim image is the default


def test_the_exported_model_loads_in_the_triton_images_libtorch(test_model_pt: Path) -> None:
    """PyTorch since 2022 reads TorchScript file format versions 1-10 (kMaxSupportedFileFormatVersion = 0xA
    in caffe2/serialize/versions.h); a newer torch in the export image must not write a newer one."""
    with zipfile.ZipFile(test_model_pt) as archive:
        (record,) = [n for n in archive.namelist() if n.endswith("/version") and n.count("/") == 1]
        version = int(archive.read(record))
    assert 1 <= version <= 0xA, version


@pytest.mark.parametrize("k8s_version", K8S_VERSIONS)
def test_k8s_manifests_validate_against_the_kubernetes_schemas(k8s_version: str) -> None:
    result = run(tool("kubernetes-validate"), "--strict", "-k", k8s_version, *k8s_manifests())
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("passed") == len(k8s_objects())


def test_the_kubernetes_check_rejects_a_misspelt_probe(tmp_path: Path) -> None:
    broken = tmp_path / "shim.yaml"
    broken.write_text((K8S / "shim.yaml").read_text().replace("readinessProbe:", "readinesProbe:"))
    result = run(tool("kubernetes-validate"), "--strict", broken)
    assert result.returncode != 0 and "readinesProbe" in result.stdout, result.stdout


def test_kustomization_lists_every_manifest_of_the_namespace() -> None:
    (kustomization,) = yaml_docs(K8S / "kustomization.yaml")
    top_level = {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == top_level | {"../nginx"}  # the proxy's generated ConfigMap
    images = {i["name"] for i in kustomization["images"]}
    used = {c["image"].split(":")[0] for o in k8s_objects() if o["kind"] == "Deployment" for c in containers(o)}
    assert used == images


def test_services_select_their_pods_and_the_shim_finds_triton() -> None:
    for name in ("shim", "triton"):
        service, deployment = k8s_object("Service", name), k8s_object("Deployment", name)
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= labels.items()
        names = {p["name"] for c in containers(deployment) for p in c["ports"]}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= names
    env = {e["name"]: e.get("value") for e in container(k8s_object("Deployment", "shim"))["env"]}
    assert set(env) <= SETTINGS_VARS, set(env) - SETTINGS_VARS
    host, port = env["SHIM_TRITON_URL"].split(":")
    assert host == "triton" and int(port) in {p["port"] for p in k8s_object("Service", "triton")["spec"]["ports"]}


def test_hpas_scale_on_metrics_that_prometheus_adapter_serves() -> None:
    served = {rule["name"]["as"]: rule for rule in adapter_rules()}
    for rule in served.values():
        parse_selectors(adapter_query(rule))  # the query the adapter will send parses
    triton = k8s_object("HorizontalPodAutoscaler", "triton")["spec"]
    assert (triton["minReplicas"], triton["maxReplicas"]) == (2, 10)
    assert triton["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "triton"}
    (gpu,) = triton["metrics"]
    assert gpu["type"] == "Pods" and gpu["pods"]["target"] == {"type": "AverageValue", "averageValue": "70"}
    rule = served[gpu["pods"]["metric"]["name"]]
    assert series_name(rule["seriesQuery"]) == "nv_gpu_utilization" and "* 100" in rule["metricsQuery"]
    shim = k8s_object("HorizontalPodAutoscaler", "shim")["spec"]
    assert shim["scaleTargetRef"]["name"] == "shim"
    pods = [m["pods"]["metric"]["name"] for m in shim["metrics"] if m["type"] == "Pods"]
    assert pods and all(series_name(served[name]["seriesQuery"]).startswith("shim_") for name in pods)
    for hpa in (triton, shim):  # the seed's mistake: the resource metrics API serves only cpu and memory
        for metric in hpa["metrics"]:
            assert metric["type"] != "Resource" or metric["resource"]["name"] in {"cpu", "memory"}


def workloads() -> list[dict[str, Any]]:
    return [o for o in k8s_objects() if o["kind"] == "Deployment"]


def selects(selector: dict[str, Any], deployment: dict[str, Any]) -> bool:
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    return bool(selector.get("matchLabels")) and selector["matchLabels"].items() <= labels.items()


def test_no_replicas_where_an_hpa_owns_the_count() -> None:
    """A `replicas` on a Deployment that an HPA scales resets the fleet to it on every `kubectl apply -k`."""
    scaled = {o["spec"]["scaleTargetRef"]["name"] for o in k8s_objects() if o["kind"] == "HorizontalPodAutoscaler"}
    assert scaled == {d["metadata"]["name"] for d in workloads()}
    for deployment in workloads():
        assert "replicas" not in deployment["spec"], f"{deployment['metadata']['name']} sets replicas"
    for name in ("triton", "shim"):
        text = (K8S / f"{name}.yaml").read_text()
        assert "replicas:" not in text.replace("minReplicas", "").replace("# No `replicas`", ""), name
        assert "No `replicas`: the HPA owns the count" in text


def test_every_workload_has_a_disruption_budget_and_spreads_over_nodes_and_zones() -> None:
    budgets = [o for o in k8s_objects() if o["kind"] == "PodDisruptionBudget"]
    for deployment in workloads():
        name = deployment["metadata"]["name"]
        (budget,) = [b for b in budgets if selects(b["spec"]["selector"], deployment)]
        assert budget["spec"]["maxUnavailable"] == 1 and "minAvailable" not in budget["spec"], name
        hpa = k8s_object("HorizontalPodAutoscaler", name)
        assert hpa["spec"]["minReplicas"] >= 2, "a budget of one unavailable pod needs two pods at least"
        spread = deployment["spec"]["template"]["spec"]["topologySpreadConstraints"]
        assert {c["topologyKey"] for c in spread} == {"kubernetes.io/hostname", "topology.kubernetes.io/zone"}
        for constraint in spread:
            assert constraint["maxSkew"] == 1 and selects(constraint["labelSelector"], deployment), (name, constraint)
            assert constraint["matchLabelKeys"] == ["pod-template-hash"]  # each rollout's pods spread too
    assert len(budgets) == len(workloads())


def test_network_policies_admit_triton_from_shim_pods_and_prometheus_only() -> None:
    policies = [o for o in k8s_objects() if o["kind"] == "NetworkPolicy"]
    prometheus = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}},
                  "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}
    by_name = {}
    for deployment in workloads():
        (policy,) = [p for p in policies if selects(p["spec"]["podSelector"], deployment)]
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        ports = {port["name"] for c in containers(deployment) for port in c["ports"]}
        for rule in policy["spec"]["ingress"]:
            assert {port["port"] for port in rule["ports"]} <= ports  # named ports of the pod
        by_name[deployment["metadata"]["name"]] = [
            ([{**peer} for peer in rule.get("from", [])], sorted(port["port"] for port in rule["ports"]))
            for rule in policy["spec"]["ingress"]]
    shim_pods = {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "shim"}}}
    assert by_name["triton"] == [([shim_pods], ["http"]), ([prometheus], ["metrics"])]
    # The shim: its clients at nginx from anywhere; gunicorn's own port to Prometheus alone.
    assert by_name["shim"] == [([], ["http"]), ([prometheus], ["app"])]
    assert len(policies) == len(workloads())


def graceful_timeout() -> int:
    match = re.search(r"^graceful_timeout = (\d+)", (ROOT / "app" / "gunicorn_conf.py").read_text(), re.M)
    assert match
    return int(match.group(1))


def duration(value: str) -> float:
    match = re.fullmatch(r"(\d+)(s|m)", value)
    assert match, value
    return int(match.group(1)) * (60 if match.group(2) == "m" else 1)


def test_a_stop_waits_longer_than_gunicorn_and_nginx_finish_their_requests() -> None:
    """Docker's default of 10 s, and Kubernetes' 30 s less preStop's sleep, must not SIGKILL gunicorn in its
    graceful_timeout or nginx in its worker_shutdown_timeout: the requests in flight would fail."""
    nginx_s = seconds(nginx_directive("worker_shutdown_timeout"))
    services = compose()["services"]
    assert duration(services["shim"]["stop_grace_period"]) >= graceful_timeout() + 5
    assert duration(services["proxy"]["stop_grace_period"]) >= nginx_s + 5
    assert nginx_s > graceful_timeout()  # nginx outlives gunicorn's graceful stop: the answers reach clients
    pod = k8s_object("Deployment", "shim")["spec"]["template"]["spec"]
    pre_stop = max(int(c["lifecycle"]["preStop"]["exec"]["command"][1]) for c in pod["containers"])
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + max(graceful_timeout(), nginx_s) + 5
    triton_args = container(k8s_object("Deployment", "triton"))["args"]
    exit_s = int(next(a for a in triton_args if a.startswith("--exit-timeout-secs=")).split("=")[1])
    assert k8s_object("Deployment", "triton")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > exit_s
    assert duration(services["triton"]["stop_grace_period"]) > 30  # tritonserver's default --exit-timeout-secs


def production_section(title: str) -> str:
    """A section of docs/production.md, where the deployments' commands are written for users to type."""
    text = (ROOT / "docs" / "production.md").read_text()
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"docs/production.md has no section {title!r}"
    return match.group(1)


def commands(section: str) -> list[list[str]]:
    """The shell commands of a docs section's bash blocks, split at && and without VAR=value prefixes."""
    blocks = "\n".join(re.findall(r"```bash\n(.*?)```", section, re.S))
    lines = re.sub(r"\\\n\s*", " ", re.sub(r"\$\([^)]*\)", "SUBST", blocks)).splitlines()
    found = []
    for part in (p for line in lines for p in line.split(" #")[0].split("&&")):
        words = shlex.split(part)
        while words and re.match(r"^[A-Z_]+=", words[0]):
            words.pop(0)
        if words:
            found.append(words)
    return found


def compose_call(cmd: list[str]) -> tuple[list[str], str, list[str]]:
    """`docker compose [-f FILE]... [--profile P]... SUB [options] ARGS`: the profiles, SUB and the positional ARGS."""
    args, profiles = cmd[2:], []
    while args[0].startswith("-"):
        if args[0] == "--profile":
            profiles.append(args[1])
        if args[0] in {"--profile", "-f", "--file"}:
            args = args[1:]
        args = args[1:]
    positionals, skip = [], False
    for arg in args[1:]:
        if skip or arg in {"--user", "-u", "-v", "--volume", "-e", "--env"}:
            skip = not skip
            continue
        if not arg.startswith("-"):
            positionals.append(arg)
    return profiles, args[0], positionals


def test_documented_compose_commands_name_services_profiles_and_files_that_exist() -> None:
    section = production_section("Deploy with docker compose on a GPU host")
    services, env = compose()["services"], shim_env()
    profiles = {p for s in services.values() for p in s.get("profiles", [])}
    calls = [compose_call(c) for c in commands(section) if c[:2] == ["docker", "compose"]]
    assert {sub for _, sub, _ in calls} >= {"run", "up", "exec"}
    for used_profiles, sub, positionals in calls:
        assert set(used_profiles) <= profiles, used_profiles
        if sub in {"run", "exec"}:
            assert positionals[0] in services, (sub, positionals)
        if sub == "up":
            assert set(positionals) <= set(services), positionals
        if sub == "exec" and positionals[0] == "shim":  # the traffic command, or removing the flag file in use
            assert positionals[1] == "shim-traffic" or env["SHIM_FLAG_FILE"] in positionals, positionals
    assert "model-export" in {p[0] for _, sub, p in calls if sub == "run"}
    files = {c[i + 1] for c in commands(section) if c[:2] == ["docker", "compose"]
             for i, arg in enumerate(c[:-1]) if arg in {"-f", "--file"}}
    assert "docker-compose.cpu.yml" in files  # the CPU override is documented
    for name in files:
        assert (ROOT / name).is_file(), name
    for var in re.findall(r"\bSHIM_[A-Z_]+\b", section):
        assert var in SETTINGS_VARS | {"SHIM_WITH_LEGACY", "SHIM_MODEL_WEIGHTS"}, var
    assert {"SHIM_MODE", "SHIM_FLAG_FILE"} <= set(env)


def test_documented_kubernetes_commands_apply_files_that_exist() -> None:
    cmds = commands(production_section("Scale out on Kubernetes"))
    applied = [cmd[cmd.index(flag) + 1] for cmd in cmds if cmd[:1] == ["kubectl"]
               for flag in ("-f", "-k") if flag in cmd]
    assert "deploy/k8s" in applied and "deploy/k8s/prometheus-adapter/rules.yaml" in applied
    for path in applied:
        assert path == "-" or (ROOT / path).exists(), path  # "-": a manifest piped in
    built = [cmd[cmd.index("-f") + 1] for cmd in cmds if cmd[:2] == ["docker", "build"] and "-f" in cmd]
    assert built == ["docker/triton.Dockerfile"]
    (helm,) = [cmd for cmd in cmds if cmd[:2] == ["helm", "install"]]
    existing = next(a.split("=", 1)[1] for a in helm if a.startswith("rules.existing="))
    (configmap,) = yaml_docs(K8S / "prometheus-adapter" / "rules.yaml")
    assert existing == configmap["metadata"]["name"] and "monitoring" in helm
    assert configmap["metadata"]["namespace"] == "monitoring"
    served = {rule["name"]["as"] for rule in adapter_rules()}
    checked = [c for c in cmds if c[:3] == ["kubectl", "get", "--raw"]]
    assert checked and all(c[3].rsplit("/", 1)[1] in served for c in checked)


def test_every_shim_pod_watches_the_fleet_traffic_configmap() -> None:
    (configmap,) = yaml_docs(K8S / "traffic.yaml")
    from app.settings import Mode
    from app.traffic import TrafficState

    flag = json.loads(configmap["data"]["traffic.json"])
    TrafficState(mode=Mode.LEGACY).with_changes(flag, updated_by="test")  # parses as the shim parses it
    shim = next(d for d in yaml_docs(K8S / "shim.yaml") if d["kind"] == "Deployment")
    pod = shim["spec"]["template"]["spec"]
    (container,) = [c for c in pod["containers"] if c["name"] == "shim"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    (volume,) = [v for v in pod["volumes"] if v.get("configMap", {}).get("name") == configmap["metadata"]["name"]]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
    assert env["SHIM_FLAG_FILE"] == f"{mount['mountPath']}/traffic.json" and mount["readOnly"]
    section = production_section("Scale out on Kubernetes")
    assert f"create configmap {configmap['metadata']['name']}" in section


# --- the CPU override, the compose CI override and the images `make compose-test` builds -----------------

CPU_OVERRIDE = ROOT / "docker-compose.cpu.yml"
CI_OVERRIDE = ROOT / "tests" / "compose" / "ci.yml"
CI_DOCKERFILES = sorted((ROOT / "docker").glob("*.Dockerfile"))
RESET = object()  # compose's `!reset` tag: the key is removed from the merged file


class ComposeOverrideLoader(yaml.SafeLoader):
    """YAML with compose's `!reset` tag (Compose 2.24+), which check-jsonschema cannot read."""


ComposeOverrideLoader.add_constructor("!reset", lambda loader, node: RESET)


def compose_override(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = yaml.load(path.read_text(), Loader=ComposeOverrideLoader)  # a SafeLoader
    return data


def merge_compose(base: Any, override: Any, key: str = "") -> Any:
    """Compose's merge, for what the overrides here use: mappings merge key by key, `!reset` removes a key,
    volumes merge by their target path, anything else (commands, scalars) is replaced."""
    if isinstance(base, dict) and isinstance(override, dict):
        merged = dict(base)
        for k, value in override.items():
            if value is RESET:
                merged.pop(k, None)
            else:
                merged[k] = merge_compose(base[k], value, k) if k in base else value
        return merged
    if key == "volumes" and isinstance(base, list) and isinstance(override, list):
        by_target = {v.split(":")[1]: v for v in base} | {v.split(":")[1]: v for v in override}
        return list(by_target.values())
    return override


def merged_with(override: Path) -> dict[str, Any]:
    merged: dict[str, Any] = merge_compose(compose(), compose_override(override))
    return merged


def gpu_models() -> list[str]:
    from tritonclient.grpc import model_config_pb2 as mc

    from devstack.cpu_repo import model_dirs, read_config

    return sorted(name for name, folder in model_dirs(ROOT / "triton_repo").items()
                  if any(g.kind == mc.ModelInstanceGroup.KIND_GPU for g in read_config(folder / "config.pbtxt")
                         .instance_group))


def test_the_models_that_ask_for_a_gpu_are_the_ones_with_a_cpu_config() -> None:
    with_cpu_config = sorted(p.parent.parent.name for p in (ROOT / "triton_repo").glob("*/configs/cpu.pbtxt"))
    assert "resnet50" in gpu_models()
    assert with_cpu_config == gpu_models()


@pytest.mark.parametrize("model", gpu_models())
def test_a_cpu_config_is_the_default_config_with_cpu_instances(model: str) -> None:
    from tritonclient.grpc import model_config_pb2 as mc

    from devstack.cpu_repo import read_config

    default = read_config(ROOT / "triton_repo" / model / "config.pbtxt")
    cpu = read_config(ROOT / "triton_repo" / model / "configs" / "cpu.pbtxt")
    assert not any(g.kind == mc.ModelInstanceGroup.KIND_GPU for g in cpu.instance_group)
    expected = mc.ModelConfig()
    expected.CopyFrom(default)
    for group in expected.instance_group:
        if group.kind == mc.ModelInstanceGroup.KIND_GPU:
            group.kind = mc.ModelInstanceGroup.KIND_CPU
            del group.gpus[:]
    assert cpu == expected, f"configs/cpu.pbtxt of {model} differs from its config.pbtxt in more than the kind"


def validate_compose(data: dict[str, Any], tmp_path: Path) -> None:
    path = tmp_path / "merged.json"
    path.write_text(json.dumps(data))
    result = run(tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", path)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_cpu_override_runs_the_same_triton_without_a_gpu(tmp_path: Path) -> None:
    base, merged = compose()["services"], merged_with(CPU_OVERRIDE)
    validate_compose(merged, tmp_path)
    triton = merged["services"]["triton"]
    assert not triton["deploy"]["resources"]["reservations"].get("devices")
    assert triton["command"] == [*base["triton"]["command"], "--model-config-name=cpu"]
    assert triton["image"] == base["triton"]["image"] and triton["build"] == base["triton"]["build"]
    assert {k: v for k, v in triton.items() if k not in {"command", "deploy"}} == \
        {k: v for k, v in base["triton"].items() if k not in {"command", "deploy"}}
    assert {k: v for k, v in merged["services"].items() if k != "triton"} == \
        {k: v for k, v in base.items() if k != "triton"}


def test_the_merged_check_rejects_a_misspelt_override(tmp_path: Path) -> None:
    broken = tmp_path / "docker-compose.cpu.yml"
    broken.write_text(CPU_OVERRIDE.read_text().replace("    command:", "    comand:"))
    path = tmp_path / "merged.json"
    path.write_text(json.dumps(merged_with(broken)))
    result = run(tool("check-jsonschema"), "--builtin-schema", "vendor.compose-spec", path)
    assert result.returncode != 0 and "comand" in result.stdout, result.stdout


def test_the_ci_override_swaps_only_images_the_gpu_and_the_model_repository(tmp_path: Path) -> None:
    """tests/compose/ci.yml (make compose-test) changes what CI cannot have and nothing users rely on:
    ports, healthchecks, depends_on, environment and the shim's command come from docker-compose.yml."""
    override, merged = compose_override(CI_OVERRIDE)["services"], merged_with(CI_OVERRIDE)
    validate_compose(merged, tmp_path)
    allowed = {"triton": {"build", "image", "command", "volumes", "deploy", "ulimits"},
               "shim": {"build", "image", "volumes"}, "prometheus": {"build", "image"}}
    for name, service in override.items():
        assert set(service) <= allowed.get(name, {"build", "image"}), (name, set(service))
        assert service["image"].startswith("flask-triton-shim-ci/"), "CI images never take the product's names"
        for volume in service.get("volumes", []):
            assert volume.split(":")[1:] == ["/models", "ro"], volume
    base = compose()["services"]
    for name, service in merged["services"].items():
        for key in ("ports", "expose", "networks", "healthcheck", "depends_on", "environment", "entrypoint",
                    "restart", "shm_size", "group_add", "stop_grace_period"):
            assert service.get(key) == base[name].get(key), (name, key)
    triton = merged["services"]["triton"]
    assert not triton["deploy"]["resources"]["reservations"].get("devices")
    assert [v for v in triton["volumes"] if v.endswith(":/models:ro")] == ["./.cache/compose/standin-repo:/models:ro"]
    assert [v for v in triton["volumes"] if not v.endswith(":/models:ro")] == \
        [v for v in base["triton"]["volumes"] if not v.endswith(":/models:ro")]


def test_the_ci_triton_command_is_what_app_embedded_triton_accepts() -> None:
    """devstack in front of the wheel's tritonserver, in poll mode as docker-compose.yml's, with every other
    option of docker-compose.yml's command after `--` (passed on to tritonserver)."""
    from devstack.__main__ import parse_args

    command = compose_override(CI_OVERRIDE)["services"]["triton"]["command"]
    assert command[:3] == ["python", "-m", "devstack"]
    config = parse_args(command[3:])
    assert config.host == "0.0.0.0" and str(config.model_repository) == "/models"
    assert config.model_control_mode == "poll"  # devstack adds its own --repository-poll-secs
    own = {"tritonserver", "--model-repository=/models", "--model-control-mode=poll", "--repository-poll-secs=15"}
    assert config.extra_args == tuple(a for a in compose()["services"]["triton"]["command"] if a not in own)
    exposed = {int(p) for p in compose()["services"]["triton"]["expose"]}
    assert {config.http_port, config.metrics_port} == exposed


def docker_compose_v2() -> bool:
    if shutil.which("docker") is None:
        return False
    result = subprocess.run(["docker", "compose", "version", "--short"], capture_output=True, text=True, check=False)
    match = re.match(r"v?(\d+)\.(\d+)", result.stdout.strip())
    return result.returncode == 0 and bool(match) and (int(match[1]), int(match[2])) >= (2, 24)


@pytest.mark.skipif(not docker_compose_v2(), reason="needs the docker CLI with Compose 2.24+ (no engine)")
@pytest.mark.parametrize("override", [CPU_OVERRIDE, CI_OVERRIDE], ids=["cpu", "ci"])
def test_docker_compose_merges_each_override_as_these_tests_do(override: Path, tmp_path: Path) -> None:
    result = run("docker", "compose", "--env-file", "/dev/null", "-f", COMPOSE, "-f", override,
                 "--profile", "monitoring", "config", "--format", "json")
    assert result.returncode == 0, result.stderr
    merged = json.loads(result.stdout)
    validate_compose(merged, tmp_path)
    triton = merged["services"]["triton"]
    assert not triton.get("deploy", {}).get("resources", {}).get("reservations", {}).get("devices")
    assert triton["command"] == merged_with(override)["services"]["triton"]["command"]


def test_the_ci_dockerfiles_pass_hadolint() -> None:
    assert CI_DOCKERFILES
    result = run(tool("hadolint"), *CI_DOCKERFILES)
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr


def test_the_compose_and_hostile_suites_stay_out_of_make_test() -> None:
    """`make test` runs `pytest` on tests/ with no docker and no attack: tests/compose/, tests/k8s/ and
    tests/hostile/ are collected only under COMPOSE_STACK=1, K8S_PODS=1 and HOSTILE_STACK=1 (make compose-test,
    make k8s-test, make hostile-test)."""
    env = {k: v for k, v in os.environ.items() if k not in ("COMPOSE_STACK", "K8S_PODS", "HOSTILE_STACK")}
    # Without the schemathesis and hypothesis plugins: those folders use neither, and they take seconds to import.
    result = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:schemathesis", "-p", "no:hypothesispytest",
                             "--collect-only", "-q", "tests/compose", "tests/k8s", "tests/hostile"],
                            cwd=ROOT, env=env, capture_output=True, text=True, check=False, timeout=120)
    assert "test_" not in result.stdout, result.stdout
    assert result.returncode in {0, 5}, result.stdout + result.stderr  # 5: nothing collected


# --- the proxy in front of gunicorn: deploy/nginx, used by docker compose, Kubernetes and the tests ----------

NGINX_TEMPLATE = proxy.TEMPLATE


def nginx_directive(name: str, location: str = "") -> str:
    """A directive's value in the template: in `location` when given, else the first at any level above it."""
    text = NGINX_TEMPLATE.read_text()
    if location:
        text = location_block(text, location)
    match = re.search(rf"^\s*{re.escape(name)}\s+([^;]+);", text, re.M)
    assert match, f"{name} is not set{f' in location {location}' if location else ''}"
    return match.group(1).strip()


def location_block(text: str, location: str) -> str:
    """From `location <location> {` to its closing brace (alone on its line: ${VARIABLES} hold braces too)."""
    start = text.index(f"location {location} {{")
    return text[start:re.compile(r"^\s*\}\s*$", re.M).search(text, start).end()]  # type: ignore[union-attr]


def seconds(value: str) -> float:
    match = re.fullmatch(r"(\d+)(ms|s|m)", value)
    assert match, value
    return int(match.group(1)) * {"ms": 0.001, "s": 1, "m": 60}[match.group(2)]


def compose_default(value: str) -> str:
    """`${VAR:-default}` as compose interpolates it when VAR is unset."""
    match = re.fullmatch(r"\$\{\w+:-([^}]*)\}", value)
    return match.group(1) if match else value


def compose_proxy_values() -> dict[str, str]:
    env = compose()["services"]["proxy"]["environment"]
    return {k: compose_default(str(v)) for k, v in env.items() if k.startswith("PROXY_")}


def k8s_proxy() -> dict[str, Any]:
    return container(k8s_object("Deployment", "shim"), "proxy")


ENVSH = proxy.ENTRYPOINT_SCRIPT
ENVSH_MOUNT = "/docker-entrypoint.d/19-trusted-proxies.envsh"  # before the image's 20-envsubst-on-templates.sh


def server_block(which: str) -> str:
    """The template's edge server (clients connect there) or admission server (the inference budget)."""
    text = NGINX_TEMPLATE.read_text()
    starts = [m.start() for m in re.finditer(r"^    server \{$", text, re.M)]
    assert len(starts) == 2, "the template has an edge and an admission server"
    edge, admission = text[starts[0]:starts[1]], text[starts[1]:]
    assert "listen ${PROXY_PORT}" in edge and "listen unix:${PROXY_ADMISSION_SOCKET}" in admission
    return edge if which == "edge" else admission


def directive_in(block: str, name: str, location: str = "") -> str:
    text = location_block(block, location) if location else block
    match = re.search(rf"^\s*{re.escape(name)}\s+([^;]+);", text, re.M)
    assert match, f"{name} is not set{f' in location {location}' if location else ''}"
    return match.group(1).strip()


def test_the_proxy_template_uses_exactly_the_variables_each_deployment_sets() -> None:
    used = proxy.template_variables(NGINX_TEMPLATE.read_text())
    assert used == set(proxy.VARIABLES)
    # PROXY_REAL_IP_FROM is the entrypoint script's, made from PROXY_TRUSTED_ADDRESSES, which each deployment sets.
    given = used - {"PROXY_REAL_IP_FROM"} | set(proxy.INPUTS)
    assert set(compose_proxy_values()) == given
    assert {k for k in env_of(k8s_proxy()) if k.startswith("PROXY_")} == given
    assert "PROXY_REAL_IP_FROM" in ENVSH.read_text() and os.access(ENVSH, os.X_OK)  # sourced only if executable
    # The official image's entrypoint sources the script, then renders the template with only these names
    # replaced (nginx's own $variables are lower case and untouched), into the folder -c and -p point at.
    pod_volumes = {v["name"]: v for v in k8s_object("Deployment", "shim")["spec"]["template"]["spec"]["volumes"]}
    for env, cmd, mounts in [
        (compose()["services"]["proxy"]["environment"], compose()["services"]["proxy"]["command"],
         {v.split(":")[1]: v.split(":")[0] for v in compose()["services"]["proxy"]["volumes"]}),
        (env_of(k8s_proxy()), k8s_proxy()["args"],
         {m["mountPath"] + ("" if "subPath" in m else f"/{NGINX_TEMPLATE.name}"):
          m.get("subPath", NGINX_TEMPLATE.name) for m in k8s_proxy()["volumeMounts"]}),
    ]:
        assert env["NGINX_ENVSUBST_FILTER"] == "^PROXY_"
        helper = proxy.command(Path("nginx"), Path(env["NGINX_ENVSUBST_OUTPUT_DIR"]))  # what the tests start
        assert cmd[:-1] == helper[:-1] and cmd[-1] == "daemon off;" and helper[-1].startswith(cmd[-1]), (cmd, helper)
        assert Path(mounts[f"{env['NGINX_ENVSUBST_TEMPLATE_DIR']}/{NGINX_TEMPLATE.name}"]).name == NGINX_TEMPLATE.name
        assert Path(mounts[ENVSH_MOUNT]).name == ENVSH.name
        # The admission socket lies in nginx's own writable folder, never shared with another container.
        assert Path(env["PROXY_ADMISSION_SOCKET"]).parent == Path(env["NGINX_ENVSUBST_OUTPUT_DIR"])
    assert pod_volumes["proxy-template"]["configMap"]["defaultMode"] == 0o555


def test_the_trusted_proxies_script_writes_one_set_real_ip_from_each_and_refuses_junk() -> None:
    values = {"PROXY_TRUSTED_ADDRESSES": "10.0.0.0/8, fd00::/8 192.0.2.7"}
    assert proxy.entrypoint(values)["PROXY_REAL_IP_FROM"] == \
        "set_real_ip_from 10.0.0.0/8; set_real_ip_from fd00::/8; set_real_ip_from 192.0.2.7; "
    assert proxy.entrypoint({"PROXY_TRUSTED_ADDRESSES": ""})["PROXY_REAL_IP_FROM"] == ""
    with pytest.raises(ValueError, match=re.escape("'10.0.0.0/8;include' is not an address")):
        proxy.entrypoint({"PROXY_TRUSTED_ADDRESSES": "10.0.0.0/8;include"})
    assert compose_proxy_values()["PROXY_TRUSTED_ADDRESSES"] == "" == env_of(k8s_proxy())["PROXY_TRUSTED_ADDRESSES"]


def test_the_trusted_proxies_script_removes_a_stale_admission_socket(tmp_path: Path) -> None:
    import socket

    stale = tmp_path / "admission.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(str(stale))  # what an nginx killed before its shutdown leaves
    proxy.entrypoint({"PROXY_ADMISSION_SOCKET": str(stale)})
    assert not stale.exists()


def deployed_proxy_values(where: str) -> dict[str, str]:
    return compose_proxy_values() if where == "compose" else {k: v for k, v in env_of(k8s_proxy()).items()
                                                             if k.startswith("PROXY_")}


@pytest.mark.parametrize("trusted", ["", "10.0.0.0/8 fd00::/8"], ids=["no-trusted-proxy", "trusted-proxies"])
@pytest.mark.parametrize("where", ["compose", "kubernetes"])
def test_the_rendered_proxy_configuration_passes_nginx_t(where: str, trusted: str) -> None:
    nginx_or_skip()
    values = {**deployed_proxy_values(where), "PROXY_TRUSTED_ADDRESSES": trusted}
    # nginx resolves the upstream's and the log's host when it starts: compose's service name is not resolvable here.
    for name in ("PROXY_UPSTREAM", "PROXY_LOG_ADDRESS"):
        values[name] = "127.0.0.1:" + values[name].rsplit(":", 1)[1]
    values["PROXY_PORT"] = f"127.0.0.1:{free_port()}"
    result = proxy.check(proxy.entrypoint(values))
    assert result.returncode == 0, result.stderr


def test_nginx_t_rejects_a_misspelt_directive(tmp_path: Path) -> None:
    nginx_or_skip()
    broken = tmp_path / NGINX_TEMPLATE.name
    broken.write_text(NGINX_TEMPLATE.read_text().replace("client_body_timeout", "client_body_timeuot"))
    result = proxy.check(proxy.values_for("127.0.0.1:5000", free_port(), prefix=tmp_path), broken)
    assert result.returncode != 0 and "client_body_timeuot" in result.stderr, result.stderr


def shim_settings(where: str) -> Settings:
    """The shim's settings as each deployment sets them (compose: its defaults when the shell sets nothing)."""
    env = ({k: compose_default(v) for k, v in shim_env().items() if v not in ("", "None")} if where == "compose"
           else env_of(container(k8s_object("Deployment", "shim"))))
    # The key file is a secret mounted at run time, read when the settings are made: not on this machine.
    return Settings.from_env({k: v for k, v in env.items() if k != "SHIM_TRITON_ADMIN_KEY_FILE"})


@pytest.mark.parametrize("where", ["compose", "kubernetes"])
def test_the_proxy_and_the_shim_agree_on_their_limits_wherever_both_are_set(where: str) -> None:
    """PROXY_MAX_BODY_MB = SHIM_MAX_UPLOAD_MB, PROXY_MAX_INFLIGHT <= SHIM_MAX_PENDING, the access log's port
    (docs/proxy.md), as devstack/proxy.py checks them for the tests."""
    settings, values = shim_settings(where), deployed_proxy_values(where)
    proxy.check_limits(values, settings)
    assert settings.proxy_log_address  # behind nginx, nginx's answers are counted
    if where == "compose":  # one knob each: the shell's value reaches both sides
        env, front = shim_env(), compose()["services"]["proxy"]["environment"]
        assert front["PROXY_MAX_BODY_MB"] == env["SHIM_MAX_UPLOAD_MB"] == "${SHIM_MAX_UPLOAD_MB:-16}"
        assert front["PROXY_MAX_INFLIGHT"] == env["SHIM_MAX_PENDING"] == "${SHIM_MAX_PENDING:-64}"
        assert int(compose_default(env["SHIM_MAX_PENDING"])) == Settings().max_pending
        assert int(compose_default(env["SHIM_MAX_UPLOAD_MB"])) == Settings().max_upload_mb


def mebibytes(quantity: str) -> float:
    match = re.fullmatch(r"(\d+)(Mi|Gi)", quantity)
    assert match, quantity
    return int(match.group(1)) * (1024 if match.group(2) == "Gi" else 1)


CONNECTION_KIB = 16  # nginx's own per connection besides its buffers: about 10 KiB (make hostile-test)


def kib(size: str) -> int:
    match = re.fullmatch(r"(\d+)([km]?)", size)
    assert match, size
    return int(match.group(1)) * {"": 1 / 1024, "k": 1, "m": 1024}[match.group(2)]  # type: ignore[return-value]


def test_the_proxys_memory_limit_holds_every_connection_with_its_header_buffers_and_the_bodies() -> None:
    """What hostile clients can make nginx hold, from its configuration: every connection (worker_processes x
    worker_connections) with all its large header buffers (kept for the request's life), the /predict bodies
    the edge admits (shim_edge_predict) with their body buffer filled, and nginx's own 32 MiB: under the
    proxy container's memory limit. make hostile-test (test_e_every_route.py) measures it at the limit."""
    workers = int(nginx_directive("worker_processes"))
    connections = int(nginx_directive("worker_connections"))
    count, size = nginx_directive("large_client_header_buffers").split()
    header_kib = int(count) * kib(size)
    edge = server_block("edge")
    buffer_kib = kib(directive_in(edge, "client_body_buffer_size"))
    bodies = int(re.search(r"limit_conn shim_edge_predict (\d+);", location_block(edge, "= /predict")).group(1))  # type: ignore[union-attr]
    worst_mib = (workers * connections * (header_kib + CONNECTION_KIB) + bodies * buffer_kib) / 1024 + 32
    limit = mebibytes(k8s_proxy()["resources"]["limits"]["memory"])
    assert worst_mib <= limit, f"{worst_mib:.0f} MiB of slow uploads over the proxy's limit of {limit:.0f} MiB"
    assert limit <= 2 * worst_mib, "the limit is far above what nginx can hold: derive it again"


# `python -m bench --memory` (bench/RESULTS.md): the shim container's memory under the worst input the limits
# accept behind nginx (master and counter + one worker at its peak + the other ready), and ready, in MiB.
POD_MEMORY_WORST_MIB = {"triton": 69 + 518 + 54, "legacy": 69 + 1136 + 693}
POD_MEMORY_READY_MIB = {"triton": 69 + 2 * 54, "legacy": 69 + 2 * 693}


def test_the_shims_memory_is_derived_from_the_measured_worst_case() -> None:
    shim = container(k8s_object("Deployment", "shim"))
    env, resources = env_of(shim), shim["resources"]
    assert env["SHIM_MODE"] == "triton" and env["SHIM_WORKERS"] == "2"  # what the figures were measured for
    limit, request = mebibytes(resources["limits"]["memory"]), mebibytes(resources["requests"]["memory"])
    assert 1.2 * POD_MEMORY_WORST_MIB["triton"] <= limit <= 1.5 * POD_MEMORY_WORST_MIB["triton"], limit
    assert POD_MEMORY_READY_MIB["triton"] < request < limit
    # The legacy image's figures, given in the manifest's comment, hold the same margins.
    text = (K8S / "shim.yaml").read_text()
    legacy_limit = mebibytes(re.search(r"use limit (\d+Mi)", text).group(1))  # type: ignore[union-attr]
    legacy_request = mebibytes(re.search(r"and request (\d+Mi)", text).group(1))  # type: ignore[union-attr]
    assert 1.2 * POD_MEMORY_WORST_MIB["legacy"] <= legacy_limit <= 1.5 * POD_MEMORY_WORST_MIB["legacy"]
    assert POD_MEMORY_READY_MIB["legacy"] < legacy_request < legacy_limit
    assert f"{POD_MEMORY_WORST_MIB['triton']:,} MiB" in text and f"{POD_MEMORY_WORST_MIB['legacy']:,} MiB" in text


def test_check_limits_refuses_every_pair_that_disagrees() -> None:
    settings = Settings(max_upload_mb=16, max_pending=64, proxy_log_address="0.0.0.0:5140")
    good = {"PROXY_MAX_BODY_MB": "16", "PROXY_MAX_INFLIGHT": "64", "PROXY_LOG_ADDRESS": "shim:5140"}
    proxy.check_limits(good, settings)
    proxy.check_limits({**good, "PROXY_MAX_INFLIGHT": "8"}, settings)  # fewer in flight than a worker holds: fine
    for wrong, named in [({"PROXY_MAX_BODY_MB": "32"}, "PROXY_MAX_BODY_MB='32' must equal SHIM_MAX_UPLOAD_MB=16"),
                         ({"PROXY_MAX_INFLIGHT": "128"},
                          "PROXY_MAX_INFLIGHT='128' must be from 1 to SHIM_MAX_PENDING=64"),
                         ({"PROXY_MAX_INFLIGHT": "0"}, "PROXY_MAX_INFLIGHT='0'"),
                         ({"PROXY_LOG_ADDRESS": "shim:5141"}, "must have the port of PROXY_LOG_ADDRESS=shim:5141")]:
        with pytest.raises(ValueError, match=re.escape(named)):
            proxy.check_limits({**good, **wrong}, settings)


def test_the_proxy_agrees_with_the_shims_settings() -> None:
    settings = Settings()
    edge, admission = server_block("edge"), server_block("admission")
    assert directive_in(edge, "client_max_body_size", "= /predict") == "${PROXY_MAX_BODY_MB}m"
    assert directive_in(admission, "client_max_body_size", "= /predict") == "${PROXY_MAX_BODY_MB}m"
    assert nginx_directive("client_max_body_size") == "1k"  # every other path: no body (413 before reading)
    # /predict: the budget applies at the admission server, to complete requests only; the edge limits what
    # one address has in progress, its body still arriving included.
    assert directive_in(admission, "limit_conn", "= /predict") == "shim_predict_total ${PROXY_MAX_INFLIGHT}"
    predict_limits = re.findall(r"limit_conn (\w+ \d+);", location_block(edge, "= /predict"))
    assert predict_limits == ["shim_predict_per_client 32", "shim_client_requests 64", "shim_edge_predict 512"]
    assert "shim_predict_total" not in edge and "shim_predict_per_client" not in admission
    assert directive_in(edge, "proxy_request_buffering") == "on"  # the whole body before the admission server
    assert directive_in(edge, "proxy_pass", "= /predict") == "http://shim_admission"
    assert directive_in(admission, "proxy_pass", "= /predict") == "http://shim"
    assert "upstream shim_admission {\n        server unix:${PROXY_ADMISSION_SOCKET};" in NGINX_TEMPLATE.read_text()
    # The client address: from trusted proxies at the edge, passed on alone (never what the client wrote).
    assert directive_in(edge, "real_ip_header") == "X-Forwarded-For" and "${PROXY_REAL_IP_FROM}" in edge
    assert directive_in(admission, "set_real_ip_from") == "unix:"
    for block in (edge, admission):
        assert directive_in(block, "proxy_set_header X-Forwarded-For") == "$remote_addr"
    assert "$proxy_add_x_forwarded_for" not in NGINX_TEMPLATE.read_text()
    # /predict: nginx waits longer than the shim's own bound, so the shim's 504 (the contract's) comes first,
    # and the edge longer than the admission server.
    assert seconds(directive_in(admission, "proxy_read_timeout")) >= settings.triton_timeout_s + 5
    assert seconds(directive_in(edge, "proxy_read_timeout", "= /predict")) > \
        seconds(directive_in(admission, "proxy_read_timeout"))
    # Probes: straight from the edge to gunicorn (no budget, no extra hop), limited only as every path is (the
    # address's requests in progress, inherited from the server), without a body; nginx gives /readyz
    # more than the shim's readiness deadline, and the kubelet more than nginx.
    for path in ("/healthz", "/readyz"):
        assert directive_in(edge, "proxy_pass", f"= {path}") == "http://shim"
        assert READINESS_DEADLINE_S + 0.5 <= seconds(directive_in(edge, "proxy_read_timeout",
                                                                          f"= {path}")) <= 2
        assert "limit_conn" not in location_block(edge, f"= {path}") and f"= {path}" not in admission
        assert "if ($shim_has_body) { return 413; }" in location_block(edge, f"= {path}")
    assert directive_in(edge, "limit_conn") == "shim_client_requests 64"  # the server's: every location
    # Nothing but /predict, the probes and /openapi.json reaches gunicorn from the public port.
    assert set(re.findall(r"location (= /[\w.-]+|/) \{", edge)) == \
        {"= /predict", "= /healthz", "= /readyz", "= /proxy-healthz", "= /openapi.json", "/"}
    assert "proxy_pass" not in location_block(edge, "/")
    assert k8s_proxy()["readinessProbe"]["timeoutSeconds"] > seconds(directive_in(edge, "proxy_read_timeout",
                                                                                 "= /readyz"))
    # Upstream keep-alive: nginx drops an idle connection before gunicorn does, never reusing one it closes.
    gunicorn = re.search(r"^keepalive = (\d+)", (ROOT / "app" / "gunicorn_conf.py").read_text(), re.M)
    upstream = re.search(r"upstream shim \{.*?keepalive_timeout (\w+);", NGINX_TEMPLATE.read_text(), re.S)
    assert gunicorn and upstream and seconds(upstream.group(1)) < int(gunicorn.group(1))
    inner = re.search(r"upstream shim_admission \{.*?keepalive_timeout (\w+);", NGINX_TEMPLATE.read_text(), re.S)
    assert inner and seconds(inner.group(1)) < seconds(directive_in(admission, "keepalive_timeout"))
    # Slow clients end at the edge: short header and body timeouts, buffered uploads, a body buffer that holds a
    # web-sized photo (a temporary file per upload costs nginx more than the upload) and bounds a dripped one.
    for timeout in ("client_header_timeout", "client_body_timeout", "send_timeout"):
        assert seconds(directive_in(edge, timeout)) <= 10, timeout
    assert directive_in(edge, "client_body_buffer_size") == "256k"
    for directive, value in [("server_tokens", "off"), ("lingering_close", "off"), ("proxy_next_upstream", "off")]:
        assert nginx_directive(directive) == value, directive
    assert "escape=json" in nginx_directive("log_format")
    # Every answer is logged once, at the edge, and sent to the shim's counter; the admission server logs none.
    assert nginx_directive("access_log") == "off"
    assert "access_log" not in admission
    assert "access_log syslog:server=${PROXY_LOG_ADDRESS},tag=nginx,nohostname shim_metrics;" in edge


def test_compose_puts_the_proxy_in_front_of_the_shim() -> None:
    services = compose()["services"]
    front = services["proxy"]
    assert re.fullmatch(r"nginx:1\.\d+(\.\d+)?-bookworm", front["image"]), front["image"]
    port = compose_proxy_values()["PROXY_PORT"]
    assert front["ports"] == [f"{Settings().port}:{port}"]  # where clients always sent /predict
    assert compose_proxy_values()["PROXY_UPSTREAM"] == f"shim:{Settings().port}"
    assert front["depends_on"]["shim"] == {"condition": "service_healthy", "restart": True}
    check = " ".join(front["healthcheck"]["test"])
    assert proxy.LIVENESS in check and f"/dev/tcp/127.0.0.1/{port}" in check
    assert f"./{NGINX_TEMPLATE.relative_to(ROOT)}:" in front["volumes"][0] and front["volumes"][0].endswith(":ro")


def test_kubernetes_runs_the_proxy_beside_the_shim_and_every_probe_has_a_timeout() -> None:
    deployment = k8s_object("Deployment", "shim")
    front, shim = k8s_proxy(), container(deployment)
    assert "command" not in front, "`command` would replace the image's entrypoint, which renders the template"
    assert front["args"] == compose()["services"]["proxy"]["command"]
    env = env_of(front)
    ports = {p["name"]: p["containerPort"] for p in front["ports"]}
    assert ports["http"] == int(env["PROXY_PORT"])
    assert env["PROXY_UPSTREAM"] == f"127.0.0.1:{shim['ports'][0]['containerPort']}"
    (service_port,) = k8s_object("Service", "shim")["spec"]["ports"]
    assert service_port["targetPort"] == "http" and service_port["port"] == Settings().port
    for name, c in [(c["name"], c) for d in k8s_objects() if d["kind"] == "Deployment" for c in containers(d)]:
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            if kind in c:
                assert c[kind].get("timeoutSeconds"), f"{name}'s {kind} has no timeoutSeconds (1 s by default)"
    pod = deployment["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in front["volumeMounts"]}
    assert volumes[mounts[env["NGINX_ENVSUBST_TEMPLATE_DIR"]]]["configMap"]["name"] == "shim-proxy"
    assert "emptyDir" in volumes[mounts[env["NGINX_ENVSUBST_OUTPUT_DIR"]]]  # writable, on a read-only root
    assert front["securityContext"]["readOnlyRootFilesystem"] is True


def kustomize_build() -> str:
    kubectl, kustomize = shutil.which("kubectl"), shutil.which("kustomize")
    if kubectl is None and kustomize is None:
        pytest.skip("needs kubectl or kustomize (no cluster): `kubectl kustomize deploy/k8s`")
    result = run(*([kubectl, "kustomize"] if kubectl else [kustomize, "build"]), K8S)  # type: ignore[list-item]
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_kustomize_generates_the_proxy_configmap_from_deploy_nginx(tmp_path: Path) -> None:
    objects = [d for d in yaml.safe_load_all(kustomize_build()) if d]
    (configmap,) = [o for o in objects if o["kind"] == "ConfigMap" and o["metadata"]["name"].startswith("shim-proxy")]
    assert configmap["data"] == {NGINX_TEMPLATE.name: NGINX_TEMPLATE.read_text(),  # the same files, not copies
                                 ENVSH.name: ENVSH.read_text()}
    assert configmap["metadata"]["namespace"] == "inference"
    (deployment,) = [o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == "shim"]
    names = {v["configMap"]["name"] for v in deployment["spec"]["template"]["spec"]["volumes"] if "configMap" in v}
    assert configmap["metadata"]["name"] in names  # the generated name, hash included
    built = tmp_path / "built.yaml"
    built.write_text(yaml.safe_dump_all(objects))
    for version in K8S_VERSIONS:
        result = run(tool("kubernetes-validate"), "--strict", "-k", version, built)
        assert result.returncode == 0, result.stdout + result.stderr


def test_the_proxys_temporary_files_fit_the_volume_that_holds_them() -> None:
    """client_body_temp holds the /predict bodies the edge admits (shim_edge_predict, all addresses), each up to
    the upload limit; no other path takes a body. The proxy-cache emptyDir's sizeLimit is that and a margin,
    so nginx's bound comes before the kubelet's eviction."""
    edge = server_block("edge")
    bodies = int(re.search(r"limit_conn shim_edge_predict (\d+);", location_block(edge, "= /predict")).group(1))  # type: ignore[union-attr]
    env = {e["name"]: e.get("value") for e in k8s_proxy()["env"]}
    worst_gib = bodies * int(env["PROXY_MAX_BODY_MB"]) / 1024
    volumes = k8s_object("Deployment", "shim")["spec"]["template"]["spec"]["volumes"]
    (volume,) = [v for v in volumes if v["name"] == "proxy-cache"]
    size = mebibytes(volume["emptyDir"]["sizeLimit"]) / 1024
    assert worst_gib < size <= worst_gib + 2, f"sizeLimit {size} GiB for {worst_gib} GiB of bodies"
    assert nginx_directive("client_max_body_size") == "1k"  # no other path stores a body
