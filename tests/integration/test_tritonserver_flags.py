"""The tritonserver options that docker-compose.yml and deploy/k8s/triton.yaml give NGC's image, checked against
the wheel's own tritonserver (the same 2.51 / 24.10 release): `tritonserver --help` lists every option and the
APIs that --http-restricted-api takes.

make compose-test and make k8s-test run the wheel's server through devstack, not these command
lines (NGC's image cannot be had here), so a misspelt option would first show on a GPU host: this catches it.
"""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest
import yaml

from devstack.wheel import find_wheel, server_environment

pytestmark = pytest.mark.triton
ROOT = Path(__file__).resolve().parents[2]
RESTRICTED = ("--http-restricted-api", "--grpc-restricted-protocol")


@pytest.fixture(scope="module")
def server_help() -> str:
    wheel = find_wheel()
    answer = subprocess.run([str(wheel.binary), "--help"], capture_output=True, text=True, timeout=60,
                            env=server_environment(), check=False)
    text = answer.stdout + answer.stderr
    assert "Usage: tritonserver" in text, text[:500]
    return text


def known_options(server_help: str) -> set[str]:
    return set(re.findall(r"^\s+(--[a-z0-9-]+)", server_help, flags=re.MULTILINE))


def restricted_apis(server_help: str) -> set[str]:
    (listed,) = set(re.findall(r"Allowed APIs:\s*([a-z, \n\t-]+)", server_help))
    return {api.strip() for api in listed.replace("\n", " ").split(",") if api.strip()}


def mistakes(args: list[str], server_help: str) -> list[str]:
    """What in these tritonserver arguments the server would refuse: unknown options, unknown restricted APIs."""
    options, apis, wrong = known_options(server_help), restricted_apis(server_help), []
    for arg in args:
        if not arg.startswith("--"):
            continue
        name, _, value = arg.partition("=")
        if name not in options:
            wrong.append(f"{name}: tritonserver has no such option")
        elif name in RESTRICTED:
            listed = value.split(":", 1)[0].split(",")
            wrong += [f"{name}: no API named {api!r} (allowed: {', '.join(sorted(apis))})"
                      for api in listed if api not in apis]
    return wrong


def k8s_triton_args() -> list[str]:
    for doc in yaml.safe_load_all((ROOT / "deploy" / "k8s" / "triton.yaml").read_text()):
        if doc and doc.get("kind") == "Deployment":
            (container,) = [c for c in doc["spec"]["template"]["spec"]["containers"] if c["name"] == "triton"]
            args: list[str] = [*container.get("command", []), *container.get("args", [])]
            return args
    raise AssertionError("deploy/k8s/triton.yaml has no Deployment")


def compose_triton_args() -> list[str]:
    """The triton service's command, and the options its key script appends (read from the script's text)."""
    command = yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]["triton"]["command"]
    script = command[2] if command[:2] == ["sh", "-c"] else ""
    appended = [a for a in shlex.split(script.replace("\\\n", " "), comments=True) if a.startswith("--")]
    return [*command[3:], *appended] if script else list(command)


@pytest.mark.parametrize("source", ["deploy/k8s/triton.yaml", "docker-compose.yml"])
def test_every_tritonserver_option_the_deployments_give_is_one_the_server_knows(server_help: str, source: str) -> None:
    args = k8s_triton_args() if source.startswith("deploy") else compose_triton_args()
    assert "tritonserver" in args and sum(a.startswith("--") for a in args) >= 4, args
    assert any(a.startswith(RESTRICTED) for a in args), f"{source}: Triton's admin APIs are not restricted"
    assert not mistakes(args, server_help), f"{source}: {mistakes(args, server_help)}"


def test_a_misspelt_option_or_api_is_named(server_help: str) -> None:
    args = ["tritonserver", "--model-repository=/models", "--model-contol-mode=explicit",
            "--http-restricted-api=model-repository,shared-mem:triton-admin-key=k"]
    found = mistakes(args, server_help)
    assert found == ["--model-contol-mode: tritonserver has no such option",
                     f"--http-restricted-api: no API named 'shared-mem' (allowed: "
                     f"{', '.join(sorted(restricted_apis(server_help)))})"], found
    assert {"model-repository", "shared-memory", "trace", "logging"} <= restricted_apis(server_help)
