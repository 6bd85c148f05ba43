"""Secret settings read from files, as Kubernetes mounts a Secret: `*_file` beside each one."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from idemproxy.cli.main import main
from idemproxy.config.settings import load_settings
from idemproxy.errors import ConfigError
from idemproxy.identity.jwt_owner import JwtVerifier

UPSTREAM = "http://127.0.0.1:9"
HMAC_SECRET = "s" * 40
DSN = "postgresql://idemproxy:pa55word@db.internal:5432/idemproxy"


def _secret(tmp_path: Path, content: str, name: str = "secret") -> Path:
    path = tmp_path / name
    path.write_text(content)
    return path


def test_the_admin_token_from_a_file_without_its_line_break(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("IDEMPROXY_ADMIN__TOKEN_FILE", str(_secret(tmp_path, "t0ken\n")))
    settings = load_settings(upstream=UPSTREAM, admin={"listen": "0.0.0.0:9090"})
    assert settings.admin.token is not None
    assert settings.admin.token.get_secret_value() == "t0ken"


def test_a_windows_line_break_is_stripped_too(tmp_path: Path) -> None:
    path = _secret(tmp_path, "t0ken\r\n")
    settings = load_settings(upstream=UPSTREAM, admin={"token_file": str(path)})
    assert settings.admin.token is not None
    assert settings.admin.token.get_secret_value() == "t0ken"


def test_only_one_line_break_is_stripped(tmp_path: Path) -> None:
    path = _secret(tmp_path, "t0ken \n\n")
    settings = load_settings(upstream=UPSTREAM, admin={"token_file": str(path)})
    assert settings.admin.token is not None
    assert settings.admin.token.get_secret_value() == "t0ken \n"


def test_the_store_dsn_from_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IDEMPROXY_STORE_FILE", str(_secret(tmp_path, DSN + "\n")))
    assert load_settings(upstream=UPSTREAM).store == DSN


def test_the_redis_url_from_a_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    url = "redis://:pa55word@cache.internal:6379/0"
    monkeypatch.setenv("IDEMPROXY_REDIS__URL_FILE", str(_secret(tmp_path, url + "\n")))
    assert load_settings(upstream=UPSTREAM).redis.url == url


def test_the_jwt_hmac_secret_from_a_file_verifies_tokens(tmp_path: Path) -> None:
    path = _secret(tmp_path, HMAC_SECRET + "\n")
    settings = load_settings(
        upstream=UPSTREAM,
        owner={
            "strategy": "jwt",
            "jwt": {"secret_file": str(path), "algorithms": "HS256", "audience": "api"},
        },
    )
    verifier = JwtVerifier.from_settings(settings.owner.jwt, environ={})
    key = verifier.keys.select(None)
    assert key is not None
    assert key.key == HMAC_SECRET.encode()
    assert key.algorithms == ("HS256",)


def test_a_short_jwt_secret_from_a_file_is_refused_naming_the_setting(tmp_path: Path) -> None:
    settings = load_settings(
        upstream=UPSTREAM,
        owner={
            "strategy": "jwt",
            "jwt": {
                "secret_file": str(_secret(tmp_path, "short")),
                "algorithms": "HS256",
                "audience": "api",
            },
        },
    )
    with pytest.raises(ConfigError, match=r"owner\.jwt\.secret_file: the shared secret is 5 bytes"):
        JwtVerifier.from_settings(settings.owner.jwt, environ={})


@pytest.mark.parametrize(
    ("variables", "message"),
    [
        (
            ("IDEMPROXY_ADMIN__TOKEN", "IDEMPROXY_ADMIN__TOKEN_FILE"),
            "admin.token and admin.token_file",
        ),
        (("IDEMPROXY_STORE", "IDEMPROXY_STORE_FILE"), "store and store_file"),
        (("IDEMPROXY_REDIS__URL", "IDEMPROXY_REDIS__URL_FILE"), "redis.url and redis.url_file"),
    ],
)
def test_both_forms_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, variables: tuple[str, str], message: str
) -> None:
    value, file = variables
    monkeypatch.setenv(value, "redis://inline:6379" if "REDIS" in value else "sqlite:///x.db")
    monkeypatch.setenv(file, str(_secret(tmp_path, "redis://file:6379")))
    with pytest.raises(ConfigError, match="are both given: give only one") as caught:
        load_settings(upstream=UPSTREAM)
    assert message in str(caught.value)


def test_a_jwt_key_and_a_secret_file_are_refused(tmp_path: Path) -> None:
    jwt = {"key": "env:JWT", "secret_file": str(_secret(tmp_path, HMAC_SECRET))}
    with pytest.raises(ConfigError, match=r"owner\.jwt\.key and owner\.jwt\.secret_file are both"):
        load_settings(upstream=UPSTREAM, owner={"jwt": jwt})


def test_a_missing_file_names_the_setting_and_the_path(tmp_path: Path) -> None:
    missing = tmp_path / "absent"
    with pytest.raises(ConfigError) as caught:
        load_settings(upstream=UPSTREAM, admin={"token_file": str(missing)})
    reason = "No such file or directory"
    assert str(caught.value) == f"admin.token_file: cannot read {missing}: {reason}"


def test_an_empty_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"store_file: .* is empty"):
        load_settings(upstream=UPSTREAM, store_file=str(_secret(tmp_path, "\n")))


def test_the_content_is_never_echoed_nor_logged(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    path = _secret(tmp_path, "https://pa55word@not-a-store\n")
    monkeypatch.setenv("IDEMPROXY_STORE_FILE", str(path))
    caplog.set_level(logging.DEBUG)
    assert main(["serve", "--upstream", UPSTREAM]) == 2
    err = capsys.readouterr().err
    assert "idemproxy: invalid configuration: store: " in err
    assert "pa55word" not in err
    assert "pa55word" not in caplog.text
