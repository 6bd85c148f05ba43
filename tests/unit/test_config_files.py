"""Every `config/*.yaml` is a working settings file: it loads through the real settings model.

Files are found by glob, so a new example is checked as soon as it is added. A file whose
comments tell the reader to set IDEMPROXY_ADMIN__TOKEN from a secret gets one, and so does every
variable a file reads a header value from (`env:NAME`, an API key), as a deployment would; no
other environment variable reaches the settings.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from idemproxy.config.settings import load_settings

CONFIG_DIR = Path(__file__).parents[2] / "config"
CONFIG_FILES = sorted(CONFIG_DIR.glob("*.yaml"))
# user:password@ in a URL value: examples must not teach putting credentials in a file (a
# comment may still show the DSN syntax).
_PASSWORD_IN_URL = re.compile(r"://[^/@\s:]+:[^/@\s]+@")
_READ_FROM_ENV = re.compile(r"^[^#\n]*\benv:([A-Za-z_][A-Za-z0-9_]*)", re.MULTILINE)


def test_the_deployment_shapes_have_examples() -> None:
    names = {path.name for path in CONFIG_FILES}
    assert {"drop-in.yaml", "sidecar.yaml", "standalone.yaml"} <= names


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda path: path.name)
def test_config_file_loads(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in [name for name in os.environ if name.startswith("IDEMPROXY_")]:
        monkeypatch.delenv(variable)
    text = path.read_text()
    if "IDEMPROXY_ADMIN__TOKEN" in text:
        monkeypatch.setenv("IDEMPROXY_ADMIN__TOKEN", "from-a-secret")
    for variable in _READ_FROM_ENV.findall(text):
        # As a Standard Webhooks secret is written (whsec_ and base64), and an API key may be.
        monkeypatch.setenv(variable, "whsec_ZnJvbS1hLXNlY3JldA==")
    settings = load_settings(path)
    assert settings.all_routes


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda path: path.name)
def test_config_file_is_commented_and_holds_no_credentials(path: Path) -> None:
    text = path.read_text()
    assert text.startswith("#"), "start with a comment saying which shape this is"
    values = [line.split("#", 1)[0] for line in text.splitlines()]
    assert not [value for value in values if _PASSWORD_IN_URL.search(value)]
