"""What a kubelet does with a pod's containers, done to the pods podman plays (tests/k8s; make k8s-test).

podman 4.3 runs the containers but none of this: it turns a livenessProbe into a healthcheck that curls
`localhost:<port number>` (0 for a named port) and needs systemd timers to run at all, and it ignores startup
and readiness probes, preStop hooks and terminationGracePeriodSeconds. So each is done here as a kubelet does
it, from the manifest as rendered:

* HTTP probes: GET http://<pod IP>:<port><path>, the port resolved by name from the container's ports, with
  the kubelet's headers, timeoutSeconds as the timeout; success is a status from 200 to 399. The request goes
  to the pod's published port on 127.0.0.1, which podman forwards to <pod IP>:<port>: what the pod's server
  sees is a connection to its own address, as from a kubelet (a server bound to 127.0.0.1 fails it).
* exec probes and preStop hooks: `podman exec` of the command in the container, timeoutSeconds as the limit.
* startupProbe first (liveness and readiness wait for it); it fails after failureThreshold failures
  periodSeconds apart. Readiness is retried until the pod is ready; a livenessProbe fails after
  failureThreshold consecutive failures, where a kubelet would restart the container.
* A container that exits or restarts while we wait fails at once (what `kubectl get pods` shows as an Error or
  CrashLoopBackOff), with its log.
"""

from __future__ import annotations

import difflib
import http.client
import json
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tests.k8s import driver as k8s_test
from tests.k8s.driver import Plan, container_name, container_port, named, of_kind, pod_name, pod_spec, podman

PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
KUBE_PROBE_AGENT = "kube-probe/1.32"  # what kubelet 1.32 sends


@dataclass(frozen=True)
class Target:
    """One container of one played pod."""

    deployment: dict[str, Any]
    container: dict[str, Any]

    @property
    def deployment_name(self) -> str:
        return str(self.deployment["metadata"]["name"])

    @property
    def name(self) -> str:
        return container_name(self.deployment_name, self.container["name"])

    @property
    def label(self) -> str:
        return f"{self.deployment_name}/{self.container['name']}"


class Pods:
    """The played manifests and the plan, with what tests ask of podman about them."""

    def __init__(self, played: list[dict[str, Any]], plan: Plan) -> None:
        self.played = played
        self.plan = plan

    @classmethod
    def load(cls) -> Pods:
        return cls([d for d in yaml.safe_load_all(k8s_test.PLAY_FILE.read_text()) if d], Plan.load())

    def deployment(self, name: str) -> dict[str, Any]:
        return named(self.played, "Deployment", name)

    def deployments(self) -> list[dict[str, Any]]:
        return of_kind(self.played, "Deployment")

    def targets(self, deployment: str | None = None) -> list[Target]:
        return [Target(d, c) for d in self.deployments() for c in pod_spec(d)["containers"]
                if deployment in (None, d["metadata"]["name"])]

    def target(self, deployment: str, container: str) -> Target:
        (found,) = [t for t in self.targets(deployment) if t.container["name"] == container]
        return found

    def url(self, deployment: str, port: int, path: str) -> str:
        return f"http://127.0.0.1:{self.plan.host_ports[deployment][str(port)]}{path}"

    def inspect(self, target: Target) -> dict[str, Any]:
        data: list[dict[str, Any]] = json.loads(podman("container", "inspect", target.name, timeout=30).stdout)
        return data[0]

    def exec(self, target: Target, *cmd: str, timeout: float = 30,
             check: bool = True) -> subprocess.CompletedProcess[str]:
        """`podman exec`; with `check`, a failure is an AssertionError that says what the container is doing."""
        result = podman("exec", target.name, *cmd, timeout=timeout, check=False)
        if check and result.returncode != 0:
            fail_if_not_running(self, target)  # a container that stopped says so, with its command and log
            raise AssertionError(f"`{' '.join(cmd)}` in {target.label} failed (exit {result.returncode}): "
                                 f"{(result.stdout + result.stderr)[-500:]}")
        return result

    def logs(self, target: Target, tail: int = 30) -> str:
        result = podman("logs", "--tail", str(tail), target.name, check=False, timeout=30)
        return (result.stdout + result.stderr).strip()  # podman logs writes the container's stderr to its own

    def save_logs(self, path: Path) -> None:
        with path.open("a") as out:
            for target in self.targets():
                out.write(f"\n===== {target.label} ({target.name})\n")
                result = podman("logs", "--timestamps", target.name, check=False, timeout=60)
                out.write(result.stdout + result.stderr)


# --- containers as they run -------------------------------------------------------------------------------

def fail_if_not_running(pods: Pods, target: Target) -> dict[str, Any]:
    """The container's inspect data; AssertionError with its log if it exited or was restarted."""
    data = pods.inspect(target)
    state = data["State"]
    if data["RestartCount"] or state["Status"] != "running":
        argv = " ".join(oci_config(data)["process"]["args"])
        raise AssertionError(f"{target.label} is {state['Status']} (exit code {state['ExitCode']}, restarted "
                             f"{data['RestartCount']} times); it ran `{argv}`; its log:\n{pods.logs(target)}")
    return data


