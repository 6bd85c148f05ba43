"""The chart's extension points: what each value asks for is in the rendered manifests (env from
Secrets, mounted files where the settings look for them, the ServiceAccount the pods run as,
names, labels and placement, the NetworkPolicy's rules), and values that would take over the
chart's own variables, volumes or mounts are refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from idemproxy.cli.main import _parser

from .chart import (
    CHART,
    Manifest,
    fullname,
    migrate_pod,
    of_kind,
    one,
    proxy_config,
    proxy_container,
    proxy_pod,
    render,
    render_manifests,
    scenario_values,
)

pytestmark = pytest.mark.slow

BASE = str(CHART / "ci" / "with-redis-values.yaml")


def scenario_manifests(rendered_files: dict[str, Path], scenario: str) -> list[Manifest]:
    return [doc for doc in yaml.safe_load_all(rendered_files[scenario].read_text()) if doc]


def by_name(items: list[Manifest]) -> dict[str, Manifest]:
    return {item["name"]: item for item in items}


def migrate_container(manifests: list[Manifest]) -> Manifest:
    pod = migrate_pod(manifests)
    assert pod is not None
    [container] = pod["containers"]
    found: Manifest = container
    return found


def test_env_from_existing_secrets_reaches_the_proxy_and_the_migration(
    rendered_files: dict[str, Path],
) -> None:
    manifests = scenario_manifests(rendered_files, "secret-env-values.yaml")
    for container in (proxy_container(manifests), migrate_container(manifests)):
        env = by_name(container["env"])
        ref = env["JWT_HMAC_SECRET"]["valueFrom"]["secretKeyRef"]
        assert (ref["name"], ref["key"]) == ("idemproxy-jwt", "hmac-secret")
        assert env["IDEMPROXY_LOG_LEVEL"]["value"] == "info"
        assert container["envFrom"] == [{"secretRef": {"name": "idemproxy-settings"}}]
    # The chart's own variables come first, unchanged.
    names = [variable["name"] for variable in proxy_container(manifests)["env"]]
    assert names[:2] == ["IDEMPROXY_CONFIG", "IDEMPROXY_STORE"]
    key = proxy_config(manifests)["owner"]["jwt"]["key"]
    assert key == "env:JWT_HMAC_SECRET"
    assert key.removeprefix("env:") in names


def _mount_holding(container: Manifest, path: str) -> Manifest:
    [mount] = [m for m in container["volumeMounts"] if path.startswith(m["mountPath"] + "/")]
    found: Manifest = mount
    return found


def test_jwks_is_mounted_where_the_owner_settings_look(rendered_files: dict[str, Path]) -> None:
    manifests = scenario_manifests(rendered_files, "jwt-jwks-values.yaml")
    key = proxy_config(manifests)["owner"]["jwt"]["key"]
    for pod, container in [
        (proxy_pod(manifests), proxy_container(manifests)),
        (migrate_pod(manifests), migrate_container(manifests)),
    ]:
        assert pod is not None
        mount = _mount_holding(container, key)
        assert mount == {"name": "jwks", "mountPath": "/etc/jwks", "readOnly": True}
        volume = by_name(pod["volumes"])["jwks"]
        assert volume["configMap"]["name"] == "idemproxy-jwks"


def test_contract_files_are_mounted_where_the_route_looks(
    rendered_files: dict[str, Path],
) -> None:
    manifests = scenario_manifests(rendered_files, "contract-fallback-values.yaml")
    [contract] = [r["contract"] for r in proxy_config(manifests)["routes"] if "contract" in r]
    volumes = by_name(proxy_pod(manifests)["volumes"])
    for path in (contract["schema_file"], contract["samples_file"]):
        mount = _mount_holding(proxy_container(manifests), path)
        assert mount["readOnly"] is True
        config_map = volumes[mount["name"]]["configMap"]
        assert config_map["name"] == "idemproxy-contracts"
        relative = path.removeprefix(mount["mountPath"] + "/")
        assert relative in [item["path"] for item in config_map["items"]]


def test_the_pods_run_as_the_service_account(
    values: dict[str, Any], manifests: list[Manifest]
) -> None:
    wanted = values["serviceAccount"]
    accounts = of_kind(manifests, "ServiceAccount")
    job = migrate_pod(manifests)
    if wanted["create"]:
        [account] = accounts
        name = wanted["name"] or fullname(values)
        assert account["metadata"]["name"] == name
        assert account["metadata"].get("annotations", {}) == wanted["annotations"]
        assert account["automountServiceAccountToken"] is False
        # The migration hook runs before the release's ServiceAccount is made.
        assert job is None or "serviceAccountName" not in job
    else:
        assert accounts == []
        name = wanted["name"] or "default"
        assert job is None or job["serviceAccountName"] == name
    assert proxy_pod(manifests)["serviceAccountName"] == name


def test_an_existing_service_account_is_used_by_the_migration_job(
    rendered_files: dict[str, Path],
) -> None:
    manifests = scenario_manifests(rendered_files, "secret-env-values.yaml")
    assert of_kind(manifests, "ServiceAccount") == []
    job = migrate_pod(manifests)
    assert job is not None
    assert job["serviceAccountName"] == proxy_pod(manifests)["serviceAccountName"]
    assert job["serviceAccountName"] == "idemproxy-runtime"


def test_every_object_is_named_and_labelled_by_the_overrides(
    values: dict[str, Any], manifests: list[Manifest]
) -> None:
    name = fullname(values)
    label = values["nameOverride"] or "idemproxy"
    named = {"Job": f"{name}-migrate", "ServiceAccount": values["serviceAccount"]["name"] or name}
    dashboard = values["metrics"]["dashboard"]["enabled"]
    for doc in manifests:
        wanted = named.get(doc["kind"], name)
        if dashboard and doc["kind"] == "ConfigMap" and "idemproxy.json" in doc["data"]:
            wanted = f"{name}-dashboard"
        assert doc["metadata"]["name"] == wanted, doc["kind"]
        assert doc["metadata"]["labels"]["app.kubernetes.io/name"] == label, doc["kind"]
    pod = proxy_pod(manifests)
    assert by_name(pod["volumes"])["config"]["configMap"]["name"] == name
    selector = {"app.kubernetes.io/name": label, "app.kubernetes.io/instance": "idemproxy"}
    assert one(manifests, "Service")["spec"]["selector"] == selector
    assert one(manifests, "Deployment")["spec"]["selector"]["matchLabels"] == selector


def test_full_name_override_names_everything(rendered_files: dict[str, Path]) -> None:
    manifests = scenario_manifests(rendered_files, "names-and-placement-values.yaml")
    names = {(doc["kind"], doc["metadata"]["name"]) for doc in manifests}
    assert names == {
        ("ServiceAccount", "payments-idempotency"),
        ("Secret", "payments-idempotency"),
        ("ConfigMap", "payments-idempotency"),
        ("Service", "payments-idempotency"),
        ("Deployment", "payments-idempotency"),
        ("PodDisruptionBudget", "payments-idempotency"),
        ("ServiceMonitor", "payments-idempotency"),
        ("Job", "payments-idempotency-migrate"),
    }
    env = by_name(proxy_container(manifests)["env"])
    assert env["IDEMPROXY_STORE"]["valueFrom"]["secretKeyRef"]["name"] == "payments-idempotency"
    monitor = one(manifests, "ServiceMonitor")["spec"]["selector"]["matchLabels"]
    assert monitor["app.kubernetes.io/name"] == "idempotency"


@pytest.mark.parametrize(
    ("args", "name"),
    [
        (["--set", "nameOverride=gateway"], "idemproxy-gateway"),
        (["--set", "nameOverride=proxy"], "idemproxy"),  # the release name contains it
        (["--set", "fullnameOverride=" + "x" * 63], "x" * 63),
    ],
)
def test_name_overrides_keep_names_valid(helm_template: Path, args: list[str], name: str) -> None:
    manifests = render_manifests(helm_template, "-f", BASE, *args)
    assert one(manifests, "Deployment")["metadata"]["name"] == name
    job = one(manifests, "Job")["metadata"]["name"]
    assert len(job) <= 63
    assert job.endswith("-migrate")
    assert name.startswith(job.removesuffix("-migrate"))


def test_pod_labels_annotations_priority_and_spread(rendered_files: dict[str, Path]) -> None:
    scenario = "names-and-placement-values.yaml"
    values = scenario_values(scenario)
    manifests = scenario_manifests(rendered_files, scenario)
    template = one(manifests, "Deployment")["spec"]["template"]
    selector = one(manifests, "Deployment")["spec"]["selector"]["matchLabels"]
    assert template["metadata"]["labels"] == {**values["podLabels"], **selector}
    assert values["podAnnotations"].items() <= template["metadata"]["annotations"].items()
    job = one(manifests, "Job")["spec"]["template"]
    assert values["podLabels"].items() <= job["metadata"]["labels"].items()
    assert template["spec"]["priorityClassName"] == "payments-critical"
    assert job["spec"]["priorityClassName"] == "payments-critical"
    [zone, host] = template["spec"]["topologySpreadConstraints"]
    assert zone["topologyKey"] == "topology.kubernetes.io/zone"
    assert zone["labelSelector"] == {"matchLabels": selector}
    assert host["labelSelector"] == {"matchLabels": {"team": "payments"}}
    service = one(manifests, "Service")["metadata"]
    assert service["annotations"] == values["service"]["annotations"]


def test_pod_labels_never_change_what_the_selectors_pick(
    helm_template: Path, tmp_path: Path
) -> None:
    extra = tmp_path / "labels.yaml"
    extra.write_text(
        yaml.safe_dump({"podLabels": {"app.kubernetes.io/name": "other", "team": "payments"}})
    )
    manifests = render_manifests(helm_template, "-f", BASE, "-f", str(extra))
    labels = one(manifests, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert labels["app.kubernetes.io/name"] == "idemproxy"
    assert labels["team"] == "payments"
    job = one(manifests, "Job")["spec"]["template"]["metadata"]["labels"]
    assert "app.kubernetes.io/name" not in job  # the Service must not pick the Job's pod
    assert job["team"] == "payments"


def test_extra_args_follow_serve_and_parse(rendered_files: dict[str, Path]) -> None:
    scenario = "names-and-placement-values.yaml"
    args = proxy_container(scenario_manifests(rendered_files, scenario))["args"]
    assert args == ["serve", *scenario_values(scenario)["extraArgs"]]
    assert _parser().parse_args(args).log_level == "warning"


def _ports(rule: Manifest) -> set[tuple[int, str]]:
    return {(int(p["port"]), p["protocol"]) for p in rule["ports"]}


def test_network_policy_only_when_enabled(
    values: dict[str, Any], manifests: list[Manifest]
) -> None:
    policies = of_kind(manifests, "NetworkPolicy")
    if not values["networkPolicy"]["enabled"]:
        assert policies == []
        return
    [policy] = policies
    pod_labels = one(manifests, "Deployment")["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    # Only the proxy's own ports are admitted: never the app's, in sidecar mode.
    admitted = set().union(*(_ports(rule) for rule in policy["spec"]["ingress"]))
    proxy = values["proxy"]
    assert admitted <= {(proxy["port"], "TCP"), (proxy["adminPort"], "TCP")}
    # No egress rule without ports: none opens everything.
    assert all(rule["ports"] for rule in policy["spec"]["egress"])


def test_network_policy_of_a_gateway_reads_its_ports_from_the_settings(
    rendered_files: dict[str, Path],
) -> None:
    manifests = scenario_manifests(rendered_files, "contract-fallback-values.yaml")
    spec = one(manifests, "NetworkPolicy")["spec"]
    assert spec["policyTypes"] == ["Ingress", "Egress"]
    [proxy, admin] = spec["ingress"]
    assert _ports(proxy) == {(8080, "TCP")}
    ingress_nginx = {"matchLabels": {"kubernetes.io/metadata.name": "ingress-nginx"}}
    assert proxy["from"] == [{"namespaceSelector": ingress_nginx}]
    assert _ports(admin) == {(9090, "TCP")}
    monitoring = {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}
    assert admin["from"] == [{"namespaceSelector": monitoring}]
    [dns, store, upstreams] = spec["egress"]
    assert _ports(dns) == {(53, "UDP"), (53, "TCP")}
    assert dns["to"][0]["podSelector"] == {"matchLabels": {"k8s-app": "kube-dns"}}
    assert _ports(store) == {(6432, "TCP")}  # the port in secrets.store
    assert "to" not in store
    # llm-primary:8000 for the routes, the fallback's https default.
    assert _ports(upstreams) == {(8000, "TCP"), (443, "TCP")}


def test_network_policy_of_a_sidecar_uses_the_peers_given(
    rendered_files: dict[str, Path],
) -> None:
    scenario = "sidecar-network-policy-values.yaml"
    policy = scenario_values(scenario)["networkPolicy"]
    spec = one(scenario_manifests(rendered_files, scenario), "NetworkPolicy")["spec"]
    [proxy, admin] = spec["ingress"]
    assert proxy["from"] == policy["ingress"]["proxy"]["from"]
    assert admin["from"] == policy["ingress"]["admin"]["from"]
    [_dns, store, redis, app_database] = spec["egress"]
    assert (store["to"], _ports(store)) == (policy["egress"]["store"]["to"], {(5432, "TCP")})
    assert (redis["to"], _ports(redis)) == (policy["egress"]["redis"]["to"], {(6380, "TCP")})
    assert app_database == policy["egress"]["extra"][0]


def test_network_policy_defaults_with_an_existing_secret(helm_template: Path) -> None:
    """The store's port cannot be read from a Secret: 5432; Redis needs its ports given."""
    existing = str(CHART / "ci" / "existing-secret-values.yaml")
    manifests = render_manifests(
        helm_template, "-f", existing, "--set", "networkPolicy.enabled=true"
    )
    spec = one(manifests, "NetworkPolicy")["spec"]
    assert [rule.get("from") for rule in spec["ingress"]] == [None]  # the proxy port, from anyone
    assert [_ports(rule) for rule in spec["egress"]] == [
        {(53, "UDP"), (53, "TCP")},
        {(5432, "TCP")},
        {(8000, "TCP")},
    ]
    manifests = render_manifests(
        helm_template,
        "-f",
        existing,
        "--set",
        "networkPolicy.enabled=true,networkPolicy.egress.enabled=false",
    )
    spec = one(manifests, "NetworkPolicy")["spec"]
    assert (spec["policyTypes"], "egress" in spec) == (["Ingress"], False)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (
            {"extraEnv": [{"name": "IDEMPROXY_STORE", "value": "postgresql://u:p@db/x"}]},
            "extraEnv: IDEMPROXY_STORE is the chart's own",
        ),
        (
            {"extraVolumes": [{"name": "config", "emptyDir": {}}]},
            "extraVolumes: the name config is the chart's own volume",
        ),
        (
            {"extraVolumeMounts": [{"name": "jwks", "mountPath": "/etc/jwks"}]},
            "extraVolumeMounts: jwks names no volume of extraVolumes",
        ),
        (
            {
                "extraVolumes": [{"name": "scratch", "emptyDir": {}}],
                "extraVolumeMounts": [{"name": "scratch", "mountPath": "/tmp/"}],
            },
            "extraVolumeMounts: /tmp/ is where the chart mounts its own volume",
        ),
        ({"nameOverride": "Idem_Proxy"}, "nameOverride: Does not match pattern"),
        ({"extraArgs": [7]}, "extraArgs.0: Invalid type. Expected: string"),
        ({"serviceAccount": {"create": "yes"}}, "serviceAccount.create: Invalid type"),
        (
            {"networkPolicy": {"ingress": {"proxy": {"from": [{"namespace": "x"}]}}}},
            "Additional property namespace is not allowed",
        ),
        (
            {"topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "zone"}]},
            "whenUnsatisfiable is required",
        ),
    ],
)
def test_bad_extensions_are_refused_with_a_clear_message(
    helm_template: Path, tmp_path: Path, values: dict[str, Any], message: str
) -> None:
    extra = tmp_path / "values.yaml"
    extra.write_text(yaml.safe_dump(values))
    result = render(helm_template, "-f", BASE, "-f", str(extra))
    assert result.returncode == 1
    assert message in result.stderr
