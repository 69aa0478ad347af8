"""`make k8s-test`: deploy/k8s rendered by kustomize, its Deployments run as pods by podman, checked as by a kubelet.

    .venv/bin/python tests/k8s/driver.py [--mutate probe-path|command|env-name]

No Kubernetes can run on this machine (no kube-apiserver, kubelet or kind node image can be had), but Debian
bookworm's podman 4.3 runs a Deployment's pod template as a real pod (`podman kube play`): the same
containers, commands, env, ConfigMap and volume mounts, security context, one network namespace per pod.
Stages, one line each with its duration:

  tools       podman 4.3 (with catatonit for its pause image and netavark), installed with apt when missing;
              kubectl (its built-in kustomize) or a kustomize binary, which this cannot install: bookworm's
              kubectl 1.20 embeds a kustomize too old for deploy/k8s (`../nginx` as a resource)
  render      `kubectl kustomize deploy/k8s`, exactly what `kubectl apply -k deploy/k8s` sends, then the
              play-only changes (play_version below; every one is listed with its reason) written to
              .cache/k8s/play.yaml, the file podman plays
  tools ... build   tests/compose/driver.py's own stages: the images `make compose-test` builds and runs, built
              (or found in docker's cache) only for the Deployments' containers
  podman      those images copied from docker's store into podman's (`docker-daemon:` transport; skipped
              when podman already has the same image ID), docker's engine stopped if started here
  pods        pytest tests/k8s: plays the pods, checks them as a kubelet would, replays three broken variants
              of the shim's pod and sees each one fail, stops the pods within their grace period
  cleanup     pods, containers, volumes, secrets and the network of this run removed; leftovers checked

What podman cannot show (Services, the HPAs, and whatever else no pod runs) stays checked by the schemas in
tests/unit/test_deploy.py; docs/testing.md ("Kubernetes in CI") says which parts ran and which did not.

--mutate plays deliberately broken manifests (a probe's path, a container's command, an env name) through the
whole run: it must then fail, which `make k8s-test` itself also shows, more cheaply, in tests/k8s.
"""

from __future__ import annotations

import argparse
import base64
import copy
import ipaddress
import json
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.compose import driver as compose_test
from tests.compose.driver import Engine, Stack, StageError, Stages, run

ROOT = Path(__file__).resolve().parents[2]

K8S = ROOT / "deploy" / "k8s"
CACHE = ROOT / ".cache" / "k8s"
LOGS = CACHE / "logs"
PLAY_FILE = CACHE / "play.yaml"      # the manifests as podman plays them
PLAN_FILE = CACHE / "plan.json"      # what tests/k8s needs to know about them (Plan below)
CONTAINERS_CONF = CACHE / "containers.conf"
EMPTY_DIRS = CACHE / "emptydir"  # the pods' emptyDir volumes (play_version), made anew for each pod
SHM_DIRS = Path("/dev/shm") / "flask-triton-shim-k8s"  # those with medium: Memory, on the host's tmpfs
SECRET_DIRS = CACHE / "secrets"  # the pods' secret volumes (play_version), removed with the pods
SUBPATH_DIRS = CACHE / "subpath"  # the files that subPath mounts of ConfigMap keys show (play_version)
SUBPATH_VOLUME = "play-subpath-"  # the name of each volume play_version adds for one such mount starts so
MODEL_REPOSITORY = CACHE / "model-repository"  # what the PersistentVolumeClaim holds (play_version)
NETWORK = "flask-triton-shim-k8s"  # this run's podman network: never one a user made
PODMAN_PACKAGES = {"podman": "/usr/bin/podman", "catatonit": "/usr/libexec/podman/catatonit",
                   "netavark": "/usr/lib/podman/netavark", "runc": "/usr/sbin/runc"}
# The Deployment whose pod clients reach (through its Service) and whose broken variants tests/k8s plays.
ENTRY = "shim"
MUTATIONS = ("probe-path", "command", "env-name")


# --- tools ----------------------------------------------------------------------------------------------

def podman_env() -> dict[str, str]:
    return {**os.environ, "CONTAINERS_CONF": str(CONTAINERS_CONF)}


def podman(*args: str, timeout: float = 120, check: bool = True,
           log: Path | None = None) -> subprocess.CompletedProcess[str]:
    """podman with this run's containers.conf (write_containers_conf)."""
    return run(["podman", *args], timeout=timeout, check=check, env=podman_env(), log=log)


