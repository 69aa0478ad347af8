"""What operators watch: the alert rules and the dashboard, the metrics they read, counts and request IDs.

The rules go through promtool (config, rules and their unit tests) and every PromQL expression through
promql-parser; then every metric they use must be in a live scrape of the shim under gunicorn and of a
real Triton, except the GPU families a CPU Triton cannot export, which are checked against Triton's docs.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from app import promtext
from app.embedded_triton import EmbeddedTriton
from tests.deploy_support import (
    DASHBOARD,
    GRAFANA,
    PROMETHEUS,
    adapter_query,
    adapter_rules,
    alert_rules,
    compose,
    dashboard,
    dashboard_panels,
    expressions,
    parse_selectors,
    promtool,
    run,
    yaml_docs,
)
from tests.support import encode, photo
from tools.launch import ServedApp

# Triton's GPU metrics as its documentation lists them (triton-inference-server/server,
# docs/user_guide/metrics.md, "GPU Metrics" table). Triton without a GPU (as in make test) exports none.
TRITON_DOCUMENTED_GPU_METRICS = {
    "nv_gpu_power_usage", "nv_gpu_power_limit", "nv_energy_consumption",
    "nv_gpu_utilization", "nv_gpu_memory_total_bytes", "nv_gpu_memory_used_bytes",
}
# The one list of exceptions: GPU-only metrics the dashboard, alerts and adapter rules use.
GPU_ONLY = {"nv_gpu_utilization", "nv_gpu_memory_used_bytes"}
PROMETHEUS_SYNTHETIC = {"up"}  # series Prometheus writes for each target itself: never in a scrape
TARGET_LABELS = {"job", "instance"}  # labels Prometheus adds to every scraped series
SEED_PANEL = 'sum(rate(nv_inference_request_success{model="resnet50"}[1m])) by (model)'


def test_promtool_accepts_the_config_and_rules_and_the_alert_unit_tests_pass() -> None:
    promtool_bin = promtool()
    for args in (["check", "config", "prometheus.yml"], ["check", "rules", "alerts.yml"],
                 ["test", "rules", "alerts.test.yml"]):
        result = run(promtool_bin, *args, cwd=PROMETHEUS)
        assert result.returncode == 0, f"promtool {' '.join(args)}:\n{result.stdout}{result.stderr}"


def test_promql_parser_rejects_broken_promql() -> None:
    with pytest.raises(ValueError):
        parse_selectors("sum(rate(shim_requests_total[1m])")


def test_every_rule_has_a_valid_expression_a_severity_and_a_summary() -> None:
    rules = alert_rules()
    assert {"ShimHighErrorRate", "ShimHighP99Latency", "TritonInferenceFailures"} <= {r["alert"] for r in rules}
    for rule in rules:
        selectors, _ = parse_selectors(rule["expr"])
        assert selectors, rule["alert"]
        assert rule["labels"]["severity"] in {"page", "warning"}, rule["alert"]
        assert rule["annotations"]["summary"], rule["alert"]
    # The scrape jobs the `up` rules name are the ones prometheus.yml defines.
    (config,) = yaml_docs(PROMETHEUS / "prometheus.yml")
    jobs = {job["job_name"] for job in config["scrape_configs"]}
    assert jobs == {"shim", "triton"}
    assert {t for job in config["scrape_configs"] for c in job["static_configs"] for t in c["targets"]} == \
        {"shim:5000", "triton:8002"}


def test_the_dashboard_has_the_panels_operators_watch_on_the_provisioned_datasource() -> None:
    exprs = expressions()
    panel_exprs = [e for where, e in exprs.items() if where.startswith("panel")]
    assert SEED_PANEL in panel_exprs
    used = {s.metric for e in panel_exprs for s in parse_selectors(e)[0]}
    assert {"nv_inference_queue_duration_us", "nv_inference_compute_infer_duration_us", "nv_gpu_utilization",
            "shim_requests_total", "shim_request_duration_seconds_bucket", "shim_fallbacks_total",
            "shim_shadow_comparisons_total", "shim_batch_size_sum", "shim_traffic_mode"} <= used
    assert any("histogram_quantile(0.99" in e for e in panel_exprs)
    assert any("histogram_quantile(0.5" in e for e in panel_exprs)
    assert any('result="mismatch"' in e for e in panel_exprs)
    assert any("by (backend)" in e and "shim_requests_total" in e for e in panel_exprs)
    # Panels use the datasource Grafana is provisioned with, from the folder compose mounts.
    (datasources,) = yaml_docs(GRAFANA / "provisioning" / "datasources" / "prometheus.yml")
    uids = {d["uid"] for d in datasources["datasources"]}
    panels = [p for p in dashboard_panels() if p["type"] != "row"]
    assert {p["datasource"]["uid"] for p in panels} <= uids
    assert {t["datasource"]["uid"] for p in panels for t in p["targets"]} <= uids
    ids = [p["id"] for p in dashboard_panels()]
    assert len(ids) == len(set(ids))
    (providers,) = yaml_docs(GRAFANA / "provisioning" / "dashboards" / "flask-triton-shim.yml")
    (provider,) = providers["providers"]
    mounts = dict(v.rsplit(":", 1)[0].split(":", 1) for v in compose()["services"]["grafana"]["volumes"]
                  if v.startswith("./"))
    assert mounts["./" + str(DASHBOARD.parent.relative_to(GRAFANA.parent.parent))] == provider["options"]["path"]
    assert dashboard()["uid"] and dashboard()["title"]


def scrape(url: str) -> dict[str, set[str]]:
    """Sample names in a scrape, names as exposed (Triton's counters have no _total), with their label names."""
    return promtext.label_names(promtext.scrape(url))


def predict(base_url: str, jpeg: bytes, request_ids: Iterable[str]) -> list[requests.Response]:
    def one(request_id: str) -> requests.Response:
        return requests.post(base_url + "/predict", files={"image": ("photo.jpg", jpeg)},
                             headers={"X-Request-ID": request_id}, timeout=120)

    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(one, request_ids))


