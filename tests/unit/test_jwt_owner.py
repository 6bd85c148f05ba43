"""SPEC §5, strategy `jwt`: the owner is a claim of a bearer JWT whose signature is verified."""

from __future__ import annotations

import string
from pathlib import Path
from typing import Any

import jwt
import pytest
from hypothesis import given
from hypothesis import strategies as st

from idemproxy.config.settings import JwtSettings
from idemproxy.constants import ANONYMOUS_OWNER
from idemproxy.errors import OwnerMissing
from idemproxy.identity.intent import OwnerPolicy, derive_owner, hash_credential
from idemproxy.identity.jwt_owner import JwtVerifier, hash_claim
from tests.support.jwtkit import (
    AUDIENCE,
    ISSUER,
    SECRET,
    claims,
    ec_key,
    hmac_token,
    hs256,
    public_jwk,
    public_pem,
    rsa_key,
    token,
    unsigned,
    verifier,
    with_payload,
    write_jwks,
    write_pem,
)


@pytest.fixture
def rs256(tmp_path: Path) -> JwtVerifier:
    return verifier(str(write_pem(tmp_path / "rsa.pem", rsa_key())), ["RS256"])


def owner_of(verifier: JwtVerifier, signed: str) -> str:
    return verifier.owner(f"Bearer {signed}")


def rejected(verifier: JwtVerifier, signed: str) -> str:
    """The problem detail for a token that must not verify."""
    with pytest.raises(OwnerMissing) as caught:
        owner_of(verifier, signed)
    assert caught.value.status == 401
    assert caught.value.code == "owner-missing"
    assert signed not in caught.value.detail
    return caught.value.detail


def test_hs256_owner_is_a_namespaced_hash_of_the_verified_sub() -> None:
    signed = token(claims("alice"), SECRET, "HS256")
    owner = owner_of(hs256(), signed)
    assert owner == hash_claim(ISSUER, "sub", "alice")
    assert len(owner) == 64 and set(owner) <= set(string.hexdigits.lower())
    assert "alice" not in owner
    # Never the hash of the header, the token, or the bare claim value.
    assert owner not in {hash_credential(f"Bearer {signed}"), hash_credential(signed)}
    assert owner != hash_credential("alice")


def test_a_refreshed_token_for_the_same_subject_is_the_same_owner() -> None:
    first = token(claims("alice", issued=-100, lifetime=200), SECRET, "HS256")
    refreshed = token(claims("alice", lifetime=3600), SECRET, "HS256")
    assert first != refreshed
    assert owner_of(hs256(), first) == owner_of(hs256(), refreshed)


def test_different_subjects_and_issuers_are_different_owners() -> None:
    alice = owner_of(hs256(), token(claims("alice"), SECRET, "HS256"))
    assert alice != owner_of(hs256(), token(claims("bob"), SECRET, "HS256"))
    elsewhere = claims("alice", iss="https://other-idp.example.test")
    assert alice != owner_of(hs256(), token(elsewhere, SECRET, "HS256"))


def test_rs256_with_a_generated_key_pair(rs256: JwtVerifier) -> None:
    assert owner_of(rs256, token(claims("alice"), rsa_key(), "RS256")) == hash_claim(
        ISSUER, "sub", "alice"
    )


def test_es256_with_a_p256_key(tmp_path: Path) -> None:
    es256 = verifier(str(write_pem(tmp_path / "ec.pem", ec_key())), ["ES256"])
    assert owner_of(es256, token(claims("alice"), ec_key(), "ES256"))
    rejected(es256, token(claims("alice"), ec_key(1), "ES256"))


def test_jwks_selects_the_key_by_kid(tmp_path: Path) -> None:
    jwks = write_jwks(
        tmp_path / "jwks.json",
        public_jwk(rsa_key(), "rsa-1", alg="RS256"),
        public_jwk(rsa_key(1), "rsa-2"),
        public_jwk(ec_key(), "ec-1"),
    )
    ring = verifier(str(jwks), ["RS256", "ES256"])
    alice = hash_claim(ISSUER, "sub", "alice")
    assert owner_of(ring, token(claims("alice"), rsa_key(), "RS256", kid="rsa-1")) == alice
    assert owner_of(ring, token(claims("alice"), rsa_key(1), "RS256", kid="rsa-2")) == alice
    assert owner_of(ring, token(claims("alice"), ec_key(), "ES256", kid="ec-1")) == alice
    # Signed with one key but naming another; an unknown kid; no kid among several keys.
    rejected(ring, token(claims("alice"), rsa_key(1), "RS256", kid="rsa-1"))
    rejected(ring, token(claims("alice"), rsa_key(), "RS256", kid="rsa-9"))
    rejected(ring, token(claims("alice"), rsa_key(), "RS256"))
    # A key's kid does not make another algorithm acceptable for it.
    rejected(ring, token(claims("alice"), ec_key(), "ES256", kid="rsa-1"))