def write_containers_conf() -> str:
    """What podman 4.3 needs on this machine, in a containers.conf that only podman started by this tool reads
    (CONTAINERS_CONF; /etc/containers is left alone):

    * default_ulimits: as root, podman sets every container's RLIMIT_NOFILE and RLIMIT_NPROC, by default to
      1048576 and 4194304, which only a process with CAP_SYS_RESOURCE may raise to; root here (in a container
      itself) lacks it and every start fails with `setrlimit ... operation not permitted`. The defaults are
      just under the limits the runtime runs with (this process's hard limits; NPROC also at most the kernel's
      pid_max, conmon's): measured here, exactly at them the start still fails, one under it succeeds. That is
      still above what the pods ask for (nginx's worker_rlimit_nofile).
    * runtime runc: bookworm's crun 1.8 refuses this machine's hybrid cgroup v1 + v2 layout ("cgroups in
      hybrid mode not supported"); runc (which docker.io brings) runs it."""
    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    limits = []
    for name, which, cap in (("nofile", resource.RLIMIT_NOFILE, 1 << 20), ("nproc", resource.RLIMIT_NPROC, pid_max)):
        _, hard = resource.getrlimit(which)
        value = min(cap if hard == resource.RLIM_INFINITY else hard, cap) - 1
        limits.append(f'"{name}={value}:{value}"')
    CONTAINERS_CONF.parent.mkdir(parents=True, exist_ok=True)
    CONTAINERS_CONF.write_text("# Written by tests/k8s/driver.py (write_containers_conf says why).\n[containers]\n"
                               f"default_ulimits = [{', '.join(limits)}]\n\n[engine]\nruntime = \"runc\"\n")
    return f"default_ulimits {', '.join(limits)}, runtime runc"


def ensure_podman() -> str:
    missing = [pkg for pkg, path in PODMAN_PACKAGES.items() if not Path(path).exists()]
    done = ""
    if missing:
        if not compose_test.is_root() or shutil.which("apt-get") is None:
            raise StageError(f"missing: {', '.join(missing)} (Debian packages); install them, or run as root with apt")
        compose_test.apt("install", "--yes", "--no-install-recommends", *missing, log=LOGS / "tools.log")
        done = f"installed {', '.join(missing)}; "
    conf = write_containers_conf()
    version = podman("version", "--format", "{{.Client.Version}}").stdout.strip()
    return f"{done}podman {version}; {conf}"


def kustomize_command() -> list[str]:
    """How to render a kustomization: kubectl's built-in kustomize (v5 since kubectl 1.27) or a kustomize binary."""
    if (kubectl := shutil.which("kubectl")) is not None:
        result = run([kubectl, "version", "--client", "--output=json"], check=False, timeout=30)
        version = json.loads(result.stdout or "{}").get("kustomizeVersion", "") if result.returncode == 0 else ""
        if version.startswith("v") and int(version[1:].split(".")[0]) >= 4:
            return [kubectl, "kustomize"]
    if (kustomize := shutil.which("kustomize")) is not None:
        return [kustomize, "build"]
    raise StageError("no kustomize: install kubectl 1.27 or newer (its `kubectl kustomize` is kustomize v5) or a "
                     "kustomize v5 binary. Debian bookworm's kubernetes-client (kubectl 1.20, kustomize v2) cannot "
                     "read deploy/k8s/kustomization.yaml (`../nginx` as a resource)")


# --- the manifests, rendered and made playable ------------------------------------------------------------

def render(folder: Path = K8S) -> list[dict[str, Any]]:
    """What `kubectl apply -k folder` would send to a cluster."""
    out = run([*kustomize_command(), str(folder)], timeout=60).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def of_kind(objects: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind]


