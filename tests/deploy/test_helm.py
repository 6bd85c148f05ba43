"""The Helm chart: every `ci/*-values.yaml` scenario renders, passes the Kubernetes schemas and
keeps the chart's promises (secrets only in Secrets, probes on the admin port, locked-down
containers, a loopback sidecar upstream, a drain that fits the grace period).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jsonschema
import pytest
import yaml

from idemproxy.config.settings import Settings, load_settings, parse_listen
from idemproxy.proxy.idp.policy import build_owner_policy

from .chart import (
    CHART,
    Manifest,
    container_port,
    containers,
    fullname,
    of_kind,
    one,
    pod_specs,
    prestop_seconds,
    proxy_config,
    proxy_container,
    proxy_pod,
    render,
    settings_file,
)

pytestmark = pytest.mark.slow

KUBE_VERSION = "1.34.0"
SECRET_KEYS = ("store", "adminToken", "redis")


def secret_values(values: dict[str, Any], manifests: list[Manifest]) -> set[str]:
    """Every secret string the scenario holds, and the passwords inside its URLs."""
    found = {str(values["secrets"][key]) for key in SECRET_KEYS if values["secrets"].get(key)}
    for secret in of_kind(manifests, "Secret"):
        found |= {base64.b64decode(v).decode() for v in secret.get("data", {}).values()}
    found |= {urlsplit(v).password or "" for v in found if "://" in v}
    return {value for value in found if value}


def test_renders_valid_kubernetes_objects(scenario: str, rendered_files: dict[str, Path]) -> None:
    validator = Path(sys.executable).parent / "kubernetes-validate"
    checked = subprocess.run(
        [str(validator), "--strict", "-k", KUBE_VERSION, "--quiet", str(rendered_files[scenario])],
        capture_output=True,
        text=True,
        check=False,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_values_pass_the_schema_with_another_validator(values: dict[str, Any]) -> None:
    """Helm 3.18+ validates with another library than the renderer here: jsonschema too."""
    schema = json.loads((CHART / "values.schema.json").read_text())
    validator = jsonschema.validators.validator_for(schema)
    validator.check_schema(schema)
    validator(schema).validate(values)


def test_no_secret_value_in_any_config_map(
    values: dict[str, Any], manifests: list[Manifest]
) -> None:
    secrets = secret_values(values, manifests)
    assert secrets or values["secrets"]["existingSecret"]
    for config_map in of_kind(manifests, "ConfigMap"):
        text = yaml.safe_dump(config_map)
        assert not [secret for secret in secrets if secret in text]
    config = proxy_config(manifests)
    assert "store" not in config
    assert "redis" not in config
    assert "token" not in config["admin"]


def test_secrets_reach_the_proxy_only_through_secret_refs(
    values: dict[str, Any], manifests: list[Manifest]
) -> None:
    name = values["secrets"]["existingSecret"] or fullname(values)
    env = {e["name"]: e for e in proxy_container(manifests)["env"]}
    for variable, key in [
        ("IDEMPROXY_STORE", "store"),
        ("IDEMPROXY_ADMIN__TOKEN", "admin-token"),
        ("IDEMPROXY_REDIS__URL", "redis"),
    ]:
        assert "value" not in env[variable]
        ref = env[variable]["valueFrom"]["secretKeyRef"]
        assert (ref["name"], ref["key"]) == (name, key)
    secrets = of_kind(manifests, "Secret")
    assert len(secrets) == (0 if values["secrets"]["existingSecret"] else 1)
    if values["secrets"]["redis"]:
        assert "redis" in secrets[0]["data"]


def test_config_map_is_a_valid_settings_file(
    manifests: list[Manifest], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rendered file, plus the pod's variables and mounts, loads through the real settings
    model, and the owner's keys (a mounted JWKS, an HMAC secret from a Secret, the CA of an
    identity provider) load too."""
    settings = _load_as_the_pod_would(manifests, tmp_path, monkeypatch)
    proxy = proxy_container(manifests)
    assert parse_listen(settings.listen)[1] == container_port(proxy, "http")
    assert parse_listen(settings.admin.listen)[1] == container_port(proxy, "admin")
    build_owner_policy(settings.owner)


# What the ConfigMaps the scenarios mount (made outside the chart) hold in these tests.
MOUNTED_SOURCES = {
    "idemproxy-jwks": Path(__file__).parent / "files" / "jwks",
    "idemproxy-idp-ca": Path(__file__).parent / "files" / "idp-ca",
    "idemproxy-contracts": CHART.parents[1] / "config" / "contracts",
}
CHART_VARIABLES = {
    "IDEMPROXY_CONFIG",
    "IDEMPROXY_STORE",
    "IDEMPROXY_ADMIN__TOKEN",
    "IDEMPROXY_REDIS__URL",
}