@pytest.mark.triton
def test_every_metric_the_dashboard_alerts_and_adapter_use_is_exported(shim_triton: ServedApp,
                                                                       triton: EmbeddedTriton) -> None:
    answers = predict(shim_triton.url, encode(photo(320, 240, seed=5)), [f"scrape-{i}" for i in range(4)])
    assert [a.status_code for a in answers] == [200] * 4
    scraped = {**scrape(shim_triton.url + "/metrics"), **scrape(triton.metrics_url)}
    queries = {**expressions(), **{f"adapter rule {r['name']['as']}": adapter_query(r) for r in adapter_rules()}}
    gpu_used: set[str] = set()
    for where, expr in queries.items():
        selectors, grouping = parse_selectors(expr)
        metrics = {s.metric for s in selectors}
        gpu_used |= metrics & GPU_ONLY
        for selector in selectors:
            if selector.metric in GPU_ONLY | PROMETHEUS_SYNTHETIC:
                continue
            assert selector.metric in scraped, f"{where}: {selector.metric} is in no scrape of the shim or Triton"
            extra = selector.labels - scraped[selector.metric] - TARGET_LABELS - {"namespace", "pod"}
            assert not extra, f"{where}: {selector.metric} has no label {sorted(extra)}"
        if not metrics & (GPU_ONLY | PROMETHEUS_SYNTHETIC):
            available = set().union(*(scraped[m] for m in metrics)) | TARGET_LABELS | {"namespace", "pod"}
            assert grouping <= available, f"{where}: grouped by {sorted(grouping - available)}, which no series has"
    # The exceptions are exactly the GPU metrics in use, documented by Triton and absent without a GPU.
    assert gpu_used == GPU_ONLY
    assert GPU_ONLY <= TRITON_DOCUMENTED_GPU_METRICS
    assert not GPU_ONLY & set(scraped)
    assert {m for m in scraped if m.startswith("nv_inference_")}, "Triton's scrape has no inference metrics"


def requests_total(url: str) -> float:
    return promtext.total(promtext.scrape(url + "/metrics"), "shim_requests_total")


def log_lines(served: ServedApp) -> list[dict[str, object]]:
    lines = []
    for line in served.log_path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                lines.append(json.loads(line))
            except ValueError:
                continue
    return lines


@pytest.mark.triton
def test_the_request_counter_counts_every_request_whichever_worker_answered(shim_triton: ServedApp) -> None:
    jpeg = encode(photo(320, 240, seed=7))
    before = requests_total(shim_triton.url)
    sent: list[str] = []
    workers: set[object] = set()
    for _ in range(4):  # the kernel hands connections to either worker: a few rounds reach both
        ids = [f"count-{uuid.uuid4().hex}" for _ in range(40)]
        assert {a.status_code for a in predict(shim_triton.url, jpeg, ids)} == {200}
        sent += ids
        mine = set(ids)
        workers |= {line["pid"] for line in log_lines(shim_triton) if line.get("request_id") in mine}
        if len(workers) == 2:
            break
    assert requests_total(shim_triton.url) - before == len(sent)
    assert len(workers) == 2, f"one worker answered all {len(sent)} requests: {workers}"


@pytest.mark.triton
def test_a_client_request_id_comes_back_and_is_in_the_log_line_of_its_request(shim_triton: ServedApp) -> None:
    request_id = f"client-{uuid.uuid4().hex}"
    (answer,) = predict(shim_triton.url, encode(photo(200, 150, seed=3)), [request_id])
    assert answer.status_code == 200 and answer.headers["X-Request-ID"] == request_id
    lines = [line for line in log_lines(shim_triton) if line.get("request_id") == request_id]
    assert [line["message"] for line in lines] == ["POST /predict 200"], lines
    assert lines[0]["status"] == 200 and isinstance(lines[0]["pid"], int)


@pytest.mark.triton
def test_every_line_the_shim_writes_is_json_gunicorns_and_warnings_included(shim_legacy: ServedApp,
                                                                             shim_triton: ServedApp) -> None:
    loggers = set()
    for served in (shim_legacy, shim_triton):
        for line in served.log_path.read_text().splitlines():
            entry = json.loads(line)  # a plain-text line fails here
            assert {"ts", "level", "logger", "message", "pid"} <= set(entry), entry
            loggers.add(entry["logger"])
    assert "gunicorn.error" in loggers, loggers  # the master's and workers' own lines
    assert "py.warnings" in loggers, loggers  # torch's FutureWarning when the legacy model loads