def named(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = [o for o in of_kind(objects, kind) if o["metadata"]["name"] == name]
    if len(found) != 1:
        raise StageError(f"the rendered manifests have {len(found)} {kind} named {name!r}")
    return found[0]


def pod_spec(deployment: dict[str, Any]) -> dict[str, Any]:
    spec: dict[str, Any] = deployment["spec"]["template"]["spec"]
    return spec


def selects(service: dict[str, Any], deployment: dict[str, Any]) -> bool:
    labels = deployment["spec"]["template"]["metadata"].get("labels", {})
    selector = service["spec"].get("selector") or {}
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def container_port(container: dict[str, Any], port: int | str) -> int:
    """A port as a probe or a Service's targetPort names it (a number or a container port's name)."""
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for p in container.get("ports", []):
        if p.get("name") == port:
            return int(p["containerPort"])
    raise AssertionError(f"container {container['name']} has no port named {port!r}")


def pod_port(deployment: dict[str, Any], port: int | str) -> int:
    """A port of the pod: a number, or the name of any of its containers' ports (a Service's targetPort)."""
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for c in pod_spec(deployment)["containers"]:
        if any(p.get("name") == port for p in c.get("ports", [])):
            return container_port(c, port)
    raise AssertionError(f"no container of Deployment {deployment['metadata']['name']} has a port named {port!r}")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Plan:
    """What tests/k8s needs to know about the pods as played: written by the render stage to .cache/k8s/plan.json."""

    network: str
    subnet: str
    pod_ips: dict[str, str]                 # Deployment -> the pod's address on the network
    host_ports: dict[str, dict[str, int]]   # Deployment -> containerPort (as text) -> 127.0.0.1 port
    images: dict[str, str]                  # the manifests' image -> the local CI image played instead
    changes: list[str] = field(default_factory=list)  # every play-only change, with its reason
    user_secrets: dict[str, list[str]] = field(default_factory=dict)  # Secret the user creates -> its keys

    def save(self) -> None:
        PLAN_FILE.write_text(json.dumps(asdict(self), indent=1))

    @classmethod
    def load(cls) -> Plan:
        return cls(**json.loads(PLAN_FILE.read_text()))


def shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def compose_images(stack: Stack) -> tuple[dict[str, str], dict[str, list[str]], dict[str, str]]:
    """What tests/compose/ci.yml does to docker-compose.yml, by image repository: the repository a service names
    in docker-compose.yml -> (the CI image, the CI command where ci.yml replaces it, the compose service)."""
    base = yaml.safe_load(compose_test.COMPOSE_FILES[0].read_text())["services"]
    merged = stack.config()["services"]
    images, commands, services = {}, {}, {}
    for name, service in base.items():
        if "image" not in service or name not in merged:
            continue
        repository = repository_of(service["image"])
        images[repository] = merged[name]["image"]
        services[repository] = name
        if merged[name].get("command") != service.get("command"):
            commands[repository] = without_key_script(list(merged[name]["command"]))
    return images, commands, services


def without_key_script(command: list[str]) -> list[str]:
    """A compose command less a script in front of it (`sh -c SCRIPT NAME server ...`): a pod's args are the
    server's own."""
    return command[4:] if command[:2] == ["sh", "-c"] and len(command) > 4 else command


def repository_of(image: str) -> str:
    last = image.rsplit("/", 1)[-1]
    return image.rsplit(":", 1)[0] if ":" in last else image


def play_version(objects: list[dict[str, Any]], *, stack: Stack, network: str, subnet: str,
                 model_repository: Path) -> tuple[list[dict[str, Any]], Plan, list[str]]:
    """The rendered manifests as podman plays them here, the plan, and the compose services whose images they use.

    Every change is one that a kubelet on a cluster would not need, and each is listed in Plan.changes."""
    played = copy.deepcopy(objects)
    images, commands, services = compose_images(stack)
    net = ipaddress.ip_network(subnet)
    deployments = of_kind(played, "Deployment")
    changes = []
    pod_ips = {d["metadata"]["name"]: str(net.network_address + 10 + i) for i, d in enumerate(deployments)}
    host_ports: dict[str, dict[str, int]] = {}
    used_images, needed = {}, []
    aliases, unaliased = [], []
    for service in of_kind(played, "Service"):
        targets = [d for d in deployments if selects(service, d)]
        if len(targets) != 1:
            raise StageError(f"Service {service['metadata']['name']} selects {len(targets)} Deployments' pods; "
                             "a hostAliases entry can stand in for one")
        ports = [(p["port"], pod_port(targets[0], p.get("targetPort", p["port"]))) for p in service["spec"]["ports"]]
        if all(port == target for port, target in ports):
            aliases.append((pod_ips[targets[0]["metadata"]["name"]], service["metadata"]["name"]))
        else:  # a name alone cannot map ports: tests/k8s sends to the target port, as kube-proxy would
            unaliased.append(f"{service['metadata']['name']} ({', '.join(f'{a}->{b}' for a, b in ports)})")
    changes.append("Services -> hostAliases: the name of each Service that maps its ports to the same port numbers "
                   "resolves in every pod to the pod it selects ("
                   + ", ".join(f"{name} -> {ip}" for ip, name in aliases) + "); podman has no Services"
                   + (f"; not aliased, reached at the target port: {', '.join(unaliased)}" if unaliased else ""))
    for deployment in deployments:
        name = deployment["metadata"]["name"]
        if deployment["spec"].get("replicas", 1) != 1:
            deployment["spec"]["replicas"] = 1
        spec = pod_spec(deployment)
        spec["hostAliases"] = [*spec.get("hostAliases", []),
                               *({"ip": ip, "hostnames": [alias]} for ip, alias in aliases)]
        host_ports[name] = {}
        for c in spec["containers"]:
            repository = repository_of(c["image"])
            if repository not in images:
                raise StageError(f"{name}/{c['name']} runs {c['image']}, which no service of docker-compose.yml "
                                 "builds or names: make compose-test has no image for it")
            used_images[c["image"]] = images[repository]
            needed.append(services[repository])
            c["image"] = images[repository]
            c["imagePullPolicy"] = "Never"
            if repository in commands:
                c.pop("command", None)
                c["args"] = commands[repository]
                changes.append(f"{name}/{c['name']}: args -> tests/compose/ci.yml's command for {services[repository]} "
                               f"({' '.join(commands[repository][:3])} ...), the CI image's server, in poll mode "
                               "with its admin APIs closed, as the manifest's")
            for p in c.get("ports", []):
                p["hostIP"] = "127.0.0.1"
                p["hostPort"] = host_ports[name].setdefault(str(p["containerPort"]), free_port())
    changes.append("replicas -> 1 (podman plays `replicas` pods on this one host; on a cluster the HPA owns the count)")
    changes.append("images -> the local images make compose-test builds ("
                   + ", ".join(f"{k} -> {v}" for k, v in used_images.items()) + "), imagePullPolicy Never")
    changes.append("containerPorts -> published on 127.0.0.1 at free ports (podman 4.3 publishes every containerPort "
                   "on the host, at the same port, on every address)")
    for deployment in deployments:
        empty_dirs = []
        for volume in pod_spec(deployment).get("volumes", []):
            if "emptyDir" in volume:
                memory = volume["emptyDir"].get("medium") == "Memory"
                path = (SHM_DIRS if memory else EMPTY_DIRS) / f"{deployment['metadata']['name']}-{volume['name']}"
                name = volume["name"]
                volume.clear()
                volume.update({"name": name, "hostPath": {"path": str(path), "type": "Directory"}})
                empty_dirs.append(f"{volume['name']}{' (tmpfs)' if memory else ''}")
        if empty_dirs:
            changes.append(f"{deployment['metadata']['name']}: emptyDir {', '.join(empty_dirs)} -> an empty directory "
                           "of mode 0777 made for the run, as a kubelet makes it (podman 4.3 mounts a volume that "
                           "copies the image's folder and its owner: root's /var/cache/nginx, /dev/shm); a Memory "
                           f"one under {SHM_DIRS}")
    secrets = {o["metadata"]["name"]: o for o in of_kind(played, "Secret")}
    for deployment in deployments:
        for volume in pod_spec(deployment).get("volumes", []):
            if "secret" in volume:
                name = volume["name"]
                path = SECRET_DIRS / f"{deployment['metadata']['name']}-{name}"
                write_secret_volume(secrets, volume["secret"], path)
                volume.clear()
                volume.update({"name": name, "hostPath": {"path": str(path), "type": "Directory"}})
                changes.append(f"{deployment['metadata']['name']}: secret volume {name} -> a folder of the Secret's "
                               "decoded keys, as a kubelet mounts it (podman 4.3 writes them base64-encoded)")
    for deployment in deployments:
        for mount in subpath_mounts(deployment, of_kind(played, "ConfigMap")):
            changes.append(f"{deployment['metadata']['name']}: {mount} (podman 4.3 ignores subPath and mounts "
                           "the whole volume as a folder there)")
    for claim in of_kind(played, "PersistentVolumeClaim"):
        claim["metadata"].setdefault("annotations", {}).update({
            "volume.podman.io/type": "none", "volume.podman.io/mount-options": "bind",
            "volume.podman.io/device": str(MODEL_REPOSITORY)})
        changes.append(f"PersistentVolumeClaim {claim['metadata']['name']} -> a local volume bound to "
                       f"{shown(MODEL_REPOSITORY)}: a copy of {shown(model_repository)} "
                       "(modelrepo/standin.py's numpy copy of triton_repo, as in make compose-test), made for each "
                       "run, since podman chowns a volume's folder to the user of the first container that mounts it")
    wanted = user_secrets(played)
    if wanted:
        changes.append("Secrets docs/production.md has the user create (" + ", ".join(
            f"{name}: {', '.join(keys)}" for name, keys in wanted.items()) + ") -> podman secrets of random keys, "
            "made before the pods start as `kubectl create secret generic` makes them on a cluster (podman 4.3 "
            "reads a secretKeyRef only from a podman secret holding JSON of base64 values; a Secret object it "
            "plays is stored in another form)")
    plan = Plan(network=network, subnet=subnet, pod_ips=pod_ips, host_ports=host_ports, images=used_images,
                changes=changes, user_secrets=wanted)
    return played, plan, sorted(set(needed))


def user_secrets(objects: list[dict[str, Any]]) -> dict[str, list[str]]:
    """The Secrets the pods' env takes keys from (secretKeyRef, not optional) that the manifests do not hold: the
    user creates them (docs/production.md, "Scale out on Kubernetes"). Name -> the keys read."""
    held = {o["metadata"]["name"] for o in of_kind(objects, "Secret")}
    wanted: dict[str, set[str]] = {}
    for deployment in of_kind(objects, "Deployment"):
        spec = pod_spec(deployment)
        for c in [*spec.get("initContainers", []), *spec["containers"]]:
            for env in c.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref and not ref.get("optional") and ref["name"] not in held:
                    wanted.setdefault(ref["name"], set()).add(ref["key"])
    return {name: sorted(keys) for name, keys in sorted(wanted.items())}


def create_user_secrets(wanted: dict[str, list[str]]) -> None:
    """Each Secret the user would create, as a podman secret of random keys (in the JSON form that podman 4.3's
    secretKeyRef reads: key -> base64 of the value), unless one of that name exists."""
    existing = set(podman("secret", "ls", "--format", "{{.Name}}").stdout.split())
    for name, keys in wanted.items():
        if name not in existing:
            data = {key: base64.b64encode(os.urandom(32).hex().encode()).decode() for key in keys}
            made = subprocess.run(["podman", "secret", "create", name, "-"], input=json.dumps(data), text=True,
                                  capture_output=True, timeout=60, env=podman_env(), check=False)
            if made.returncode != 0:
                raise StageError(f"`podman secret create {name}` failed: {made.stderr.strip()[-2000:]}")


def subpath_mounts(deployment: dict[str, Any], configmaps: list[dict[str, Any]]) -> list[str]:
    """Each mount of one key of a ConfigMap volume (subPath) -> a volume of its own: a file of that key, written
    with the volume's defaultMode as a kubelet writes it, bound at the mount path. What changed, as text."""
    spec, done = pod_spec(deployment), []
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    maps = {c["metadata"]["name"]: c for c in configmaps}
    for c in spec["containers"]:
        for mount in c.get("volumeMounts", []):
            source = volumes.get(mount["name"], {}).get("configMap")
            if source is None or "subPath" not in mount:
                continue
            key = mount.pop("subPath")
            data = maps.get(source["name"], {}).get("data", {})
            if key not in data:
                raise StageError(f"{deployment['metadata']['name']}/{c['name']} mounts key {key} of ConfigMap "
                                 f"{source['name']}, which has no such key")
            name = f"{SUBPATH_VOLUME}{len(done)}"
            path = SUBPATH_DIRS / f"{deployment['metadata']['name']}-{mount['name']}" / key
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(data[key])
            path.chmod(source.get("defaultMode", 0o644))
            spec["volumes"].append({"name": name, "hostPath": {"path": str(path), "type": "File"}})
            done.append(f"subPath {key} of volume {mount['name']} at {mount['mountPath']} -> volume {name}, the "
                        f"file {shown(path)} of mode {source.get('defaultMode', 0o644):o}")
            mount["name"] = name
    return done


def write_secret_volume(secrets: dict[str, dict[str, Any]], source: dict[str, Any], path: Path) -> None:
    """A secret volume's files as a kubelet writes them: each key decoded (or its `items` path), defaultMode."""
    secret = secrets.get(source["secretName"])
    if secret is None and not source.get("optional"):
        raise StageError(f"a pod mounts Secret {source['secretName']}, which the manifests do not hold")
    data = {k: base64.b64decode(v) for k, v in (secret or {}).get("data", {}).items()}
    data.update({k: v.encode() for k, v in (secret or {}).get("stringData", {}).items()})
    items = {i["key"]: (i["path"], i.get("mode")) for i in source.get("items", [])} or {k: (k, None) for k in data}
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    path.chmod(0o755)
    for key, (relative, mode) in items.items():
        target = path / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data[key])
        target.chmod(mode if mode is not None else source.get("defaultMode", 0o644))


