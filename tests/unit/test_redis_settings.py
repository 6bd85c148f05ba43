"""The `redis:` settings block, and the keys of before (`redis: URL`, `redis_options:`, their
environment variables) that still read, each with a warning naming its new key."""

from __future__ import annotations

import logging
import os
import textwrap
from pathlib import Path

import pytest

from idemproxy.cli import main as cli
from idemproxy.config.settings import Settings, load_settings, log_settings_warnings
from idemproxy.errors import ConfigError

UPSTREAM = "http://127.0.0.1:9"
URL = "redis://:secret@cache:6379/1"
OPTIONS_MOVED = (
    "`redis_options:` is deprecated: move its settings into the `redis:` block of the config file"
)


@pytest.fixture(autouse=True)
def _no_redis_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [name for name in os.environ if name.upper().startswith("IDEMPROXY_REDIS")]:
        monkeypatch.delenv(name)


def _file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "idemproxy.yaml"
    path.write_text(f"upstream: {UPSTREAM}\n" + textwrap.dedent(text))
    return path


def _options(settings: Settings) -> tuple[str | None, float, float, float, int]:
    redis = settings.redis
    return redis.url, redis.timeout, redis.write_timeout, redis.ttl, redis.max_body


def test_the_block_in_the_file(tmp_path: Path) -> None:
    path = _file(
        tmp_path,
        f"""
        redis:
          url: {URL}
          timeout: 0.02
          write_timeout: 0.25
          ttl: 60
          max_body: 1024
        """,
    )
    settings = load_settings(path)
    assert _options(settings) == (URL, 0.02, 0.25, 60, 1024)
    assert settings.renamed_keys == ()


def test_the_block_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IDEMPROXY_REDIS__URL", URL)
    monkeypatch.setenv("IDEMPROXY_REDIS__TTL", "60")
    settings = load_settings(upstream=UPSTREAM)
    assert _options(settings) == (URL, 0.05, 0.5, 60, 1 << 20)
    assert settings.renamed_keys == ()


def test_off_by_default_and_with_an_empty_url(monkeypatch: pytest.MonkeyPatch) -> None:
    assert load_settings(upstream=UPSTREAM).redis.url is None
    monkeypatch.setenv("IDEMPROXY_REDIS__URL", "")
    assert load_settings(upstream=UPSTREAM).redis.url is None


def test_the_url_is_checked_naming_the_new_key() -> None:
    with pytest.raises(ValueError, match=r"redis\.url"):
        load_settings(upstream=UPSTREAM, redis={"url": "http://cache:6379"})


def test_the_keys_of_before_in_the_file_still_read_and_warn(tmp_path: Path) -> None:
    path = _file(
        tmp_path,
        f"""
        redis: {URL}
        redis_options:
          timeout: 0.02
          max_body: 1024
        """,
    )
    settings = load_settings(path)
    assert _options(settings) == (URL, 0.02, 0.5, 300, 1024)
    assert settings.renamed_keys == (
        "`redis: URL` is deprecated: write `redis: {url: URL}` in the config file instead",
        OPTIONS_MOVED,
    )


