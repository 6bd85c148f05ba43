"""What an SRE reaches for in the chart: probes to tune, a ServiceMonitor or PodMonitor that
bends, the alerts of docs/operations.md as a PrometheusRule and the dashboard for Grafana's
sidecar; the Prometheus Operator's objects only when its API is in the cluster."""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from prometheus_client import generate_latest

from idemproxy.admin.peers import merge_metrics
from idemproxy.observe.metrics import Metrics, watch_redis

from .chart import (
    CHART,
    MONITORING_API,
    Manifest,
    of_kind,
    one,
    proxy_container,
    render,
    render_manifests,
    scenario_values,
)

pytestmark = pytest.mark.slow

DOCS = Path(__file__).parents[2] / "docs"
MONITORED = str(CHART / "ci" / "with-servicemonitor-values.yaml")
POD_MONITORED = str(CHART / "ci" / "with-podmonitor-values.yaml")
_METRIC_NAME = re.compile(r"\b((?:idemproxy|process|python)_[a-z_]+)\b")


def _manifests(rendered_files: dict[str, Path], scenario: str) -> list[Manifest]:
    return [doc for doc in yaml.safe_load_all(rendered_files[scenario].read_text()) if doc]


def _exposed_series() -> set[str]:
    """Every series name a proxy's /metrics shows once each histogram has an observation, also
    under --workers (idemproxy_worker_up)."""
    metrics = Metrics()
    metrics.upstream_seconds.labels("answered", "http://a:80").observe(0.1)
    metrics.request_seconds.labels("new", "/", "2xx", "upstream").observe(0.1)
    metrics.observe_store("claim", 0.001, False)
    watch_redis(metrics, SimpleNamespace(up=True, pending_drops=0))  # with `redis.url`
    text = generate_latest(metrics.registry).decode()
    merged = merge_metrics([text, text]).decode()
    return {
        re.split(r"[{ ]", line)[0]
        for line in merged.splitlines()
        if line and not line.startswith("#")
    }


def _series_named(expression: str) -> set[str]:
    """The metric names an expression reads (a histogram's _bucket or _count included)."""
    return set(_METRIC_NAME.findall(expression))


def _anchors(markdown: str) -> set[str]:
    """GitHub's anchors of the markdown's headings."""
    headings = re.findall(r"^#+ (.+)$", markdown, flags=re.MULTILINE)
    return {re.sub(r"[^a-z0-9 _-]", "", h.lower()).replace(" ", "-") for h in headings}


def test_monitoring_objects_need_the_operator_api(helm_template: Path) -> None:
    """Without monitoring.coreos.com/v1 in the cluster, nothing it cannot take is rendered, and
    the Service gets no admin port for a monitor that is not there."""
    for values in (MONITORED, POD_MONITORED):
        manifests = render_manifests(helm_template, "-f", values)
        kinds = {doc["kind"] for doc in manifests}
        assert not kinds & {"ServiceMonitor", "PodMonitor", "PrometheusRule"}
        ports = [port["name"] for port in one(manifests, "Service")["spec"]["ports"]]
        assert ports == ["http"]


def test_every_alert_has_for_severity_and_a_runbook(rendered_files: dict[str, Path]) -> None:
    manifests = _manifests(rendered_files, "with-servicemonitor-values.yaml")
    rule = one(manifests, "PrometheusRule")
    values = scenario_values("with-servicemonitor-values.yaml")["metrics"]["prometheusRule"]
    assert values["labels"].items() <= rule["metadata"]["labels"].items()
    [group] = rule["spec"]["groups"]
    alerts = {entry["alert"]: entry for entry in group["rules"]}
    assert "IdemproxyReplayLatencyHigh" not in alerts  # disabled
    assert alerts["IdemproxyRequestsStopped"] == values["extraRules"][0]
    ours = [entry for name, entry in alerts.items() if name != "IdemproxyRequestsStopped"]
    assert len(ours) >= 8
    anchors = _anchors((DOCS / "operations.md").read_text())
    exposed = _exposed_series()
    for entry in ours:
        assert re.fullmatch(r"[0-9]+[smh]", entry["for"]), entry
        assert entry["labels"]["severity"] in {"critical", "warning", "info"}
        base, _, anchor = entry["annotations"]["runbook_url"].partition("#")
        assert base == values["runbookBaseUrl"]
        assert anchor == entry["alert"].lower() and anchor in anchors, anchor
        assert entry["annotations"]["summary"] and entry["annotations"]["description"]
        named = _series_named(entry["expr"])
        assert named and named <= exposed, entry["expr"]
        # Scoped to this release's series, every one of them.
        for selector in re.findall(r"(?:idemproxy|process)_[a-z_]+\{([^}]*)\}", entry["expr"]):
            assert 'namespace="default", job=~"idemproxy|default/idemproxy"' in selector
        assert entry["expr"].count("(") == entry["expr"].count(")")