# --- broken variants: what the checks must catch -------------------------------------------------------------

def mutate(objects: list[dict[str, Any]], mutation: str, deployment: str = ENTRY) -> tuple[list[dict[str, Any]], str]:
    """A copy of `objects` with one mistake in the pod of `deployment`, and what it is (as the checks name it)."""
    mutated = copy.deepcopy(objects)
    containers = pod_spec(named(mutated, "Deployment", deployment))["containers"]
    if mutation == "probe-path":
        c = next(c for c in containers if "httpGet" in c.get("livenessProbe", {}))
        get = c["livenessProbe"]["httpGet"]
        get["path"] = f"{get['path'].rstrip('/')}-mutant"
        return mutated, f"{c['name']}'s livenessProbe GET {get['path']}"
    if mutation == "command":
        c = next(c for c in containers if c.get("command") or c.get("args"))
        key = "command" if c.get("command") else "args"
        c[key] = [f"{c[key][0]}-mutant", *c[key][1:]]
        return mutated, f"{c['name']}'s {key} {c[key][0]}"
    if mutation == "env-name":
        c = next(c for c in containers if any("value" in e for e in c.get("env", [])))
        env = next(e for e in c["env"] if "value" in e)
        env["name"] = f"{env['name']}_MUTANT"
        return mutated, f"{c['name']}'s env {env['name']}"
    raise ValueError(f"unknown mutation {mutation!r}: one of {', '.join(MUTATIONS)}")


