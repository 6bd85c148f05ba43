"""Fixtures for the deploy tests: helm-template built once, every scenario rendered once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.prerequisites import missing

from .chart import (
    CHART,
    MONITORING_API,
    SCENARIOS,
    HelmMissing,
    Manifest,
    build_helm_template,
    render,
    scenario_values,
)


@pytest.fixture(scope="session")
def helm_template() -> Path:
    try:
        return build_helm_template()
    except HelmMissing as exc:
        missing(str(exc))
    except RuntimeError as exc:
        pytest.fail(str(exc))


@pytest.fixture(scope="session")
def rendered_files(
    helm_template: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    out = tmp_path_factory.mktemp("rendered")
    files = {}
    for scenario in SCENARIOS:
        result = render(helm_template, "-f", str(CHART / "ci" / scenario), *MONITORING_API)
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
    return scenario_values(scenario)
