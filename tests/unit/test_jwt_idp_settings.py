"""The settings of JWT keys from an identity provider (SPEC §5, §12): `owner.jwt.jwks_uri`,
`discovery` and the `owner.jwt.idp` block, refused at start-up when unusable, naming the field."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from idemproxy.cli.main import main
from idemproxy.config.settings import load_settings
from idemproxy.errors import ConfigError
from idemproxy.proxy.idp.fetch import max_age
from idemproxy.proxy.idp.policy import build_owner_policy

UPSTREAM = "http://127.0.0.1:9"
JWKS_URI = "https://idp.example.test/certs"


def jwt(**settings: Any) -> dict[str, Any]:
    base = {"algorithms": ["RS256"], "audience": ["api"]}
    return {"upstream": UPSTREAM, "owner": {"strategy": "jwt", "jwt": {**base, **settings}}}


def refusal(**settings: Any) -> str:
    with pytest.raises((ValidationError, ConfigError)) as raised:
        load_settings(**jwt(**settings))
    return str(raised.value)


def test_a_jwks_uri_or_discovery_is_enough_for_strategy_jwt() -> None:
    settings = load_settings(**jwt(jwks_uri=JWKS_URI, idp={"refresh_interval": "10m"}))
    assert settings.owner.jwt.remote and settings.owner.jwt.idp.refresh_interval == 600
    issuer = "https://idp.example.test/realms/main"
    found = load_settings(**jwt(discovery=True, issuer=issuer)).owner.jwt
    assert found.remote and found.idp.min_refresh_interval == 30


def test_the_environment_names_them_too(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("IDEMPROXY_OWNER__JWT__JWKS_URI", JWKS_URI)
    monkeypatch.setenv("IDEMPROXY_OWNER__JWT__IDP__TIMEOUT", "2s")
    settings = load_settings(**jwt())
    assert settings.owner.jwt.jwks_uri == JWKS_URI and settings.owner.jwt.idp.timeout == 2


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"jwks_uri": "http://idp.example.test/certs"}, "must be an https:// URL"),
        ({"discovery": True}, "owner.jwt.discovery needs owner.jwt.issuer"),
        ({"discovery": True, "issuer": "http://idp.test"}, "an https:// URL"),
        ({"jwks_uri": JWKS_URI, "key": "env:K"}, "owner.jwt.key and owner.jwt.jwks_uri"),
        (
            {"jwks_uri": JWKS_URI, "discovery": True, "issuer": "https://i.test"},
            "owner.jwt.jwks_uri and owner.jwt.discovery are both given",
        ),
        ({"jwks_uri": JWKS_URI, "algorithms": ["HS256"]}, "HS256 needs a shared secret"),
        (
            {"jwks_uri": JWKS_URI, "idp": {"refresh_interval": 10, "min_refresh_interval": 60}},
            "min_refresh_interval must not be longer than refresh_interval",
        ),
        ({"jwks_uri": JWKS_URI, "idp": {"timeout": "0s"}}, "greater than 0"),
        ({"jwks_uri": JWKS_URI, "idp": {"tls": {"ca_file": "/nonexistent/ca.pem"}}}, "cannot"),
    ],
    ids=[
        "http",
        "discovery-no-issuer",
        "discovery-http-issuer",
        "two-sources",
        "uri-and-discovery",
        "hmac",
        "bounds",
        "timeout",
        "ca-file",
    ],
)
def test_unusable_settings_stop_the_start(settings: dict[str, Any], message: str) -> None:
    assert message in refusal(**settings)


def test_a_ca_file_that_is_no_pem_stops_the_start_naming_the_field(tmp_path: Path) -> None:
    bundle = tmp_path / "ca.pem"
    bundle.write_text("not a certificate\n")
    settings = load_settings(**jwt(jwks_uri=JWKS_URI, idp={"tls": {"ca_file": str(bundle)}}))
    with pytest.raises(ConfigError, match=r"owner\.jwt\.idp\.tls\.ca_file"):
        build_owner_policy(settings.owner)


@pytest.mark.parametrize(
    ("fields", "seconds"),
    [
        ((), None),
        (("public, max-age=600",), 600.0),
        (('max-age="60"',), 60.0),
        (("public", "max-age=30"), 30.0),
        (("no-cache",), 0.0),
        (("max-age=600, no-store",), 0.0),
        (("s-maxage=5",), None),
    ],
)
def test_max_age_is_read_from_cache_control(fields: tuple[str, ...], seconds: float | None) -> None:
    assert max_age(fields) == seconds


def test_the_flag_sets_the_jwks_uri(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["serve", "--upstream", UPSTREAM, "--owner", "jwt", "--jwt-algorithms", "RS256"]
    code = main([*args, "--jwt-audience", "api", "--jwt-jwks-uri", "http://idp.example.test/c"])
    assert code == 2
    assert "owner.jwt.jwks_uri: Value error, must be an https:// URL" in capsys.readouterr().err