# --- the pods ---------------------------------------------------------------------------------------------

def dump(objects: list[dict[str, Any]], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump_all(objects, sort_keys=False))
    return path


def pod_name(deployment: str) -> str:
    return f"{deployment}-pod-0"  # podman 4.3 names a Deployment's pods <name>-pod-<i>


def container_name(deployment: str, container: str) -> str:
    return f"{pod_name(deployment)}-{container}"


def volume_names(objects: list[dict[str, Any]]) -> set[str]:
    """The named volumes podman makes for these manifests: one per ConfigMap, Secret and claim a pod mounts."""
    names = set()
    for d in of_kind(objects, "Deployment"):
        for v in pod_spec(d).get("volumes", []):
            for key, field_name in (("configMap", "name"), ("secret", "secretName"),
                                    ("persistentVolumeClaim", "claimName")):
                if key in v:
                    names.add(v[key][field_name])
    return names


def ensure_network() -> str:
    """This run's network, without DNS: names resolve only through the pods' hostAliases (the Services)."""
    if podman("network", "exists", NETWORK, check=False).returncode != 0:
        podman("network", "create", "--disable-dns", NETWORK)
    data = json.loads(podman("network", "inspect", NETWORK).stdout)[0]
    return str(data["subnets"][0]["subnet"])


