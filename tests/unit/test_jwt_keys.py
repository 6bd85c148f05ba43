"""SPEC §5, §12: JWT owner settings and keys; a bad one stops the start, naming the field."""

from __future__ import annotations

import datetime
import json
import logging
from pathlib import Path
from typing import Any

import jwt
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.serialization import Encoding
from cryptography.x509.oid import NameOID
from pydantic import ValidationError

from idemproxy.cli.main import main
from idemproxy.config.settings import JwtSettings, OwnerSettings, load_settings
from idemproxy.errors import ConfigError
from idemproxy.identity.intent import OwnerPolicy, owner_policy
from idemproxy.identity.jwt_keys import load_keys, parse_jwks
from idemproxy.identity.jwt_owner import JwtVerifier
from tests.support.jwtkit import (
    AUDIENCE,
    SECRET,
    claims,
    ec_key,
    private_pem,
    public_jwk,
    public_pem,
    rsa_key,
    token,
    write_jwks,
    write_pem,
)

JWT: dict[str, Any] = {"key": "env:JWT_SECRET", "algorithms": ["HS256"], "audience": [AUDIENCE]}
ENVIRON = {"JWT_SECRET": SECRET}


def config_error(source: str, algorithms: list[str], environ: dict[str, str] | None = None) -> str:
    with pytest.raises(ConfigError) as caught:
        load_keys(source, algorithms, ENVIRON if environ is None else environ)
    return str(caught.value)


def locations(error: ValidationError) -> set[str]:
    return {".".join(str(part) for part in e["loc"]) for e in error.errors()}


