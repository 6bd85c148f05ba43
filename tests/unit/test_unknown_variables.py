"""An IDEMPROXY_* variable that names no setting is a warning at start-up, naming it."""

from __future__ import annotations

import logging

import pytest
from pydantic import ValidationError

from idemproxy.config.settings import load_settings, log_settings_warnings, unknown_variables

UPSTREAM = "http://127.0.0.1:9"


def test_a_typo_is_named_with_the_closest_setting() -> None:
    assert unknown_variables({"IDEMPROXY_TTLL": "60"}) == [
        "environment variable IDEMPROXY_TTLL names no setting and is ignored"
        " (did you mean IDEMPROXY_TTL?)"
    ]


def test_a_typo_in_the_first_part_of_a_nested_name_keeps_the_rest() -> None:
    [warning] = unknown_variables({"IDEMPROXY_ADMN__TOKEN": "x"})
    assert "IDEMPROXY_ADMN__TOKEN names no setting" in warning
    assert "did you mean IDEMPROXY_ADMIN__TOKEN?" in warning


def test_a_name_like_no_setting_gets_no_suggestion() -> None:
    assert unknown_variables({"IDEMPROXY_ZZZZZZZZ": "1"}) == [
        "environment variable IDEMPROXY_ZZZZZZZZ names no setting and is ignored"
    ]


def test_settings_the_config_path_the_old_keys_and_other_programs_pass() -> None:
    environ = {
        "IDEMPROXY_TTL": "60",
        "IDEMPROXY_ADMIN__TOKEN": "x",
        "IDEMPROXY_STORE_FILE": "/dev/null",
        "IDEMPROXY_CONFIG": "idemproxy.yaml",
        "IDEMPROXY_REDIS_OPTIONS__TTL": "5",
        "IDEMPROXY_TEST_POSTGRES": "postgresql://",
        "HOME": "/root",
    }
    assert unknown_variables(environ) == []


def test_logged_once_at_start_up(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("IDEMPROXY_UPSTREAM_TIMEOUTT", "5")
    settings = load_settings(upstream=UPSTREAM)
    assert settings.upstream_timeout == 30  # ignored, as before: only now it is said
    with caplog.at_level(logging.WARNING, logger="idemproxy.config.settings"):
        log_settings_warnings(settings)
    assert [r.getMessage() for r in caplog.records] == [
        "settings: environment variable IDEMPROXY_UPSTREAM_TIMEOUTT names no setting and is"
        " ignored (did you mean IDEMPROXY_UPSTREAM_TIMEOUT?)"
    ]


def test_an_unknown_nested_key_is_still_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IDEMPROXY_ADMIN__TOKN", "x")
    with pytest.raises(ValidationError, match=r"admin\.tokn"):
        load_settings(upstream=UPSTREAM)
