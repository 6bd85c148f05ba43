"""The Helm chart: every `ci/*-values.yaml` scenario renders, passes the Kubernetes schemas and
keeps the chart's promises (secrets only in Secrets, probes on the admin port, locked-down
containers, a loopback sidecar upstream, a drain that fits the grace period).

Rendering uses helm-template, the offline stand-in for `helm template` from the shared tools
(`HELM_TEMPLATE_DIR`, default `../shared/tools/helm-template` next to the repository), built once
per session into the git-ignored `build/`.
"""

from __future__ import annotations

import base64
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from idemproxy.config import Settings, load_settings, parse_listen

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parents[2]
CHART = ROOT / "helm" / "idemproxy"
SCENARIOS = sorted(path.name for path in (CHART / "ci").glob("*-values.yaml"))
KUBE_VERSION = "1.34.0"
SECRET_KEYS = ("store", "adminToken", "redis")

Manifest = dict[str, Any]


@pytest.fixture(scope="session")
def helm_template() -> Path:
    tool = Path(
        os.environ.get("HELM_TEMPLATE_DIR", ROOT.parent / "shared" / "tools" / "helm-template")
    )
    binary = ROOT / "build" / "helm-template"
    binary.parent.mkdir(exist_ok=True)
    # The build script installs the Debian packages it needs; never build into the tools folder.
    built = subprocess.run(
        ["sh", str(tool / "build"), str(binary)], capture_output=True, text=True, check=False
    )
    if built.returncode != 0:
        pytest.fail(f"building helm-template failed:\n{built.stderr}")
    return binary


def render(helm_template: Path, *args: str) -> subprocess.CompletedProcess[str]:
    command = [str(helm_template), "idemproxy", str(CHART), *args]
    return subprocess.run(command, capture_output=True, text=True, check=False)


@pytest.fixture(scope="session")
def rendered_files(
    helm_template: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("rendered")
    files = {}
    for scenario in SCENARIOS:
        result = render(helm_template, "-f", str(CHART / "ci" / scenario))
        assert result.returncode == 0, f"{scenario}: {result.stderr}"
        files[scenario] = out / scenario
        files[scenario].write_text(result.stdout)
    return files


@pytest.fixture(params=SCENARIOS)
def scenario(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def manifests(scenario: str, rendered_files: dict[str, Path]) -> list[Manifest]:
    return [doc for doc in yaml.safe_load_all(rendered_files[scenario].read_text()) if doc]


@pytest.fixture
def values(scenario: str) -> dict[str, Any]:
    merged = yaml.safe_load((CHART / "values.yaml").read_text())
    _deep_merge(merged, yaml.safe_load((CHART / "ci" / scenario).read_text()))
    return merged


def _deep_merge(base: dict[str, Any], override: dict[str, Any]) -> None:
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _deep_merge(base[key], value)
        else:
            base[key] = value


def of_kind(manifests: list[Manifest], kind: str) -> list[Manifest]:
    return [doc for doc in manifests if doc["kind"] == kind]


def one(manifests: list[Manifest], kind: str) -> Manifest:
    [doc] = of_kind(manifests, kind)
    return doc


def pod_specs(manifests: list[Manifest]) -> Iterator[tuple[str, Manifest]]:
    for doc in manifests:
        if doc["kind"] in ("Deployment", "Job"):
            yield doc["metadata"]["name"], doc["spec"]["template"]["spec"]


def containers(pod: Manifest) -> list[Manifest]:
    return [*pod.get("initContainers", []), *pod["containers"]]


def proxy_container(manifests: list[Manifest]) -> Manifest:
    pod = one(manifests, "Deployment")["spec"]["template"]["spec"]
    [proxy] = [c for c in containers(pod) if c["name"] == "idemproxy"]
    return proxy


def container_port(container: Manifest, port: int | str) -> int:
    if isinstance(port, int):
        return port
    [number] = [p["containerPort"] for p in container["ports"] if p["name"] == port]
    return int(number)


def proxy_config(manifests: list[Manifest]) -> dict[str, Any]:
    config: dict[str, Any] = yaml.safe_load(one(manifests, "ConfigMap")["data"]["idemproxy.yaml"])
    return config


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
    name = values["secrets"]["existingSecret"] or "idemproxy"
    env = {e["name"]: e for e in proxy_container(manifests)["env"]}
    for variable, key in [
        ("IDEMPROXY_STORE", "store"),
        ("IDEMPROXY_ADMIN__TOKEN", "admin-token"),
        ("IDEMPROXY_REDIS", "redis"),
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
    """The rendered file, plus the Secret's variables, loads through the real settings model."""
    settings = _load_as_the_pod_would(manifests, tmp_path, monkeypatch)
    proxy = proxy_container(manifests)
    assert parse_listen(settings.listen)[1] == container_port(proxy, "http")
    assert parse_listen(settings.admin.listen)[1] == container_port(proxy, "admin")


def _load_as_the_pod_would(
    manifests: list[Manifest], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Settings:
    for variable in [name for name in os.environ if name.startswith("IDEMPROXY_")]:
        monkeypatch.delenv(variable)
    monkeypatch.setenv("IDEMPROXY_STORE", "postgresql://idemproxy@postgres:5432/idemproxy")
    monkeypatch.setenv("IDEMPROXY_ADMIN__TOKEN", "from-the-secret")
    path = tmp_path / "idemproxy.yaml"
    path.write_text(one(manifests, "ConfigMap")["data"]["idemproxy.yaml"])
    return load_settings(path)


def test_probes_hit_the_admin_port(manifests: list[Manifest]) -> None:
    proxy = proxy_container(manifests)
    admin_port = parse_listen(proxy_config(manifests)["admin"]["listen"])[1]
    for probe, path in [("livenessProbe", "/healthz"), ("readinessProbe", "/readyz")]:
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
    pod = one(manifests, "Deployment")["spec"]["template"]["spec"]
    sleeps = [
        int(c["lifecycle"]["preStop"].get("sleep", {}).get("seconds", 0))
        + int(c["lifecycle"]["preStop"].get("exec", {}).get("command", ["sleep", "0"])[1])
        for c in containers(pod)
        if "lifecycle" in c
    ]
    assert len(sleeps) == 1
    drain = proxy_config(manifests)["server"]["shutdown_timeout"]
    assert pod["terminationGracePeriodSeconds"] > sleeps[0] + drain


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
    assert endpoint == {"port": "admin", "path": "/metrics", "interval": "15s"}
    assert ports["admin"]["targetPort"] == "admin"
    assert monitor["metadata"]["labels"]["release"] == "prometheus"


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
    pod = one(manifests, "Deployment")["spec"]["template"]["spec"]
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
        (["--set", "secrets.adminToken="], "secrets.adminToken: the admin listener"),
        (["--set", "mode=sidecar"], "app.image.repository: sidecar mode needs"),
        (["--set", "drain.shutdownTimeout=60"], "drain.terminationGracePeriodSeconds: must be"),
    ],
)
def test_bad_values_are_refused_with_a_clear_message(
    helm_template: Path, args: list[str], message: str
) -> None:
    result = render(helm_template, "-f", str(CHART / "ci" / "with-redis-values.yaml"), *args)
    assert result.returncode == 1
    assert message in result.stderr