class TestSettings:
    def test_jwt_strategy_loads_with_flags_file_or_environment(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        settings = load_settings(upstream="http://x:1", owner={"strategy": "jwt", "jwt": JWT})
        assert settings.owner.jwt.claim == "sub"
        assert settings.owner.jwt.leeway == 30
        monkeypatch.setenv("IDEMPROXY_OWNER__STRATEGY", "jwt")
        monkeypatch.setenv("IDEMPROXY_OWNER__JWT__KEY", "env:JWT_SECRET")
        monkeypatch.setenv("IDEMPROXY_OWNER__JWT__ALGORITHMS", "HS256, HS384")
        monkeypatch.setenv("IDEMPROXY_OWNER__JWT__AUDIENCE", f"{AUDIENCE},https://b.test")
        monkeypatch.setenv("IDEMPROXY_OWNER__JWT__LEEWAY", "5")
        jwt = load_settings(upstream="http://x:1").owner.jwt
        assert jwt.algorithms == ["HS256", "HS384"]
        assert jwt.audience == [AUDIENCE, "https://b.test"]
        assert jwt.leeway == 5

    def test_a_flag_replaces_one_jwt_setting_and_keeps_the_rest(self, tmp_path: Path) -> None:
        config = tmp_path / "idemproxy.yaml"
        config.write_text(json.dumps({"upstream": "http://x:1", "owner": {"jwt": JWT}}))
        settings = load_settings(config, owner={"strategy": "jwt", "jwt": {"claim": "email"}})
        assert settings.owner.jwt.key == "env:JWT_SECRET"
        assert settings.owner.jwt.claim == "email"

    @pytest.mark.parametrize("missing", ["key", "algorithms", "audience"])
    def test_jwt_strategy_needs_key_algorithms_and_audience(self, missing: str) -> None:
        jwt = {k: v for k, v in JWT.items() if k != missing}
        with pytest.raises(ValidationError, match=rf"owner\.jwt\.{missing}"):
            load_settings(upstream="http://x:1", owner={"strategy": "jwt", "jwt": jwt})

    @pytest.mark.parametrize(
        ("jwt", "field"),
        [
            ({"algorithms": ["none"]}, "owner.jwt.algorithms"),
            ({"algorithms": "RS256,None"}, "owner.jwt.algorithms"),
            ({"algorithms": ["rs256"]}, "owner.jwt.algorithms"),
            ({"algorithms": ["HS1"]}, "owner.jwt.algorithms"),
            ({"key": "env:"}, "owner.jwt.key"),
            ({"key": "env:NOT A NAME"}, "owner.jwt.key"),
            ({"leeway": 3600}, "owner.jwt.leeway"),
            ({"leeway": -1}, "owner.jwt.leeway"),
            ({"claim": ""}, "owner.jwt.claim"),
            ({"secret": "x"}, "owner.jwt.secret"),
        ],
    )
    def test_bad_jwt_values_name_the_field(self, jwt: dict[str, Any], field: str) -> None:
        with pytest.raises(ValidationError) as caught:
            load_settings(upstream="http://x:1", owner={"strategy": "jwt", "jwt": {**JWT, **jwt}})
        assert field in locations(caught.value)

    @pytest.mark.parametrize(
        "strategy", ["header: X-Tenant", "header:X-Tenant ", "header:X Tenant", "header:Ténant"]
    )
    def test_header_names_must_be_rfc9110_tokens(self, strategy: str) -> None:
        """Else the header is never found and every request lands in the anonymous scope."""
        with pytest.raises(ValidationError) as caught:
            load_settings(upstream="http://x:1", owner={"strategy": strategy})
        assert "owner.strategy" in locations(caught.value)

    def test_the_policy_is_built_from_the_settings_with_its_verifier(
        self, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv("JWT_SECRET", SECRET)
        owner = load_settings(upstream="http://x:1", owner={"strategy": "jwt", "jwt": JWT}).owner
        policy = owner_policy(owner)
        assert isinstance(policy.verifier, JwtVerifier)
        assert (policy.strategy, policy.required) == ("jwt", False)
        plain = owner_policy(load_settings(upstream="http://x:1").owner)
        assert plain.verifier is None

    def test_the_settings_stay_data(self) -> None:
        """Nothing built from them (a verifier, its keys) is kept inside the settings model."""
        assert OwnerSettings.__private_attributes__ == {}
        assert JwtSettings.__private_attributes__ == {}

    def test_no_jwt_policy_without_a_verifier(self) -> None:
        with pytest.raises(ConfigError):
            OwnerPolicy("jwt")
        verifier = JwtVerifier.from_settings(JwtSettings(**JWT), environ=ENVIRON)
        with pytest.raises(ConfigError):
            OwnerPolicy("authorization", verifier=verifier)


class TestStartup:
    """`idemproxy serve` stops with exit 2 and the field's name before opening the store."""

    def serve(self, capsys: pytest.CaptureFixture[str], *flags: str) -> str:
        args = ["serve", "--upstream", "http://127.0.0.1:9", "--store", "sqlite:///nowhere/x.db"]
        assert main([*args, "--owner", "jwt", *flags]) == 2
        return capsys.readouterr().err

    def test_a_missing_secret_variable(
        self, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.delenv("IDEMPROXY_TEST_NO_SUCH_SECRET", raising=False)
        err = self.serve(
            capsys,
            *("--jwt-key", "env:IDEMPROXY_TEST_NO_SUCH_SECRET"),
            *("--jwt-algorithms", "HS256", "--jwt-audience", AUDIENCE),
        )
        assert "owner.jwt.key" in err
        assert "IDEMPROXY_TEST_NO_SUCH_SECRET" in err

    def test_a_secret_on_the_command_line_is_refused_and_not_echoed(
        self, capsys: pytest.CaptureFixture[str]
    ) -> None:
        err = self.serve(
            capsys, "--jwt-key", SECRET, "--jwt-algorithms", "HS256", "--jwt-audience", AUDIENCE
        )
        assert "owner.jwt" in err
        assert SECRET not in err

    def test_alg_none_is_refused(self, capsys: pytest.CaptureFixture[str]) -> None:
        flags = ("--jwt-key", "env:X", "--jwt-algorithms", "none", "--jwt-audience", AUDIENCE)
        assert "owner.jwt.algorithms" in self.serve(capsys, *flags)

    def test_missing_algorithms(self, capsys: pytest.CaptureFixture[str]) -> None:
        err = self.serve(capsys, "--jwt-key", "env:X", "--jwt-audience", AUDIENCE)
        assert "owner.jwt.algorithms" in err


class TestKeys:
    def test_a_missing_environment_variable(self) -> None:
        message = config_error("env:NOPE", ["HS256"], environ={})
        assert message.startswith("owner.jwt.key:") and "NOPE" in message

    @pytest.mark.parametrize(("algorithm", "need"), [("HS256", 32), ("HS512", 64)])
    def test_a_short_secret(self, algorithm: str, need: int) -> None:
        message = config_error("env:S", [algorithm], environ={"S": "x" * (need - 1)})
        assert "owner.jwt.key" in message and str(need) in message
        assert "x" * 10 not in message

    def test_a_public_key_as_the_secret(self) -> None:
        message = config_error("env:S", ["HS256"], environ={"S": public_pem(rsa_key()).decode()})
        assert "owner.jwt.key" in message

    def test_a_secret_with_asymmetric_algorithms(self) -> None:
        assert "owner.jwt.algorithms" in config_error("env:JWT_SECRET", ["HS256", "RS256"])

    def test_hmac_algorithms_with_a_public_key(self, tmp_path: Path) -> None:
        """No configuration can verify HS256 with a public key's bytes (algorithm confusion)."""
        pem = write_pem(tmp_path / "rsa.pem", rsa_key())
        message = config_error(str(pem), ["RS256", "HS256"])
        assert message.startswith("owner.jwt.algorithms:") and "HS256" in message

    def test_an_algorithm_that_does_not_fit_the_pem_key(self, tmp_path: Path) -> None:
        assert "ES256" in config_error(str(write_pem(tmp_path / "k.pem", rsa_key())), ["ES256"])
        p384 = write_pem(tmp_path / "p384.pem", ec_key(0, "P-384"))
        assert "ES256" in config_error(str(p384), ["ES256"])
        assert load_keys(str(p384), ["ES384"], {}).default is not None

    def test_a_missing_file_is_not_echoed(self, tmp_path: Path) -> None:
        message = config_error(str(tmp_path / "s3cr3t-value"), ["RS256"])
        assert message.startswith("owner.jwt.key:") and "s3cr3t-value" not in message

    @pytest.mark.parametrize(
        "content",
        [b"", b"hello", b"-----BEGIN PUBLIC KEY-----\nnope\n-----END PUBLIC KEY-----\n"],
        ids=["empty", "text", "bad-pem"],
    )
    def test_a_file_that_is_no_key(self, tmp_path: Path, content: bytes) -> None:
        path = tmp_path / "key.pem"
        path.write_bytes(content)
        assert config_error(str(path), ["RS256"]).startswith("owner.jwt.key:")

    def test_a_private_key_file_is_refused(self, tmp_path: Path) -> None:
        path = tmp_path / "private.pem"
        path.write_bytes(private_pem(rsa_key()))
        assert "private key" in config_error(str(path), ["RS256"])

    def test_a_weak_rsa_key_is_refused(self, tmp_path: Path) -> None:
        weak = write_pem(tmp_path / "weak.pem", rsa_key(0, 1024))
        assert "2048" in config_error(str(weak), ["RS256"])

    def test_a_certificate_file_gives_its_public_key(self, tmp_path: Path) -> None:
        key = rsa_key()
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "idp.example.test")])
        now = datetime.datetime.now(datetime.UTC)
        certificate = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(1)
            .not_valid_before(now)
            .not_valid_after(now + datetime.timedelta(days=1))
            .sign(key, hashes.SHA256())
        )
        path = tmp_path / "idp.crt"
        path.write_bytes(certificate.public_bytes(Encoding.PEM))
        settings = JwtSettings(key=str(path), algorithms=["RS256"], audience=[AUDIENCE])
        verifier = JwtVerifier.from_settings(settings)
        assert verifier.owner(f"Bearer {token(claims('alice'), key, 'RS256')}")