def fresh_empty_dirs(deployments: list[dict[str, Any]]) -> None:
    """The emptyDir stand-ins of these pods, empty and of mode 0777 (a kubelet's emptyDir), before the pods start."""
    for deployment in deployments:
        for volume in pod_spec(deployment).get("volumes", []):
            path = Path(volume.get("hostPath", {}).get("path", "/"))
            if path.parent in (EMPTY_DIRS, SHM_DIRS):
                shutil.rmtree(path, ignore_errors=True)
                path.mkdir(parents=True)
                path.chmod(0o777)


def remove_empty_dirs(*, secrets: bool = True) -> None:
    for folder in (EMPTY_DIRS, SHM_DIRS, *([SECRET_DIRS, SUBPATH_DIRS] if secrets else [])):
        shutil.rmtree(folder, ignore_errors=True)


def play(path: Path, plan: Plan, deployments: list[str] | None = None, *, replace: bool = False) -> None:
    """`podman kube play` of the file, each pod at its planned address (in the order the file lists them)."""
    objects = [d for d in yaml.safe_load_all(path.read_text()) if d]
    order = [d["metadata"]["name"] for d in of_kind(objects, "Deployment")]
    if replace:
        remove_pods([pod_name(name) for name in order])
    fresh_empty_dirs(of_kind(objects, "Deployment"))
    if of_kind(objects, "PersistentVolumeClaim"):
        shutil.rmtree(MODEL_REPOSITORY, ignore_errors=True)
        shutil.copytree(compose_test.STANDIN_REPO, MODEL_REPOSITORY, symlinks=True)
    create_user_secrets(plan.user_secrets)
    ips = [a for name in order for a in ("--ip", plan.pod_ips[name])]
    podman("kube", "play", "--network", plan.network, *ips, str(path), timeout=300, log=LOGS / "play.log")
    if deployments is not None and sorted(order) != sorted(deployments):
        raise AssertionError(f"{path} plays {order}, not {deployments}")


