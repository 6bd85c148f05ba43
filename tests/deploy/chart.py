"""Rendering the Helm chart and finding things in its manifests, for the deploy tests.

Rendering uses `helm template` when `helm` is on PATH; else helm-template, the offline stand-in
for it from the shared tools (`HELM_TEMPLATE_DIR`, default `../shared/tools/helm-template` next
to the repository), built into the git-ignored `build/`, never into the tools folder (read-only
in CI). Both take the same arguments: `[NAME] CHART [-f values.yaml]... [--set a.b=c]...`.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).parents[2]
CHART = ROOT / "helm" / "idemproxy"
RELEASE = "idemproxy"  # the release name `render` gives
SCENARIOS = sorted(path.name for path in (CHART / "ci").glob("*-values.yaml"))

Manifest = dict[str, Any]
# The scenarios render for a cluster with the Prometheus Operator: its objects are rendered only
# when its API is there (helm template's --api-versions, as a cluster would report it).
MONITORING_API = ("-a", "monitoring.coreos.com/v1")


class HelmMissing(RuntimeError):
    """Neither `helm` nor the stand-in's sources are there: the message says where it looked."""


def build_helm_template() -> Path:
    """An executable taking `helm template`'s arguments: `helm` itself when on PATH, else the
    stand-in, built (its build script installs the Debian packages it needs).

    Test processes running at once (the xdist workers of `scripts/test`) take turns, under a
    lock: the build may install packages, one apt at a time; and each puts its file in place
    whole (a rename), never writing over one that another process is running."""
    build = ROOT / "build"
    build.mkdir(exist_ok=True)
    with (build / "helm-template.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        return _build_helm_template(build)


def _build_helm_template(build: Path) -> Path:
    partial = build / f"helm-template.{os.getpid()}.partial"
    helm = shutil.which("helm")
    if helm is not None:
        wrapper = build / "helm-template-via-helm"
        partial.write_text(f'#!/bin/sh\nexec "{helm}" template "$@"\n')
        partial.chmod(0o755)
        os.replace(partial, wrapper)
        return wrapper
    default = ROOT.parent / "shared" / "tools" / "helm-template"
    tool = Path(os.environ.get("HELM_TEMPLATE_DIR", default))
    if not (tool / "build").is_file():
        raise HelmMissing(
            f"no `helm` on PATH and no helm-template stand-in at {tool} (HELM_TEMPLATE_DIR):"
            " install Helm 3 to run the chart tests"
        )
    binary = build / "helm-template"
    # Built once a run: the workers of one xdist run share its id; a run without one builds.
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID", "")
    stamp = build / "helm-template.run"
    if run and binary.is_file() and stamp.is_file() and stamp.read_text() == run:
        return binary
    built = subprocess.run(
        ["sh", str(tool / "build"), str(partial)], capture_output=True, text=True, check=False
    )
    if built.returncode != 0:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"building helm-template failed:\n{built.stderr}")
    os.replace(partial, binary)
    stamp.write_text(run)
    return binary


def render(helm_template: Path, *args: str) -> subprocess.CompletedProcess[str]:
    command = [str(helm_template), RELEASE, str(CHART), *args]
    return subprocess.run(command, capture_output=True, text=True, check=False)


def scenario_values(scenario: str) -> dict[str, Any]:
    """values.yaml with the scenario's file merged over it, as Helm merges them."""
    merged: dict[str, Any] = yaml.safe_load((CHART / "values.yaml").read_text())
    _deep_merge(merged, yaml.safe_load((CHART / "ci" / scenario).read_text()))
    return merged


def _deep_merge(base: dict[str, Any], override: dict[str, Any]) -> None:
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            _deep_merge(base[key], value)
        else:
            base[key] = value


def fullname(values: dict[str, Any]) -> str:
    """The name of the release's objects, by the rule values.yaml states for the overrides."""
    if values["fullnameOverride"]:
        return str(values["fullnameOverride"])
    name = values["nameOverride"] or "idemproxy"
    return RELEASE if name in RELEASE else f"{RELEASE}-{name}"


def render_manifests(helm_template: Path, *args: str) -> list[Manifest]:
    result = render(helm_template, *args)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


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


def proxy_pod(manifests: list[Manifest]) -> Manifest:
    pod: Manifest = one(manifests, "Deployment")["spec"]["template"]["spec"]
    return pod


def migrate_pod(manifests: list[Manifest]) -> Manifest | None:
    jobs = of_kind(manifests, "Job")
    pod: Manifest | None = jobs[0]["spec"]["template"]["spec"] if jobs else None
    return pod


def proxy_container(manifests: list[Manifest]) -> Manifest:
    [proxy] = [c for c in containers(proxy_pod(manifests)) if c["name"] == "idemproxy"]
    return proxy


def container_port(container: Manifest, port: int | str) -> int:
    """A port number, or the number of the container's port with that name."""
    if isinstance(port, int):
        return port
    [number] = [p["containerPort"] for p in container["ports"] if p["name"] == port]
    return int(number)


def settings_file(manifests: list[Manifest]) -> str:
    """The proxy's settings file, from the ConfigMap that holds it (not the dashboard's)."""
    [text] = [
        doc["data"]["idemproxy.yaml"]
        for doc in of_kind(manifests, "ConfigMap")
        if "idemproxy.yaml" in doc.get("data", {})
    ]
    return str(text)


def proxy_config(manifests: list[Manifest]) -> dict[str, Any]:
    config: dict[str, Any] = yaml.safe_load(settings_file(manifests))
    return config


def prestop_seconds(container: Manifest) -> int:
    """How long the container's preStop hook sleeps: the `sleep` action or `exec: sleep N`."""
    hook = container.get("lifecycle", {}).get("preStop", {})
    if "sleep" in hook:
        return int(hook["sleep"]["seconds"])
    if "exec" in hook:
        [program, seconds] = hook["exec"]["command"]
        assert program == "sleep"
        return int(seconds)
    return 0
