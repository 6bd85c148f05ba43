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