def remove_pods(names: list[str], deadline_s: float = 120) -> None:
    """The pods removed, and gone: `pod rm --force` can fail while a container of the pod is still restarting
    (a broken variant's), so it is asked again until none of them exists."""
    give_up = time.monotonic() + deadline_s
    while True:
        removed = podman("pod", "rm", "--force", "--time", "0", *names, check=False, timeout=120)
        left = [n for n in names if podman("pod", "exists", n, check=False).returncode == 0]
        if not left:
            return
        if time.monotonic() > give_up:
            raise StageError(f"podman cannot remove pods {left}: {removed.stdout.strip()[-2000:]}")
        names = left
        time.sleep(1)


def leftovers(objects: list[dict[str, Any]]) -> dict[str, list[str]]:
    """What of these manifests' pods, containers, volumes and secrets, and of the network, exists in podman now."""
    pods = {pod_name(d["metadata"]["name"]) for d in of_kind(objects, "Deployment")}
    existing_pods = set(podman("pod", "ps", "--format", "{{.Name}}", check=False).stdout.split())
    containers = [c for c in podman("ps", "--all", "--format", "{{.Names}}", check=False).stdout.split()
                  if any(c.startswith(f"{p}-") for p in pods) or c in pods]
    volumes = set(podman("volume", "ls", "--format", "{{.Name}}", check=False).stdout.split())
    secrets = {s["metadata"]["name"] for s in of_kind(objects, "Secret")} | set(user_secrets(objects))
    existing_secrets = set(podman("secret", "ls", "--format", "{{.Name}}", check=False).stdout.split())
    networks = set(podman("network", "ls", "--format", "{{.Name}}", check=False).stdout.split())
    return {"pods": sorted(pods & existing_pods), "containers": sorted(containers),
            "volumes": sorted(volume_names(objects) & volumes), "secrets": sorted(secrets & existing_secrets),
            "networks": sorted({NETWORK} & networks)}


def remove_all(objects: list[dict[str, Any]], *, secret_files: bool = True) -> dict[str, list[str]]:
    """Remove what leftovers() finds, and the pods' folders (the secret volumes' and subPath files too, unless
    told not to: the render stage writes them, tests/k8s removes the pods before it plays them); returns what it
    found."""
    found = leftovers(objects)
    if found["pods"]:
        remove_pods(found["pods"])
    for kind, cmd in (("volumes", ("volume", "rm", "--force")), ("secrets", ("secret", "rm")),
                      ("networks", ("network", "rm", "--force"))):
        if found[kind]:
            podman(*cmd, *found[kind], check=False, timeout=60)
    remove_empty_dirs(secrets=secret_files)
    return found


# --- images -----------------------------------------------------------------------------------------------

def image_id(tool: Callable[..., subprocess.CompletedProcess[str]], name: str) -> str | None:
    result = tool("image", "inspect", "--format", "{{.Id}}", name, check=False)
    return result.stdout.strip().removeprefix("sha256:") if result.returncode == 0 else None


def copy_images(images: list[str]) -> str:
    """docker's images into podman's store, unless podman has the same image (its ID: the config's digest)."""
    done = []
    for name in images:
        wanted = image_id(compose_test.docker, name)
        if wanted is None:
            raise StageError(f"docker has no image {name}")
        if image_id(podman, name) == wanted:
            done.append(f"{name} present")
            continue
        podman("pull", "--quiet", f"docker-daemon:{name}", timeout=600, log=LOGS / "images.log")
        if image_id(podman, name) != wanted:
            raise StageError(f"podman's copy of {name} is not docker's image {wanted[:12]}")
        done.append(f"{name} copied ({wanted[:12]})")
    return "; ".join(done)