def oci_config(data: dict[str, Any]) -> dict[str, Any]:
    """The OCI runtime configuration podman handed runc: the exact argv, env, user and mounts it started."""
    config: dict[str, Any] = json.loads(Path(data["OCIConfigPath"]).read_text())
    return config


def image_config(image: str) -> dict[str, Any]:
    config: dict[str, Any] = json.loads(podman("image", "inspect", image, timeout=30).stdout)[0]["Config"]
    return config


def expected_argv(container: dict[str, Any]) -> list[str]:
    """What a kubelet starts: `command` replaces the image's ENTRYPOINT, `args` its CMD (and a `command` without
    `args` drops the CMD)."""
    image = image_config(container["image"])
    entrypoint = container.get("command") or image.get("Entrypoint") or []
    cmd = container["args"] if "args" in container else [] if "command" in container else image.get("Cmd") or []
    return [*entrypoint, *cmd]


def expected_env(container: dict[str, Any]) -> dict[str, str]:
    """The env entries with a plain value (a secretKeyRef marked optional, with no Secret, sets nothing)."""
    return {e["name"]: str(e["value"]) for e in container.get("env", []) if "value" in e}


def run_as_user(deployment: dict[str, Any], container: dict[str, Any]) -> int | None:
    for context in (container.get("securityContext", {}), pod_spec(deployment).get("securityContext", {})):
        if "runAsUser" in context:
            return int(context["runAsUser"])
    return None


def process_status(pods: Pods, target: Target) -> dict[str, str]:
    lines = pods.exec(target, "cat", "/proc/1/status").stdout.splitlines()
    return {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in lines if ":" in line)}


def check_started_as_written(pods: Pods, target: Target) -> None:
    """The container runs its own command, env, user and security context, as the manifest states them."""
    data = fail_if_not_running(pods, target)
    config = oci_config(data)
    container = target.container
    argv = expected_argv(container)
    assert config["process"]["args"] == argv, \
        f"{target.label} started `{' '.join(config['process']['args'])}`, not `{' '.join(argv)}`"
    # The environment runc started the container's process with (nginx overwrites its own /proc/1/environ with
    # its process title, so that file cannot say).
    env = dict(item.split("=", 1) for item in config["process"].get("env", []))
    wrong = {k: env.get(k) for k, v in expected_env(container).items() if env.get(k) != v}
    assert not wrong, f"{target.label} was started with {wrong}, not the manifest's {expected_env(container)}"
    status = process_status(pods, target)
    uid = run_as_user(target.deployment, container)
    if uid is not None:
        assert status["Uid"].split()[0] == str(uid), f"{target.label} runs as uid {status['Uid']}, not {uid}"
    context = container.get("securityContext", {})
    if "ALL" in context.get("capabilities", {}).get("drop", []):
        assert int(status["CapEff"], 16) == 0, f"{target.label} keeps capabilities {status['CapEff']}"
    if context.get("readOnlyRootFilesystem"):
        assert config["root"].get("readonly") is True, f"{target.label}'s root filesystem is writable"
        probe = pods.exec(target, "touch", "/k8s-test-write", check=False)
        assert probe.returncode != 0, f"{target.label} could write to its root filesystem"
    if context.get("allowPrivilegeEscalation") is False:
        assert status["NoNewPrivs"] == "1", f"{target.label} may gain privileges (NoNewPrivs {status['NoNewPrivs']})"


def check_env_names(pods: Pods, target: Target, names_read: Callable[[Pods, Target], set[str] | None]) -> None:
    """Each env name the manifest sets is one the container's program reads (where we can ask it)."""
    known = names_read(pods, target)
    if known is None:
        return
    unknown = sorted(set(expected_env(target.container)) - known)
    hints = {name: difflib.get_close_matches(name, sorted(known), n=1) for name in unknown}
    assert not unknown, f"{target.label} sets env names its program does not read: " + ", ".join(
        f"{name}{f' (did you mean {hint[0]}?)' if hint else ''}" for name, hint in hints.items())


# --- probes -------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ProbeResult:
    ok: bool
    detail: str


def describe(target: Target, kind: str) -> str:
    probe = target.container[kind]
    if "httpGet" in probe:
        get = probe["httpGet"]
        return f"{target.label}'s {kind} GET :{get['port']}{get.get('path', '/')}"
    if "exec" in probe:
        return f"{target.label}'s {kind} exec {' '.join(probe['exec']['command'])}"
    return f"{target.label}'s {kind} {sorted(probe)}"