def test_the_variables_of_before_still_read_and_warn(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IDEMPROXY_REDIS", URL)
    monkeypatch.setenv("IDEMPROXY_REDIS_OPTIONS__TTL", "60")
    settings = load_settings(upstream=UPSTREAM)
    assert _options(settings) == (URL, 0.05, 0.5, 60, 1 << 20)
    assert settings.renamed_keys == (
        "IDEMPROXY_REDIS is deprecated: set IDEMPROXY_REDIS__URL instead",
        "IDEMPROXY_REDIS_OPTIONS__… is deprecated: set IDEMPROXY_REDIS__… instead",
    )


def test_the_options_variable_of_before_as_one_json_object_still_reads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # pydantic-settings read the whole `redis_options` block from one variable, as JSON; its
    # members given as IDEMPROXY_REDIS_OPTIONS__… variables beside it take precedence.
    monkeypatch.setenv("IDEMPROXY_REDIS", URL)
    monkeypatch.setenv("IDEMPROXY_REDIS_OPTIONS", '{"ttl": 60, "max_body": 1000}')
    monkeypatch.setenv("IDEMPROXY_REDIS_OPTIONS__MAX_BODY", "2000")
    settings = load_settings(upstream=UPSTREAM)
    assert _options(settings) == (URL, 0.05, 0.5, 60, 2000)
    assert "IDEMPROXY_REDIS_OPTIONS__… is deprecated: set IDEMPROXY_REDIS__… instead" in (
        settings.renamed_keys
    )


def test_an_options_variable_of_before_that_is_not_a_json_object_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("IDEMPROXY_REDIS_OPTIONS", "ttl=60")
    with pytest.raises(ConfigError, match="IDEMPROXY_REDIS_OPTIONS must be a JSON object"):
        load_settings(upstream=UPSTREAM)


def test_an_old_variable_and_a_new_block_in_the_file_both_count(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("IDEMPROXY_REDIS", URL)
    settings = load_settings(_file(tmp_path, "redis:\n  timeout: 0.02\n"))
    assert _options(settings)[:2] == (URL, 0.02)
    assert settings.renamed_keys == (
        "IDEMPROXY_REDIS is deprecated: set IDEMPROXY_REDIS__URL instead",
    )


def test_the_flag_sets_the_url_beside_old_options_quietly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[Settings] = []
    monkeypatch.setattr("idemproxy.cli.serve.serve", lambda settings, *_: seen.append(settings))
    path = _file(tmp_path, "redis_options:\n  ttl: 60\n")
    assert cli.main(["serve", "--config", str(path), "--redis", URL]) == 0
    assert _options(seen[0])[::3] == (URL, 60)
    assert seen[0].renamed_keys == (OPTIONS_MOVED,)


def test_both_forms_in_the_file_are_refused(tmp_path: Path) -> None:
    path = _file(tmp_path, f"redis:\n  url: {URL}\nredis_options:\n  ttl: 60\n")
    with pytest.raises(ConfigError, match=r"`redis_options` and `redis` are both given"):
        load_settings(path)


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ("IDEMPROXY_REDIS", "IDEMPROXY_REDIS__TTL", "IDEMPROXY_REDIS and IDEMPROXY_REDIS__…"),
        (
            "IDEMPROXY_REDIS_OPTIONS__TTL",
            "IDEMPROXY_REDIS__TTL",
            "IDEMPROXY_REDIS_OPTIONS__… and IDEMPROXY_REDIS__…",
        ),
    ],
)
def test_both_forms_in_the_environment_are_refused(
    monkeypatch: pytest.MonkeyPatch, old: str, new: str, message: str
) -> None:
    monkeypatch.setenv(old, URL if old == "IDEMPROXY_REDIS" else "30")
    monkeypatch.setenv(new, "60")
    with pytest.raises(ConfigError, match=message):
        load_settings(upstream=UPSTREAM)


def test_the_command_line_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("idemproxy.cli.serve.serve", lambda _settings: None)
    path = _file(tmp_path, f"redis:\n  url: {URL}\nredis_options:\n  ttl: 60\n")
    assert cli.main(["serve", "--config", str(path)]) == 2
    assert "`redis_options` and `redis` are both given" in capsys.readouterr().err


def test_each_warning_is_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("IDEMPROXY_REDIS", URL)
    settings = load_settings(_file(tmp_path, f"redis: {URL}\n"))
    with caplog.at_level(logging.WARNING, logger="idemproxy.config.settings"):
        log_settings_warnings(settings)
    assert [record.getMessage() for record in caplog.records] == [
        "settings: IDEMPROXY_REDIS is deprecated: set IDEMPROXY_REDIS__URL instead",
        "settings: `redis: URL` is deprecated: write `redis: {url: URL}` in the config file"
        " instead",
    ]
