"""The chart checks the keys of `proxy.config` against the settings (config/key_tree.py): a
mistyped key stops `helm install`, and every settings file the proxy takes passes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from idemproxy.config.key_tree import chart_schema

from .chart import CHART, ROOT, render

pytestmark = pytest.mark.slow

SCHEMA = CHART / "values.schema.json"
BASE = str(CHART / "ci" / "with-redis-values.yaml")
EXAMPLES = sorted((ROOT / "config").glob("*.yaml"))


def test_the_charts_copy_of_the_settings_keys_is_current() -> None:
    """Run scripts/chart-schema after changing a setting."""
    text = SCHEMA.read_text()
    assert chart_schema(json.loads(text)) == text


@pytest.mark.parametrize(
    ("setting", "key"),
    [
        ("proxy.config.owner.stratgy=authorization", "stratgy"),
        ("proxy.config.limits.respons_buffer=1", "respons_buffer"),
        ("proxy.config.log_fromat=json", "log_fromat"),
        ("proxy.config.redis_options.tiemout=1", "tiemout"),  # the old name of redis's options
    ],
)
def test_a_mistyped_settings_key_stops_the_chart(
    helm_template: Path, setting: str, key: str
) -> None:
    result = render(helm_template, "-f", BASE, "--set", setting)
    assert result.returncode == 1
    assert key in result.stderr


def test_keys_in_lists_and_under_names_of_the_users_own_are_checked_too(
    helm_template: Path, tmp_path: Path
) -> None:
    """`upstreams` is keyed by the upstream's origin: those names are free, what each holds
    is not; nor is what each of the `routes` holds."""
    tls: dict[str, object] = {"ca_file": "/etc/ca.pem", "verify": True}
    given: dict[str, Any] = {"proxy": {"config": {"upstreams": {"https://pay:8443": {"tls": tls}}}}}
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump(given))
    assert render(helm_template, "-f", BASE, "-f", str(values)).returncode == 0
    tls["verfy"] = tls.pop("verify")
    values.write_text(yaml.safe_dump(given))
    result = render(helm_template, "-f", BASE, "-f", str(values))
    assert result.returncode == 1 and "verfy" in result.stderr
    given["proxy"]["config"] = {"routes": [{"prefx": "/pay", "upstream": "http://pay:8000"}]}
    values.write_text(yaml.safe_dump(given))
    result = render(helm_template, "-f", BASE, "-f", str(values))
    assert result.returncode == 1 and "prefx" in result.stderr


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda path: path.name)
def test_every_example_settings_file_passes_the_charts_schema(example: Path) -> None:
    """The files in config/ are settings files the proxy takes (tests/unit checks they load):
    as `proxy.config` their keys all pass."""
    schema = json.loads(SCHEMA.read_text())
    settings = {"$ref": "#/definitions/settings", "definitions": schema["definitions"]}
    jsonschema.Draft7Validator(settings).validate(yaml.safe_load(example.read_text()))