def test_a_single_jwks_key_verifies_tokens_without_kid(tmp_path: Path) -> None:
    jwks = write_jwks(tmp_path / "jwks.json", public_jwk(rsa_key(), "only"))
    one = verifier(str(jwks), ["RS256"])
    assert owner_of(one, token(claims("alice"), rsa_key(), "RS256"))
    rejected(one, token(claims("alice"), rsa_key(), "RS256", kid="other"))


def test_an_expired_token_is_rejected(rs256: JwtVerifier) -> None:
    expired = claims("alice", issued=-3600, lifetime=600)
    assert rejected(rs256, token(expired, rsa_key(), "RS256")) == "The bearer token has expired."


def test_expiry_has_a_small_leeway() -> None:
    just_expired = token(claims("alice", issued=-310, lifetime=300), SECRET, "HS256")
    assert owner_of(hs256(leeway=30), just_expired)
    rejected(hs256(leeway=0), just_expired)


def test_a_token_without_exp_is_rejected(rs256: JwtVerifier) -> None:
    forever = {k: v for k, v in claims("alice").items() if k != "exp"}
    assert "claim" in rejected(rs256, token(forever, rsa_key(), "RS256"))


def test_a_token_not_yet_valid_is_rejected(rs256: JwtVerifier) -> None:
    later = claims("alice", nbf=int(claims()["iat"]) + 600, lifetime=3600)
    assert "not valid yet" in rejected(rs256, token(later, rsa_key(), "RS256"))


@pytest.mark.parametrize(
    "audience",
    ["https://other-api.example.test", ["https://other-api.example.test"], None],
    ids=["other", "other-in-list", "absent"],
)
def test_the_audience_must_match(rs256: JwtVerifier, audience: Any) -> None:
    payload = {**claims("alice"), "aud": audience}
    if audience is None:
        del payload["aud"]
    rejected(rs256, token(payload, rsa_key(), "RS256"))


def test_one_of_several_audiences_is_enough(tmp_path: Path) -> None:
    pem = str(write_pem(tmp_path / "rsa.pem", rsa_key()))
    several = JwtVerifier.from_settings(
        JwtSettings(key=pem, algorithms=["RS256"], audience=[AUDIENCE, "https://b.example.test"])
    )
    payload = {**claims("alice"), "aud": ["https://b.example.test", "https://c.example.test"]}
    assert owner_of(several, token(payload, rsa_key(), "RS256"))


def test_the_issuer_is_checked_when_configured() -> None:
    strict = hs256(issuer=ISSUER)
    assert owner_of(strict, token(claims("alice"), SECRET, "HS256"))
    other = claims("alice", iss="https://evil.example.test")
    assert "issuer" in rejected(strict, token(other, SECRET, "HS256"))
    rejected(strict, token({k: v for k, v in claims().items() if k != "iss"}, SECRET, "HS256"))
    # Without `issuer` any issuer verifies, but stays part of the owner.
    assert owner_of(hs256(), token(other, SECRET, "HS256"))


def test_a_wrong_signature_is_rejected(rs256: JwtVerifier) -> None:
    rejected(rs256, token(claims("alice"), rsa_key(1), "RS256"))
    mallory = token(claims("mallory"), rsa_key(), "RS256")
    assert rejected(rs256, with_payload(mallory, claims("alice"))) == (
        "The bearer token could not be verified."
    )
    rejected(hs256(), token(claims("alice"), SECRET[:-1] + "x", "HS256"))


@pytest.mark.parametrize("alg", ["none", "None", "NONE", "HS256", ""])
def test_unsigned_tokens_are_rejected(rs256: JwtVerifier, alg: str) -> None:
    rejected(rs256, unsigned(claims("alice"), alg))
    rejected(hs256(), unsigned(claims("alice"), alg))


def test_algorithm_confusion_hs256_signed_with_the_public_pem_is_rejected(
    rs256: JwtVerifier,
) -> None:
    """The classic attack: HMAC "signed" with the verifier's own public key bytes."""
    forged = hmac_token(claims("alice"), public_pem(rsa_key()))
    rejected(rs256, forged)