def test_error_rate_alert_reads_the_status_class(rendered_files: dict[str, Path]) -> None:
    rule = one(_manifests(rendered_files, "with-servicemonitor-values.yaml"), "PrometheusRule")
    [error_rate] = [
        entry
        for entry in rule["spec"]["groups"][0]["rules"]
        if entry["alert"] == "IdemproxyErrorRateHigh"
    ]
    assert 'status_class="5xx"' in error_rate["expr"]
    assert error_rate["expr"].endswith("> 0.01")


def test_alert_options(helm_template: Path, tmp_path: Path) -> None:
    options = tmp_path / "options.yaml"
    rule = {"errorRateThreshold": 0.05, "selector": 'cluster="eu"'}
    options.write_text(yaml.safe_dump({"metrics": {"prometheusRule": rule}}))
    manifests = render_manifests(
        helm_template, "-f", MONITORED, "-f", str(options), *MONITORING_API
    )
    rules = one(manifests, "PrometheusRule")["spec"]["groups"][0]["rules"]
    [error_rate] = [entry for entry in rules if entry["alert"] == "IdemproxyErrorRateHigh"]
    assert error_rate["expr"].endswith("> 0.05")
    assert 'idemproxy_requests_total{cluster="eu", status_class="5xx"}' in error_rate["expr"]


def test_alerts_need_a_runbook_base(helm_template: Path) -> None:
    result = render(
        helm_template,
        "-f",
        MONITORED,
        *MONITORING_API,
        "--set",
        "metrics.prometheusRule.runbookBaseUrl=",
    )
    assert result.returncode != 0
    assert "metrics.prometheusRule.runbookBaseUrl" in result.stderr


def test_dashboard_is_a_config_map_for_grafanas_sidecar(rendered_files: dict[str, Path]) -> None:
    manifests = _manifests(rendered_files, "with-servicemonitor-values.yaml")
    [config_map] = [
        doc
        for doc in of_kind(manifests, "ConfigMap")
        if doc["metadata"]["name"].endswith("-dashboard")
    ]
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["annotations"] == {"grafana_folder": "idemproxy"}
    dashboard = json.loads(config_map["data"]["idemproxy.json"])
    variables = {variable["name"]: variable for variable in dashboard["templating"]["list"]}
    assert set(variables) == {"datasource", "namespace", "job", "instance"}
    assert variables["datasource"]["type"] == "datasource"
    exposed = _exposed_series()
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        for target in panel["targets"]:
            expression = target["expr"]
            assert _series_named(expression) <= exposed, expression
            assert ("[5m]" not in expression and "$__rate_interval" in expression) or (
                "rate(" not in expression and "increase(" not in expression
            )
            # Every series the panel reads is scoped by the three variables.
            for name in _METRIC_NAME.finditer(expression):
                after = expression[name.end() :]
                assert after.startswith(
                    '{job=~"$job", namespace=~"$namespace", instance=~"$instance"'
                ), expression


def test_pod_monitor_autoscaler_behaviour_and_probes(rendered_files: dict[str, Path]) -> None:
    manifests = _manifests(rendered_files, "with-podmonitor-values.yaml")
    values: dict[str, Any] = scenario_values("with-podmonitor-values.yaml")
    monitor = one(manifests, "PodMonitor")
    [endpoint] = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint == {"port": "admin", "path": "/metrics", "interval": "30s"}
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    assert of_kind(manifests, "ServiceMonitor") == []
    ports = [port["name"] for port in one(manifests, "Service")["spec"]["ports"]]
    assert ports == ["http"]  # a PodMonitor scrapes the pods, not the Service
    hpa = one(manifests, "HorizontalPodAutoscaler")
    assert hpa["spec"]["behavior"] == values["autoscaling"]["behavior"]
    proxy = proxy_container(manifests)
    assert proxy["livenessProbe"]["periodSeconds"] == 20  # merged over the default
    assert proxy["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert proxy["startupProbe"]["failureThreshold"] == 150


def test_a_probe_can_be_replaced_or_dropped(helm_template: Path) -> None:
    manifests = render_manifests(
        helm_template,
        "-f",
        POD_MONITORED,
        "--set",
        "proxy.startupProbe=null,proxy.livenessProbe.httpGet=null,"
        "proxy.livenessProbe.tcpSocket.port=admin",
    )
    proxy = proxy_container(manifests)
    assert "startupProbe" not in proxy
    assert proxy["livenessProbe"]["tcpSocket"] == {"port": "admin"}
    assert "httpGet" not in proxy["livenessProbe"]


def test_one_monitor_not_both(helm_template: Path) -> None:
    result = render(
        helm_template, "-f", MONITORED, *MONITORING_API, "--set", "metrics.podMonitor.enabled=true"
    )
    assert result.returncode != 0
    assert "enable one, not both" in result.stderr