def probe_once(pods: Pods, target: Target, kind: str) -> ProbeResult:
    probe = target.container[kind]
    timeout = float(probe.get("timeoutSeconds", 1))
    if "httpGet" in probe:
        get = probe["httpGet"]
        port = container_port(target.container, get["port"])
        ip = pods.plan.pod_ips[target.deployment_name]
        host_port = pods.plan.host_ports[target.deployment_name][str(port)]
        headers = {"Host": f"{ip}:{port}", "User-Agent": KUBE_PROBE_AGENT, "Accept": "*/*", "Connection": "close"}
        headers.update({h["name"]: h["value"] for h in get.get("httpHeaders", [])})
        conn = http.client.HTTPConnection("127.0.0.1", host_port, timeout=timeout)
        try:
            conn.request("GET", get.get("path", "/"), headers=headers)
            response = conn.getresponse()
            body = response.read(200)
        except (OSError, http.client.HTTPException) as e:
            return ProbeResult(False, f"{type(e).__name__}: {e}")
        finally:
            conn.close()
        return ProbeResult(200 <= response.status < 400, f"HTTP {response.status} {body.decode(errors='replace')}")
    if "exec" in probe:
        try:
            result = pods.exec(target, *probe["exec"]["command"], timeout=timeout, check=False)
        except subprocess.TimeoutExpired:
            return ProbeResult(False, f"timed out after {timeout:.0f} s")
        return ProbeResult(result.returncode == 0, f"exit {result.returncode} {result.stdout[-200:]}")
    raise AssertionError(f"{describe(target, kind)}: only httpGet and exec probes are played here")


def poll(pods: Pods, target: Target, kind: str, *, attempts: int, consecutive: bool,
         others: list[Target]) -> tuple[int, ProbeResult]:
    """Probe every periodSeconds until it succeeds or `attempts` failures; fail at once if a container stops."""
    probe = target.container[kind]
    period = float(probe.get("periodSeconds", 10))
    failures, result = 0, ProbeResult(False, "not run")
    while failures < attempts:
        started = time.monotonic()
        result = probe_once(pods, target, kind)
        if result.ok:
            return failures, result
        failures += 1
        for other in others:
            fail_if_not_running(pods, other)
        if failures < attempts:
            time.sleep(max(0.0, period - (time.monotonic() - started)))
    what = "consecutive failures: a kubelet restarts the container" if consecutive else "failures"
    raise AssertionError(f"{describe(target, kind)} failed: {failures} {what}; last: {result.detail}; "
                         f"its log:\n{pods.logs(target)}")


def wait_ready(pods: Pods, deployments: list[str], readiness_deadline_s: float) -> dict[str, str]:
    """Every container of these pods through its probes as a kubelet runs them; what each probe answered."""
    targets = [t for t in pods.targets() if t.deployment_name in deployments]
    report = {}
    for target in targets:
        fail_if_not_running(pods, target)
    for target in (t for t in targets if "startupProbe" in t.container):
        probe = target.container["startupProbe"]
        time.sleep(float(probe.get("initialDelaySeconds", 0)))
        failed, result = poll(pods, target, "startupProbe", attempts=int(probe.get("failureThreshold", 3)),
                              consecutive=False, others=targets)
        report[describe(target, "startupProbe")] = f"{result.detail[:60]} after {failed} failures"
    deadline = time.monotonic() + readiness_deadline_s
    for target in (t for t in targets if "readinessProbe" in t.container):
        probe = target.container["readinessProbe"]
        attempts = max(1, int((deadline - time.monotonic()) / float(probe.get("periodSeconds", 10))))
        failed, result = poll(pods, target, "readinessProbe", attempts=attempts, consecutive=False, others=targets)
        report[describe(target, "readinessProbe")] = f"{result.detail[:60]} after {failed} failures"
    for target in (t for t in targets if "livenessProbe" in t.container):
        probe = target.container["livenessProbe"]
        failed, result = poll(pods, target, "livenessProbe", attempts=int(probe.get("failureThreshold", 3)),
                              consecutive=True, others=targets)
        report[describe(target, "livenessProbe")] = f"{result.detail[:60]} after {failed} failures"
    for target in targets:
        fail_if_not_running(pods, target)
    return report


# --- stopping -------------------------------------------------------------------------------------------------

def stop_pod(pods: Pods, deployment: str) -> tuple[float, dict[str, int]]:
    """Delete the pod as a kubelet does: every preStop hook (in parallel), then the stop signal (the image's
    STOPSIGNAL, SIGTERM by default), SIGKILL when terminationGracePeriodSeconds (default 30) has run out, counted
    from the start. Returns the seconds it took and each container's exit code (137: killed)."""
    spec = pod_spec(pods.deployment(deployment))
    grace = float(spec.get("terminationGracePeriodSeconds", 30))
    targets = pods.targets(deployment)
    started = time.monotonic()
    hooks = [subprocess.Popen(["podman", "exec", t.name, *t.container["lifecycle"]["preStop"]["exec"]["command"]],
                              env=k8s_test.podman_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for t in targets if "exec" in t.container.get("lifecycle", {}).get("preStop", {})]
    for hook in hooks:
        try:
            hook.wait(timeout=max(0.1, grace - (time.monotonic() - started)))
        except subprocess.TimeoutExpired:
            hook.kill()
            hook.wait()
    left = max(1, int(grace - (time.monotonic() - started)))
    podman("pod", "stop", "--time", str(left), pod_name(deployment), timeout=grace + 60)
    took = time.monotonic() - started
    codes = {t.container["name"]: int(pods.inspect(t)["State"]["ExitCode"]) for t in targets}
    return took, codes