def test_a_token_for_another_algorithm_family_is_rejected(rs256: JwtVerifier) -> None:
    rejected(rs256, token(claims("alice"), ec_key(), "ES256"))
    rejected(rs256, token(claims("alice"), rsa_key(), "PS256"))  # RSA, but not configured


def test_a_missing_owner_claim_is_rejected() -> None:
    no_sub = {k: v for k, v in claims().items() if k != "sub"}
    assert "owner claim" in rejected(hs256(), token(no_sub, SECRET, "HS256"))
    assert "owner claim" in rejected(hs256(), token(claims(""), SECRET, "HS256"))


@pytest.mark.parametrize("value", [42, True, ["alice"], {"id": "alice"}, None])
def test_a_non_string_owner_claim_is_rejected(value: Any) -> None:
    by_uid = hs256(claim="uid")
    rejected(by_uid, token(claims("alice", uid=value), SECRET, "HS256"))


def test_a_configured_claim_is_the_owner() -> None:
    by_email = hs256(claim="email")
    alice = token(claims("user-1", email="alice@example.test"), SECRET, "HS256")
    assert owner_of(by_email, alice) == hash_claim(ISSUER, "email", "alice@example.test")
    # Another claim name is another namespace, even for the same value.
    assert hash_claim(ISSUER, "email", "x") != hash_claim(ISSUER, "sub", "x")


@pytest.mark.parametrize(
    "authorization",
    [
        "Basic YWxpY2U6c2VjcmV0",
        "Bearer",
        "Bearer ",
        "Bearer a b",
        "Token abc.def.ghi",
        "Bearer not-a-jwt",
        "Bearer abc.déf.ghi",
        "Bearer \udcff.x.y",  # undecodable header bytes, as aiohttp hands them over
    ],
)
def test_anything_but_a_bearer_jwt_is_rejected(authorization: str) -> None:
    with pytest.raises(OwnerMissing):
        hs256().owner(authorization)


def test_the_bearer_scheme_is_case_insensitive() -> None:
    signed = token(claims("alice"), SECRET, "HS256")
    assert hs256().owner(f"bearer {signed}") == hs256().owner(f"BEARER  {signed}")


@given(st.text(alphabet=string.ascii_letters + string.digits + "-_.=+/~ \udcff", max_size=400))
def test_any_header_either_verifies_or_is_401(authorization: str) -> None:
    with pytest.raises(OwnerMissing):
        hs256().owner(f"Bearer {authorization}")


def test_the_secret_never_shows_in_the_policy_repr() -> None:
    policy = OwnerPolicy("jwt", verifier=hs256())
    assert SECRET not in repr(policy)


class TestDeriveOwner:
    """SPEC §5 with a verifier: absent is anonymous (unless required), invalid is always 401."""

    def test_no_token_is_anonymous_unless_required(self) -> None:
        assert derive_owner(OwnerPolicy("jwt", verifier=hs256()), {}) == ANONYMOUS_OWNER
        with pytest.raises(OwnerMissing):
            derive_owner(OwnerPolicy("jwt", required=True, verifier=hs256()), {})

    @pytest.mark.parametrize("required", [False, True])
    def test_an_invalid_token_never_falls_into_the_anonymous_scope(self, required: bool) -> None:
        policy = OwnerPolicy("jwt", required=required, verifier=hs256())
        forged = unsigned(claims("alice"))
        with pytest.raises(OwnerMissing):
            derive_owner(policy, {"Authorization": f"Bearer {forged}"})
        with pytest.raises(OwnerMissing):
            derive_owner(policy, {"Authorization": "Basic YWxpY2U6c2VjcmV0"})

    def test_a_valid_token_is_its_claim_hash(self) -> None:
        policy = OwnerPolicy("jwt", verifier=hs256())
        signed = token(claims("alice"), SECRET, "HS256")
        owner = derive_owner(policy, {"Authorization": f"Bearer {signed}"})
        assert owner == hash_claim(ISSUER, "sub", "alice")


def test_a_critical_header_extension_it_does_not_know_is_rejected() -> None:
    """RFC 7515 §4.1.11: a `crit` extension the verifier does not understand voids the token."""
    critical = jwt.encode(
        claims("alice"), SECRET, algorithm="HS256", headers={"crit": ["x-tenant"], "x-tenant": 1}
    )
    rejected(hs256(), critical)
