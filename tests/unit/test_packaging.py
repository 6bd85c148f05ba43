"""The version is written once (idemproxy.__version__); the image and the chart follow it."""

from __future__ import annotations

import re
import tomllib
from importlib.metadata import version
from pathlib import Path

import yaml

import idemproxy

ROOT = Path(__file__).parents[2]


def test_the_installed_distribution_has_the_package_version() -> None:
    assert version("idemproxy") == idemproxy.__version__


def test_pyproject_reads_the_version_from_the_package() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in pyproject["project"]
    assert pyproject["project"]["dynamic"] == ["version"]
    dynamic = pyproject["tool"]["setuptools"]["dynamic"]["version"]
    assert dynamic == {"attr": "idemproxy.__version__"}


def test_the_image_is_labelled_with_the_package_version() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    [default] = re.findall(r"^ARG VERSION=(\S+)$", dockerfile, re.MULTILINE)
    assert default == idemproxy.__version__


def test_the_chart_deploys_the_package_version() -> None:
    chart = yaml.safe_load((ROOT / "helm" / "idemproxy" / "Chart.yaml").read_text())
    assert chart["appVersion"] == idemproxy.__version__


def test_the_licence_file_is_the_one_pyproject_declares() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert pyproject["license"] == "Apache-2.0"
    assert pyproject["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text
    assert "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text


def test_the_build_backend_understands_an_spdx_licence() -> None:
    requires = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    assert "setuptools>=77" in requires


def test_the_image_build_context_holds_the_licence_it_copies() -> None:
    # pyproject names LICENSE in license-files: a build without it fails.
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    assert "!LICENSE" in lines
    assert re.search(r"^COPY .*\bLICENSE\b", (ROOT / "Dockerfile").read_text(), re.MULTILINE)


def _pins() -> dict[str, str]:
    lines = (ROOT / "constraints.txt").read_text().splitlines()
    pins = {}
    for line in lines:
        if line and not line.startswith("#"):
            name, _, pinned = line.partition("==")
            assert pinned and " " not in pinned, f"not an exact pin: {line}"
            pins[re.sub(r"[-_.]+", "-", name).lower()] = pinned
    return pins


def _names(requirements: list[str]) -> set[str]:
    return {
        re.sub(r"[-_.]+", "-", re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0]).lower()
        for requirement in requirements
    }


def test_every_dependency_is_pinned_by_the_constraints_file() -> None:
    """Reproducible installs: what CI, scripts/install and the image take (scripts/lock)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = _names(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        wanted |= _names(extra)
    pins = _pins()
    assert sorted(wanted - set(pins)) == []
    assert "idemproxy" not in pins


def test_every_install_takes_the_constraints_file() -> None:
    assert "--constraint constraints.txt" in (ROOT / "scripts" / "install").read_text()
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert re.search(r"^COPY .*\bconstraints\.txt\b", dockerfile, re.MULTILINE)
    assert "--constraint constraints.txt" in dockerfile
    assert "!constraints.txt" in (ROOT / ".dockerignore").read_text().splitlines()


def test_the_installed_versions_are_the_pinned_ones() -> None:
    """This environment was installed through the constraints (scripts/install)."""
    for name in ("aiohttp", "asyncpg", "pydantic", "redis", "pytest"):
        assert version(name) == _pins()[name], name