# --- the run ----------------------------------------------------------------------------------------------

def sigterm_to_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tests/k8s/driver.py", description=__doc__.split("\n")[0])
    parser.add_argument("--mutate", choices=MUTATIONS, help="play manifests with this mistake: the run must fail")
    options = parser.parse_args(argv)
    signal.signal(signal.SIGTERM, sigterm_to_exit)
    stages, engine, stack = Stages("k8s-test"), Engine(), Stack()
    shm_before = compose_test.shm_entries()
    LOGS.mkdir(parents=True, exist_ok=True)
    for old in LOGS.glob("*.log"):
        old.unlink()
    objects: list[dict[str, Any]] = []

    def body() -> None:
        nonlocal objects
        with stages.stage("tools") as d:
            d.append(ensure_podman())
            d.append(" ".join(Path(c).name if i == 0 else c for i, c in enumerate(kustomize_command())))
            d.append(compose_test.ensure_tools())
        with stages.stage("render") as d:
            objects = render()
            d.append(f"kustomize: {len(objects)} objects ({', '.join(sorted({o['kind'] for o in objects}))})")
            if options.mutate:
                objects, what = mutate(objects, options.mutate)
                d.append(f"MUTATED ({options.mutate}): {what}")
            remove_all(objects)  # a run that was killed may have left its pods
            subnet = ensure_network()
            played, plan, needed = play_version(objects, stack=stack, network=NETWORK, subnet=subnet,
                                                model_repository=compose_test.STANDIN_REPO)
            dump(objects, CACHE / "rendered.yaml")
            dump(played, PLAY_FILE)
            plan.save()
            d.append(f"played as {PLAY_FILE.relative_to(ROOT)}: {len(plan.changes)} play-only changes (docs)")
        compose_test.build_images(stages, engine, stack, only=needed)
        with stages.stage("podman") as d:
            d.append(copy_images(sorted(set(plan.images.values()))))
            d.append(engine.stop())
        with stages.stage("pods") as d:
            # The probes' own deadlines bound each test (Triton's start: 300 s).
            compose_test.run_suite("tests/k8s", "K8S_PODS", LOGS / "pods.log", "-rP", "-o", "timeout=900")
            d.append(f"{len(of_kind(objects, 'Deployment'))} pods checked")

    return compose_test.run_stages(stages, body, lambda: cleanup(stages, engine, objects, shm_before))


def cleanup(stages: Stages, engine: Engine, objects: list[dict[str, Any]], shm_before: set[str]) -> int:
    try:
        with stages.stage("cleanup") as d:
            if objects and shutil.which("podman"):
                left = remove_all(objects)
                if any(left.values()):
                    d.append(f"removed {({k: v for k, v in left.items() if v})}")
                after = leftovers(objects)
                if any(after.values()):
                    raise StageError(f"could not remove {after}")
                d.append(f"no pod, container, volume, secret or network of {NETWORK} left")
            if engine.process is not None:  # the podman stage stops it once the images are copied
                d.append(engine.stop())
            d.append(release_podman_locks())
            new_shm = sorted(compose_test.shm_entries() - shm_before)
            d.append(f"/dev/shm on the host: {len(new_shm)} new entries of other processes" if new_shm
                     else "/dev/shm on the host: nothing new")
    except (StageError, subprocess.TimeoutExpired):
        engine.stop()
        return 1
    return 0


def release_podman_locks() -> str:
    """podman keeps its lock table in /dev/shm/libpod_lock, one lock per container, pod and volume. With none of
    them left on this machine, nothing holds one: the file is removed (the next podman command makes it again)."""
    lock = Path("/dev/shm/libpod_lock")
    if not lock.exists() or shutil.which("podman") is None:
        return "no podman lock table in /dev/shm"
    held = [name for kind in (("ps", "--all"), ("pod", "ps"), ("volume", "ls"))
            for name in podman(*kind, "--quiet", check=False).stdout.split()]
    if held:
        return f"/dev/shm/libpod_lock kept: podman holds {len(held)} other containers, pods or volumes"
    lock.unlink()
    return "/dev/shm/libpod_lock removed (podman holds nothing)"


def iter_containers(objects: list[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
    for d in of_kind(objects, "Deployment"):
        for c in pod_spec(d)["containers"]:
            yield d, c


if __name__ == "__main__":
    sys.exit(main())
