"""Which `helm template` the chart tests render with: `helm` from PATH first, else the stand-in;
neither is a skip that says so, or a failure where every test must run."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.support.prerequisites import REQUIRE_ALL, missing

from .chart import CHART, HelmMissing, build_helm_template


def test_helm_on_path_is_used_as_helm_template(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake = tmp_path / "bin" / "helm"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\nprintf "%s\\n" "$@"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", str(fake.parent))
    command = build_helm_template()
    done = subprocess.run(
        [str(command), "idemproxy", str(CHART), "-f", "v.yaml"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.splitlines() == ["template", "idemproxy", str(CHART), "-f", "v.yaml"]


def test_without_helm_or_the_stand_in_it_says_what_is_missing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("HELM_TEMPLATE_DIR", str(tmp_path / "absent"))
    with pytest.raises(HelmMissing, match=r"no `helm` on PATH and no helm-template stand-in"):
        build_helm_template()


@pytest.mark.parametrize(("require", "outcome"), [("", "skipped"), ("1", "failed")])
def test_a_missing_prerequisite_skips_unless_every_test_must_run(
    monkeypatch: pytest.MonkeyPatch, require: str, outcome: str
) -> None:
    monkeypatch.setenv(REQUIRE_ALL, require)
    with pytest.raises(BaseException) as caught:
        missing("redis-server is not on PATH")
    expected = pytest.skip.Exception if outcome == "skipped" else pytest.fail.Exception
    assert caught.type is expected
    assert "redis-server is not on PATH" in str(caught.value)