def test_the_redis_options_may_go_in_the_config_map(
    helm_template: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only the URL of the `redis:` block is a secret; its options are plain settings."""
    values = str(CHART / "ci" / "with-redis-values.yaml")
    result = render(helm_template, "-f", values, "--set", "proxy.config.redis.timeout=0.1")
    assert result.returncode == 0, result.stderr
    manifests = [doc for doc in yaml.safe_load_all(result.stdout) if doc]
    assert _load_as_the_pod_would(manifests, tmp_path, monkeypatch).redis.timeout == 0.1


def _load_as_the_pod_would(
    manifests: list[Manifest], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Settings:
    for variable in [name for name in os.environ if name.startswith("IDEMPROXY_")]:
        monkeypatch.delenv(variable)
    monkeypatch.setenv("IDEMPROXY_STORE", "postgresql://idemproxy@postgres:5432/idemproxy")
    monkeypatch.setenv("IDEMPROXY_ADMIN__TOKEN", "from-the-secret")
    proxy = proxy_container(manifests)
    for variable in proxy["env"]:
        if variable["name"] not in CHART_VARIABLES:
            value = variable.get("value", f"{variable['name']} from its secret, 32 bytes or more")
            monkeypatch.setenv(variable["name"], value)
    text = settings_file(manifests)
    volumes = {volume["name"]: volume for volume in proxy_pod(manifests)["volumes"]}
    for mount in proxy["volumeMounts"]:
        if mount["name"] not in ("config", "tmp"):
            where = tmp_path / "mounts" / mount["mountPath"].lstrip("/")
            _fill_mount(volumes[mount["name"]], where)
            text = text.replace(mount["mountPath"], str(where))
    path = tmp_path / "idemproxy.yaml"
    path.write_text(text)
    return load_settings(path)


def _fill_mount(volume: Manifest, where: Path) -> None:
    """The files Kubernetes would put in a configMap volume's mount, from MOUNTED_SOURCES."""
    source = MOUNTED_SOURCES[volume["configMap"]["name"]]
    where.mkdir(parents=True)
    items = volume["configMap"].get("items") or [
        {"key": file.name, "path": file.name} for file in source.iterdir()
    ]
    for item in items:
        shutil.copyfile(source / item["key"], where / item["path"])


def test_probes_hit_the_admin_port(manifests: list[Manifest]) -> None:
    proxy = proxy_container(manifests)
    admin_port = parse_listen(proxy_config(manifests)["admin"]["listen"])[1]
    probes = [
        ("startupProbe", "/healthz"),
        ("livenessProbe", "/healthz"),
        ("readinessProbe", "/readyz"),
    ]
    for probe, path in probes:
        get = proxy[probe]["httpGet"]
        assert get["path"] == path
        assert container_port(proxy, get["port"]) == admin_port


def test_every_container_is_locked_down(manifests: list[Manifest]) -> None:
    for owner, pod in pod_specs(manifests):
        assert pod["automountServiceAccountToken"] is False, owner
        assert pod["securityContext"]["runAsNonRoot"] is True, owner
        for container in containers(pod):
            where = f"{owner}/{container['name']}"
            context = container["securityContext"]
            assert context["runAsNonRoot"] is True, where
            assert context["readOnlyRootFilesystem"] is True, where
            assert context["allowPrivilegeEscalation"] is False, where
            assert context["capabilities"] == {"drop": ["ALL"]}, where
            assert context["seccompProfile"] == {"type": "RuntimeDefault"}, where
            assert container["resources"]["requests"], where
            assert container["resources"]["limits"]["memory"], where


def test_grace_period_outlasts_prestop_and_drain(manifests: list[Manifest]) -> None:
    pod = proxy_pod(manifests)
    [prestop] = [prestop_seconds(c) for c in containers(pod) if "lifecycle" in c]
    config = proxy_config(manifests)
    drain = config["server"]["shutdown_timeout"]
    store_timeout = config.get("pool", {}).get("store_timeout", 5)  # the proxy's default
    assert pod["terminationGracePeriodSeconds"] > prestop + drain + store_timeout


def test_service_selects_only_serving_pods(manifests: list[Manifest]) -> None:
    selector = one(manifests, "Service")["spec"]["selector"].items()
    deployment = one(manifests, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert selector <= deployment.items()
    for job in of_kind(manifests, "Job"):
        assert not selector <= job["spec"]["template"]["metadata"]["labels"].items()


def test_metrics_port_only_with_the_service_monitor(
    values: dict[str, Any], manifests: list[Manifest]
) -> None:
    ports = {p["name"]: p for p in one(manifests, "Service")["spec"]["ports"]}
    monitors = of_kind(manifests, "ServiceMonitor")
    if not values["metrics"]["serviceMonitor"]["enabled"]:
        assert (set(ports), monitors) == ({"http"}, [])
        return
    [monitor] = monitors
    [endpoint] = monitor["spec"]["endpoints"]
    wanted = values["metrics"]["serviceMonitor"]
    options = {"scrapeTimeout", "relabelings", "metricRelabelings"}
    given = {key: wanted[key] for key in options if wanted[key]}
    assert endpoint == {
        "port": "admin",
        "path": "/metrics",
        "interval": wanted["interval"],
        **given,
    }
    assert ports["admin"]["targetPort"] == "admin"
    assert wanted["labels"].items() <= monitor["metadata"]["labels"].items()


def test_migrations_hook_or_migrate_at_start(
    values: dict[str, Any], manifests: list[Manifest]
) -> None:
    jobs = of_kind(manifests, "Job")
    assert proxy_config(manifests)["migrate"] is not values["migrations"]["hook"]
    if not values["migrations"]["hook"]:
        assert jobs == []
        return
    [job] = jobs
    annotations = job["metadata"]["annotations"]
    assert annotations["helm.sh/hook"] == "pre-install,pre-upgrade"
    [migrate] = job["spec"]["template"]["spec"]["containers"]
    assert migrate["args"] == ["migrate"]
    for secret in of_kind(manifests, "Secret"):  # it must exist before the Job runs
        secret_weight = int(secret["metadata"]["annotations"]["helm.sh/hook-weight"])
        assert secret_weight < int(annotations["helm.sh/hook-weight"])


def test_sidecar_forwards_to_the_app_on_loopback(
    helm_template: Path, rendered_files: dict[str, Path]
) -> None:
    manifests = list(yaml.safe_load_all(rendered_files["sidecar-values.yaml"].read_text()))
    app_port = yaml.safe_load((CHART / "ci" / "sidecar-values.yaml").read_text())["app"]["port"]
    pod = proxy_pod(manifests)
    [proxy] = pod["initContainers"]
    [app] = pod["containers"]
    assert proxy["restartPolicy"] == "Always"  # a native sidecar
    assert proxy_config(manifests)["upstream"] == f"http://127.0.0.1:{app_port}"
    assert container_port(app, "app") == app_port
    [service_port] = one(manifests, "Service")["spec"]["ports"]
    assert container_port(proxy, service_port["targetPort"]) == container_port(proxy, "http")


def test_standalone_autoscales_instead_of_fixing_replicas(
    rendered_files: dict[str, Path],
) -> None:
    manifests = list(yaml.safe_load_all(rendered_files["standalone-values.yaml"].read_text()))
    deployment = one(manifests, "Deployment")
    assert "replicas" not in deployment["spec"]
    target = one(manifests, "HorizontalPodAutoscaler")["spec"]["scaleTargetRef"]
    assert (target["kind"], target["name"]) == ("Deployment", deployment["metadata"]["name"])
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--set-string", "replicas=many"], "replicas: Invalid type. Expected: integer"),
        (["--set", "mode=daemon"], 'mode: mode must be one of the following: "standalone"'),
        (["--set", "secrets.store=sqlite:///idemproxy.db"], "secrets.store: Does not match"),
        (["--set", "proxy.adminPort=70000"], "proxy.adminPort: Must be less than or equal"),
        (["--set", "no_such_value=1"], "Additional property no_such_value is not allowed"),
        (
            ["--set", "proxy.config.store=postgresql://u:p@db/x"],
            "proxy.config.store: secrets never go in the ConfigMap",
        ),
        (
            ["--set", "proxy.config.admin.token=abc"],
            "proxy.config.admin.token: secrets never go in the ConfigMap",
        ),
        (
            ["--set", "proxy.config.redis.url=redis://:p@cache:6379/0"],
            "proxy.config.redis.url: secrets never go in the ConfigMap",
        ),
        (
            ["--set", "proxy.config.redis=redis://:p@cache:6379/0"],
            "proxy.config.redis.url: secrets never go in the ConfigMap",
        ),
        (["--set", "secrets.adminToken="], "secrets.adminToken: the admin listener"),
        (["--set", "mode=sidecar"], "app.image.repository: sidecar mode needs"),
        (["--set", "drain.shutdownTimeout=60"], "drain.terminationGracePeriodSeconds: must be"),
        (  # 5 + 25 + 10 = 40: the writes after the drain would be killed
            ["--set", "proxy.config.pool.store_timeout=10"],
            "drain.terminationGracePeriodSeconds: must be",
        ),
    ],
)
def test_bad_values_are_refused_with_a_clear_message(
    helm_template: Path, args: list[str], message: str
) -> None:
    result = render(helm_template, "-f", str(CHART / "ci" / "with-redis-values.yaml"), *args)
    assert result.returncode == 1
    assert message in result.stderr