class TestJwks:
    def test_not_json_or_no_keys(self, tmp_path: Path) -> None:
        path = tmp_path / "jwks.json"
        for content in ('{"keys": [', "{}", '{"keys": []}', '{"keys": "x"}', "[1]"):
            path.write_text(content)
            assert config_error(str(path), ["RS256"]).startswith("owner.jwt.key")

    def test_symmetric_and_private_keys_are_refused(self, tmp_path: Path) -> None:
        oct_key = {"kty": "oct", "kid": "s", "k": "c2VjcmV0"}
        assert "keys[0]" in config_error(str(write_jwks(tmp_path / "a", oct_key)), ["RS256"])
        private = {**public_jwk(rsa_key(), "p"), "d": "AQAB"}
        assert "keys[0]" in config_error(str(write_jwks(tmp_path / "b", private)), ["RS256"])

    def test_keys_a_kid_selects_ambiguously_are_left_out(self, tmp_path: Path) -> None:
        """Among several keys, one without a kid or two sharing one could verify a token that
        names another: those are left out, the rest load (RFC 7517 §5)."""
        twice = write_jwks(
            tmp_path / "a",
            public_jwk(rsa_key(), "a"),
            public_jwk(rsa_key(1), "a"),
            public_jwk(rsa_key(2), "c"),
        )
        ring = load_keys(str(twice), ["RS256"], {})
        assert set(ring.by_kid) == {"c"} and ring.default is None
        assert "keys[1] (kid 'a'): the kid appears twice" in ring.skipped
        only_twice = write_jwks(
            tmp_path / "b", public_jwk(rsa_key(), "a"), public_jwk(rsa_key(1), "a")
        )
        assert "twice" in config_error(str(only_twice), ["RS256"])
        anonymous = write_jwks(tmp_path / "c", public_jwk(rsa_key()), public_jwk(rsa_key(1), "b"))
        ring = load_keys(str(anonymous), ["RS256"], {})
        assert set(ring.by_kid) == {"b"} and ring.default is None
        assert "keys[0]: no kid, and the JWKS holds several keys" in ring.skipped

    def test_encryption_keys_and_keys_for_other_algorithms_are_left_out(
        self, tmp_path: Path
    ) -> None:
        jwks = write_jwks(
            tmp_path / "jwks.json",
            public_jwk(rsa_key(), "enc", use="enc"),
            public_jwk(rsa_key(1), "ps", alg="PS256"),
            public_jwk(ec_key(), "ec"),
            public_jwk(rsa_key(2), "sig", alg="RS256"),
        )
        ring = load_keys(str(jwks), ["RS256"], {})
        assert set(ring.by_kid) == {"sig"}
        assert ring.default is not None and ring.default.algorithms == ("RS256",)
        assert "no signing key" in config_error(str(jwks), ["ES384"])


