"""Reading the deployment files in tests: YAML documents, manifests, PromQL and the metric names in it."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import promql_parser
import pytest
import yaml

from devstack import proxy
from tests.support import ROOT

COMPOSE = ROOT / "docker-compose.yml"
DOCKERFILES = [ROOT / "Dockerfile", ROOT / "docker" / "triton.Dockerfile"]
K8S = ROOT / "deploy" / "k8s"
PROMETHEUS = ROOT / "deploy" / "prometheus"
GRAFANA = ROOT / "deploy" / "grafana"
DASHBOARD = GRAFANA / "dashboards" / "flask-triton-shim.json"
BIN = Path(sys.executable).parent  # the virtualenv's bin/: check-jsonschema, hadolint, kubernetes-validate


def run(*cmd: str | Path, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=120, check=False)


def tool(name: str) -> Path:
    path = BIN / name
    assert path.exists(), f"{name} is missing: run `make install` (it comes with the dev extra)"
    return path


def promtool() -> Path:
    """promtool from `make promtool` (or PATH). Missing: skip, except under CI, where make test installs it."""
    local = ROOT / ".cache" / "tools" / "promtool"
    found = local if local.exists() else shutil.which("promtool")
    if found is None:
        if os.environ.get("CI"):
            pytest.fail("promtool is missing: `make promtool` unpacks it from Debian's prometheus package")
        pytest.skip("promtool is missing: run `make promtool` (needs apt-get)")
    return Path(found)


def yaml_docs(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def compose() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(COMPOSE.read_text())
    return data


def k8s_manifests() -> list[Path]:
    return sorted(p for p in K8S.rglob("*.yaml") if p.name != "kustomization.yaml")


def k8s_objects() -> list[dict[str, Any]]:
    return [doc for path in k8s_manifests() for doc in yaml_docs(path)]


def k8s_object(kind: str, name: str) -> dict[str, Any]:
    (found,) = [o for o in k8s_objects() if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def container(deployment: dict[str, Any], name: str | None = None) -> dict[str, Any]:
    """A Deployment's container called `name`, by default the one named like the Deployment (the shim's pod
    also runs the proxy)."""
    wanted = name or deployment["metadata"]["name"]
    (found,) = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == wanted]
    return dict(found)


def containers(deployment: dict[str, Any]) -> list[dict[str, Any]]:
    return list(deployment["spec"]["template"]["spec"]["containers"])


def adapter_rules() -> list[dict[str, Any]]:
    (configmap,) = yaml_docs(K8S / "prometheus-adapter" / "rules.yaml")
    rules: list[dict[str, Any]] = yaml.safe_load(configmap["data"]["config.yaml"])["rules"]
    return rules


def adapter_query(rule: dict[str, Any]) -> str:
    """A rule's metricsQuery as the adapter sends it for two pods (its Go template filled in)."""
    series = series_name(rule["seriesQuery"])
    return (rule["metricsQuery"].replace("<<.Series>>", series)
            .replace("<<.LabelMatchers>>", 'namespace="inference",pod=~"a|b"').replace("<<.GroupBy>>", "pod"))


def series_name(series_query: str) -> str:
    match = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)\{", series_query)
    assert match, f"seriesQuery {series_query!r} should start with a metric name"
    return match.group(1)


def alert_rules() -> list[dict[str, Any]]:
    (doc,) = yaml_docs(PROMETHEUS / "alerts.yml")
    return [rule for group in doc["groups"] for rule in group["rules"]]


def dashboard() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return data


def dashboard_panels() -> list[dict[str, Any]]:
    panels = dashboard()["panels"]
    return [p for top in panels for p in [top, *top.get("panels", [])]]


def expressions() -> dict[str, str]:
    """Every PromQL expression of the alert rules and the dashboard, by where it is."""
    found = {f"alert {r['alert']}": str(r["expr"]) for r in alert_rules()}
    for panel in dashboard_panels():
        for target in panel.get("targets", []):
            found[f"panel {panel['title']!r} {target['refId']}"] = target["expr"]
    return found


@dataclass(frozen=True)
class Selector:
    metric: str
    labels: frozenset[str]  # label names its matchers use


def parse_selectors(expr: str) -> tuple[list[Selector], set[str]]:
    """The metrics an expression reads (with the labels it matches on) and the labels it aggregates by."""
    tree = promql_parser.parse(expr)  # raises ValueError on a syntax error
    selectors: list[Selector] = []
    grouping: set[str] = set()

    def visit(node: object) -> None:
        if isinstance(node, promql_parser.VectorSelector):
            assert node.name, f"{expr}: select metrics by name, not by a __name__ matcher"
            selectors.append(Selector(node.name, frozenset(m.name for m in node.matchers.matchers)))
        if isinstance(node, promql_parser.AggregateExpr) and node.modifier is not None:
            grouping.update(node.modifier.labels)

    promql_parser.walk(tree, visit)
    return selectors, grouping


def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """A Dockerfile's instructions, with `${ARG:-default}` as docker expands it when no build argument is given."""
    text = re.sub(r"\\\n\s*", " ", path.read_text())
    text = re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", text)
    return [(line.split()[0].upper(), line.split(None, 1)[1]) for line in text.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def probe(c: dict[str, Any], kind: str) -> tuple[str, int]:
    get = c[kind]["httpGet"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    return get["path"], ports.get(get["port"], get["port"])


def nginx_or_skip() -> None:
    """Skip where there is no nginx (`make nginx`), but fail under CI, where make test unpacks it."""
    if proxy.nginx_binary() is None:
        if os.environ.get("CI"):
            pytest.fail(proxy.MISSING)
        pytest.skip(proxy.MISSING)


def env_of(c: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: str(e.get("value", "")) for e in c.get("env", [])}


TRITON_ADMIN_HEADER = "triton-admin-key"  # SHIM_TRITON_ADMIN_HEADER's default: the header the shim sends


def triton_command(command: list[str]) -> tuple[str, list[str]]:
    """docker-compose.yml's Triton command, `sh -c SCRIPT NAME ARGS...`: the script and the command it runs."""
    assert command[:2] == ["sh", "-c"] and len(command) > 4, command
    return command[2], command[4:]


_RESTRICTED = re.compile(r"--(http-restricted-api|grpc-restricted-protocol)=([a-z,-]+):([A-Za-z0-9:-]+)=(\S+)")


def restricted_groups(text: str) -> dict[str, dict[frozenset[str], tuple[str, str]]]:
    """Triton's restricted API groups in a command (script or args): by protocol (http, grpc), each group's
    APIs -> (header, value as written: a shell or Kubernetes variable)."""
    found: dict[str, dict[frozenset[str], tuple[str, str]]] = {"http": {}, "grpc": {}}
    for flag, apis, header, value in _RESTRICTED.findall(text):
        found["http" if flag.startswith("http") else "grpc"][frozenset(apis.split(","))] = (header, value.strip('"\\'))
    return found
