"""What operators read, as files: the alert rules (promtool and their unit tests), every PromQL expression
(promql-parser), the dashboard's panels. tests/integration/test_observability.py checks the metrics they
use against live scrapes of the shim and of a real Triton."""

from __future__ import annotations

import pytest

from tests.deploy_support import (
    DASHBOARD,
    GRAFANA,
    PROMETHEUS,
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


def test_the_error_and_capacity_alerts_read_nginxs_answers_where_nginx_is_in_front() -> None:
    rules = {r["alert"]: str(r["expr"]) for r in alert_rules()}
    for name in ("ShimHighErrorRate", "ShimOverloaded"):
        metrics = {s.metric for s in parse_selectors(rules[name])[0]}
        assert {"shim_proxy_responses_total", "shim_requests_total"} <= metrics, name
        assert " or" in rules[name], f"{name}: nginx's answers, or the shim's where no nginx is in front"
    assert 'reason="overloaded"' in rules["ShimOverloaded"]
    assert "client_limit" in rules["ShimClientsRefused"] and "client_timeout" in rules["ShimClientsRefused"]


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
            "shim_shadow_comparisons_total", "shim_batch_size_sum", "shim_traffic_mode",
            "shim_proxy_responses_total"} <= used
    assert any("histogram_quantile(0.99" in e for e in panel_exprs)
    assert any("histogram_quantile(0.5" in e for e in panel_exprs)
    assert any('result="mismatch"' in e for e in panel_exprs)
    assert any("by (backend)" in e and "shim_requests_total" in e for e in panel_exprs)
    # nginx's answers where nginx is in front (its refusals never reach the shim), the shim's otherwise.
    (share,) = [e for e in panel_exprs if 'status=~"5.."' in e]
    assert "shim_proxy_responses_total" in share and " or " in share and "shim_requests_total" in share
    assert any("shim_proxy_responses_total" in e and "by (reason)" in e for e in panel_exprs)
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


def test_gunicorn_builds_no_access_line_that_its_logger_would_drop() -> None:
    """app/gunicorn_conf.py's logger: the access logger is at WARNING (app/logs.py), so a request costs no
    access-line atoms; set it to INFO and the line is built and written again."""
    import logging

    from gunicorn.config import Config

    from app.gunicorn_logger import QuietAccessLogger
    from app.logs import gunicorn_logconfig

    root, access = logging.getLogger(), logging.getLogger("gunicorn.access")
    saved = (root.level, list(root.handlers), access.level, list(access.handlers), access.propagate)
    try:
        cfg = Config()
        cfg.set("logconfig_dict", gunicorn_logconfig("INFO"))
        logger = QuietAccessLogger(cfg)  # applies the logconfig, as in a worker
        built: list[str] = []
        logger.atoms = lambda *args: built.append("atoms") or {}  # type: ignore[method-assign]
        logger.access(None, None, {}, None)
        assert built == []
        access.setLevel(logging.INFO)
        logger.access(None, None, {}, None)
        assert built == ["atoms"]
    finally:  # the logconfig changed this process's loggers: put them back
        root.level, root.handlers, access.level, access.handlers, access.propagate = saved