def unusable_entries() -> list[Any]:
    """JWKS entries the proxy cannot verify a token with, as identity providers publish them
    beside their signing keys (RFC 7517 §5: ignored, not fatal)."""
    return [
        public_jwk(rsa_key(3), "oaep", alg="RSA-OAEP"),  # encryption, named by alg only
        public_jwk(rsa_key(4, 1024), "weak"),
        {"kty": "AKP", "kid": "pq", "alg": "ML-DSA-44", "pub": "AAAA"},
        public_jwk(ec_key(), "ecdh", alg="ECDH-ES"),
        {"kty": "OKP", "crv": "X25519", "kid": "x25519", "x": "AAAA"},
        {**public_jwk(rsa_key(5), "enc-private", use="enc"), "d": "AQAB"},
        {"kty": "EC", "crv": "P-192", "kid": "p192", "x": "AAAA", "y": "AAAA"},
        {**public_jwk(rsa_key(6)), "kid": 7},
        public_jwk(rsa_key(7), "none", alg="none"),
        {"kty": "RSA", "kid": "broken", "n": "!!", "e": "AQAB"},
        "not a key",
    ]


class TestUnusableJwksEntries:
    def test_they_are_left_out_logged_and_the_rest_loads(
        self, tmp_path: Path, caplog: pytest.LogCaptureFixture
    ) -> None:
        good = public_jwk(rsa_key(2), "good", alg="RS256")
        jwks = write_jwks(tmp_path / "jwks.json", *unusable_entries(), good)
        with caplog.at_level(logging.WARNING, "idemproxy.owner"):
            ring = load_keys(str(jwks), ["RS256", "ES256", "EdDSA"], {})
        assert set(ring.by_kid) == {"good"}
        assert len(ring.skipped) == len(unusable_entries())
        logged = "\n".join(r.getMessage() for r in caplog.records)
        # One line each, up to five, then a count: named by position and kid, with the reason.
        assert "keys[0] (kid 'oaep'): fits none of owner.jwt.algorithms" in logged
        assert "keys[1] (kid 'weak'): an RSA key of 1024 bits" in logged
        assert "keys[2] (kid 'pq'): a key type no configured algorithm uses" in logged
        assert "6 more keys left out" in logged
        reasons = "\n".join(ring.skipped)
        assert "keys[7] (kid '7'): kid is not a string" in reasons
        assert "keys[5] (kid 'enc-private'): a private or symmetric key" in reasons
        assert "keys[6] (kid 'p192'): an EC curve" in reasons
        assert "keys[8] (kid 'none'): fits none" in reasons
        assert "keys[9] (kid 'broken'): not a valid public JWK" in reasons
        assert "keys[10]: not a JSON object" in reasons
        assert "AQAB" not in logged  # never a key's bytes

    def test_a_set_of_nothing_usable_is_refused_saying_why(self, tmp_path: Path) -> None:
        jwks = write_jwks(tmp_path / "jwks.json", *unusable_entries())
        message = config_error(str(jwks), ["RS256"])
        assert message.startswith("owner.jwt.key: no signing key in the JWKS fits")
        assert "keys[0] (kid 'oaep')" in message and "and 6 more" in message

    def test_keys_for_other_curves_are_never_built(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Key type, curve and alg are checked first: a 1 MiB JWKS of keys no configured
        algorithm takes costs no key construction (each takes about 40 µs)."""
        built: list[object] = []
        real = jwt.PyJWK

        def counting(*args: Any) -> jwt.PyJWK:
            built.append(args)
            return real(*args)

        monkeypatch.setattr(jwt, "PyJWK", counting)
        entry = public_jwk(ec_key(0, "P-384"), "p384")
        keys = [{**entry, "kid": f"k{n}"} for n in range(2000)]
        data = json.dumps({"keys": [*keys, public_jwk(rsa_key(2), "good")]}).encode()
        ring = parse_jwks(data, ["RS256"], "the JWKS")
        assert set(ring.by_kid) == {"good"}
        assert len(built) == 1


def test_a_jwks_nested_too_deeply_is_a_config_error_not_a_crash() -> None:
    """RecursionError left the parser: the key refresher's task died with a traceback."""
    deep = b'{"keys": %s}' % (b"[" * 100_000 + b"]" * 100_000)
    with pytest.raises(ConfigError, match="the JWKS is nested too deeply"):
        parse_jwks(deep, ["RS256"], "the JWKS")


def test_a_jwks_file_of_unusable_keys_stops_the_start_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`alg: none` raised NotImplementedError out of the parser: a traceback, not a message."""
    jwks = write_jwks(tmp_path / "jwks.json", public_jwk(rsa_key(7), "none", alg="none"))
    args = ["serve", "--upstream", "http://127.0.0.1:9", "--store", "sqlite:///nowhere/x.db"]
    flags = ["--owner", "jwt", "--jwt-key", str(jwks), "--jwt-algorithms", "RS256"]
    assert main([*args, *flags, "--jwt-audience", AUDIENCE]) == 2
    err = capsys.readouterr().err
    assert "owner.jwt.key: no signing key in the JWKS fits owner.jwt.algorithms" in err
    assert "keys[0] (kid 'none'): fits none of owner.jwt.algorithms" in err
    assert "Traceback" not in err
