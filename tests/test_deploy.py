"""docker-compose.yml, the Dockerfiles and deploy/k8s, checked by the real validators and against the code.

No docker engine or cluster runs here: each file is validated by the tool its format has (the Compose
specification's schema, hadolint, the Kubernetes schemas), each validator is shown to reject a broken
copy, and what the files promise (ports, probes, settings, image versions) is checked against the shim and
a real Triton.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
import requests

from app.embedded_triton import EmbeddedTriton
from app.settings import Settings
from tests.deploy_support import (
    COMPOSE,
    DOCKERFILES,
    K8S,
    adapter_query,
    adapter_rules,
    compose,
    container,
    k8s_manifests,
    k8s_object,
    k8s_objects,
    parse_selectors,
    run,
    series_name,
    tool,
    yaml_docs,
)
from tests.support import ROOT, encode, photo, wait_until
from tools.launch import ServedApp, free_port

# The NGC image that ships each Triton server release the tests run (nvidia-pytriton's wheel). Triton's
# numbering: NGC YY.MM <-> 2.N.0, one a month (22.12 is v2.29.0, so 24.10 is v2.51.0).
NGC_RELEASE_OF = {"2.51.0": "24.10"}
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
    assert triton["command"][:1] == ["tritonserver"]
    assert {"--model-repository=/models", "--model-control-mode=explicit", "--load-model=*"} <= set(triton["command"])
    assert {p.split(":")[0] for p in triton["ports"]} == {"8000", "8001", "8002"}
    size = re.fullmatch(r"(\d+)(gb|mb)", triton["shm_size"])
    assert size and int(size.group(1)) * (1024 if size.group(2) == "gb" else 1) >= 256, triton["shm_size"]
    assert "/v2/health/ready" in " ".join(triton["healthcheck"]["test"])


def test_compose_shim_waits_for_a_healthy_triton_and_its_flag_switches_without_a_rebuild() -> None:
    services = compose()["services"]
    shim, env = services["shim"], shim_env()
    assert shim["build"]["context"] == "."
    assert env["SHIM_TRITON_URL"] == "triton:8000"
    assert "5000:5000" in shim["ports"]
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


def test_compose_profiles_and_mounted_files() -> None:
    services = compose()["services"]
    assert services["prometheus"]["profiles"] == ["monitoring"] and services["grafana"]["profiles"] == ["monitoring"]
    export = services["model-export"]
    assert export["profiles"] == ["export"] and export["build"]["args"]["WITH_LEGACY"] == "1"
    assert (ROOT / export["entrypoint"][1]).is_file()
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


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    text = re.sub(r"\\\n\s*", " ", path.read_text())
    return [(line.split()[0].upper(), line.split(None, 1)[1]) for line in text.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def test_the_shim_image_copies_sources_that_exist_and_that_dockerignore_lets_through() -> None:
    ignored = [p for p in (ROOT / ".dockerignore").read_text().splitlines() if p and not p.startswith("#")]
    assert {".venv", ".cache", "triton_repo/*/[0-9]*/model.pt"} <= set(ignored)
    copies = [args.split() for op, args in dockerfile_instructions(ROOT / "Dockerfile") if op == "COPY"]
    sources = [src for words in copies if not words[0].startswith("--from") for src in words[:-1]]
    assert "gunicorn.conf.py" in sources and "app" in sources
    for src in sources:
        assert (ROOT / src).exists(), src
        assert not any(fnmatch.fnmatch(src, pattern) for pattern in ignored), f"{src} is excluded by .dockerignore"


def test_the_shim_image_runs_gunicorn_as_non_root_with_a_healthcheck() -> None:
    steps = dockerfile_instructions(ROOT / "Dockerfile")
    last = {op: args for op, args in steps}  # the runtime stage's, as the image keeps them
    assert last["USER"].split(":")[0] not in {"0", "root"}
    assert last["ENTRYPOINT"] == '["gunicorn", "-c", "gunicorn.conf.py"]'
    assert "/healthz" in last["HEALTHCHECK"] and "curl" not in last["HEALTHCHECK"]
    assert ("ARG", "WITH_LEGACY=0") in steps  # the slim image is the default


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
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SHIM_") and k != "PROMETHEUS_MULTIPROC_DIR"}
    env.update(PYTHONPATH=str(site), SHIM_HOST="127.0.0.1", SHIM_PORT=str(port), SHIM_WORKERS="1",
               SHIM_TRITON_URL=triton.http_url, SHIM_MODE="triton",
               SHIM_LABELS_PATH=str(test_repo / "resnet50" / "labels.txt"))
    where = subprocess.run([sys.executable, "-c", "import app; print(app.__file__)"], cwd=workdir, env=env,
                           capture_output=True, text=True, check=True).stdout
    assert where.startswith(str(site)), f"app was imported from {where}, not from the staged image"
    log = tmp_path / "shim.log"
    with log.open("wb") as out:
        server = subprocess.Popen([sys.executable, "-m", "gunicorn", "-c", "gunicorn.conf.py"], cwd=workdir, env=env,
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
    assert set(kustomization["resources"]) == top_level
    images = {i["name"] for i in kustomization["images"]}
    used = {container(o)["image"].split(":")[0] for o in k8s_objects() if o["kind"] == "Deployment"}
    assert used == images


def probe(c: dict[str, Any], kind: str) -> tuple[str, int]:
    get = c[kind]["httpGet"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    return get["path"], ports.get(get["port"], get["port"])


@pytest.mark.triton
def test_probes_hit_endpoints_that_answer_on_the_real_shim_and_triton(shim_triton: ServedApp,
                                                                      triton: EmbeddedTriton) -> None:
    shim, server = container(k8s_object("Deployment", "shim")), container(k8s_object("Deployment", "triton"))
    assert probe(shim, "readinessProbe") == ("/readyz", Settings().port)
    assert probe(shim, "livenessProbe") == ("/healthz", Settings().port)
    assert probe(server, "readinessProbe") == ("/v2/health/ready", 8000)
    assert probe(server, "livenessProbe")[0] == "/v2/health/live"
    for kind in ("readinessProbe", "livenessProbe"):
        assert requests.get(shim_triton.url + probe(shim, kind)[0], timeout=10).status_code == 200
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert requests.get(f"http://{triton.http_url}{probe(server, kind)[0]}", timeout=10).status_code == 200


def test_services_select_their_pods_and_the_shim_finds_triton() -> None:
    for name in ("shim", "triton"):
        service, deployment = k8s_object("Service", name), k8s_object("Deployment", name)
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        assert service["spec"]["selector"].items() <= labels.items()
        names = {p["name"] for p in container(deployment)["ports"]}
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


def readme_section(title: str) -> str:
    text = (ROOT / "README.md").read_text()
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"README has no section {title!r}"
    return match.group(1)


def commands(section: str) -> list[list[str]]:
    """The shell commands of a README section's bash blocks, split at && and without VAR=value prefixes."""
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
    """`docker compose [--profile P]... SUB [options] ARGS`: the profiles, SUB and the positional ARGS."""
    args, profiles = cmd[2:], []
    while args[0].startswith("-"):
        if args[0] == "--profile":
            profiles.append(args[1])
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


def test_readme_compose_commands_name_services_profiles_and_files_that_exist() -> None:
    section = readme_section("Deploy with docker compose on a GPU host")
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
        if sub == "exec":
            assert env["SHIM_FLAG_FILE"] in positionals  # the flag file the README removes is the one in use
    assert "model-export" in {p[0] for _, sub, p in calls if sub == "run"}
    for var in re.findall(r"\bSHIM_[A-Z_]+\b", section):
        assert var in SETTINGS_VARS | {"SHIM_WITH_LEGACY", "SHIM_MODEL_WEIGHTS"}, var
    assert {"SHIM_MODE", "SHIM_ADMIN_TOKEN", "SHIM_FLAG_FILE"} <= set(env)


def test_readme_kubernetes_commands_apply_files_that_exist() -> None:
    cmds = commands(readme_section("Scale out on Kubernetes"))
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
    (container,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    (volume,) = [v for v in pod["volumes"] if v.get("configMap", {}).get("name") == configmap["metadata"]["name"]]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == volume["name"]]
    assert env["SHIM_FLAG_FILE"] == f"{mount['mountPath']}/traffic.json" and mount["readOnly"]
    section = readme_section("Scale out on Kubernetes")
    assert f"create configmap {configmap['metadata']['name']}" in section
